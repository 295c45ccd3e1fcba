// `hbmio cache`: the node's resident cache (hbmio/cache.hpp): serve, status, add.
#pragma once

namespace CLI {
class App;
}

namespace hbmio::cli {

// Registers `cache` and its subcommands; their callbacks run inside app.parse() and store the exit
// status in `exit_status`.
void add_cache_command(CLI::App& app, int& exit_status);

}  // namespace hbmio::cli
