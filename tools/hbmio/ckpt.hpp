// `hbmio ckpt`: inspect, load, save, verify and checksum safetensors checkpoints.
#pragma once

namespace CLI {
class App;
}

namespace hbmio::cli {

// Registers `ckpt` and its subcommands (info, load, save, verify, checksum) on `app`. The chosen
// subcommand runs inside app.parse() and stores its exit status in `exit_status` (1 when a check
// fails); errors are thrown (hbmio::Error) for main() to report.
void add_ckpt_command(CLI::App& app, int& exit_status);

}  // namespace hbmio::cli
