// `hbmio cache serve | status | add` (cache.hpp).
#include "cache.hpp"

#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli_common.hpp"

namespace hbmio::cli {

namespace {

struct CacheFlags {
  std::string socket, host_memory = "", user_memory = "0", gpu_memory = "0", json, mode = "0600";
  std::uint64_t max_files = 0, user_files = 0;
  std::vector<std::string> allow, paths;
  std::vector<int> gpus;
  bool wait = false;
};

// The library's status object with the command's name and version, as every --json of the command.
nlohmann::json status_json_of_command(const CacheStatus& s) {
  nlohmann::json j = nlohmann::json::parse(status_json(s));
  j["command"] = "cache status";
  j["version"] = version();
  return j;
}

void print_status(const CacheStatus& s) {
  fmt::print("resident cache at {}, up {:.0f} s\n", s.socket, s.uptime_seconds);
  fmt::print("  host memory: {} of {} held (per user at most {}), {} file(s) of at most {} ({} per user)\n", format_size(s.host_bytes),
             format_size(s.host_bytes_limit), format_size(s.user_bytes_limit), s.entries.size(), s.files_limit, s.user_files_limit);
  if (s.gpu_bytes_limit > 0)
    fmt::print("  GPU memory: {} held, at most {} per GPU; {} share(s) by clients now\n", format_size(s.gpu_bytes),
               format_size(s.gpu_bytes_limit), s.shares);
  fmt::print("  hits {}, misses {}, taken in {}, evicted {}, dropped as changed {}, refused {}; clients now {}, since start {}\n", s.hits,
             s.misses, s.adds, s.evictions, s.stale, s.refused, s.clients, s.served_clients);
  for (const CacheEntryStatus& e : s.entries)
    fmt::print("  {:>10}  {:<6} {:<5} {:<8} {:>5} hit(s)  idle {:>6.0f} s  uid {}  {}{}\n", format_size(e.bytes), e.state, e.tier,
               e.pinned ? "pinned" : "unpinned", e.hits, e.idle_seconds, e.owner, e.path,
               e.gpus.empty() ? std::string()
                              : fmt::format("  (also on {}{})", fmt::join(e.gpus, ", "),
                                            e.shares ? fmt::format(", shared by {} client load(s)", e.shares) : std::string()));
}

}  // namespace

void add_cache_command(CLI::App& app, int& exit_status) {
  auto flags = std::make_shared<CacheFlags>();
  auto* cache = app.add_subcommand(
      "cache",
      "The node's resident cache: a process that holds checkpoint files in shared memory, so that the next process "
      "on this node loads them from there instead of reading the files again (loads ask it where HBMIO_CACHE names "
      "its socket). See docs/cache.md.");
  cache->require_subcommand(1);
  const std::string socket_help = fmt::format("The server's Unix socket (default: $HBMIO_CACHE, else {})", default_cache_socket());

  auto* serve = cache->add_subcommand(
      "serve",
      "Serve the cache until SIGINT or SIGTERM. Clients name files by sending descriptors they opened (never paths), so "
      "each gets only files it could read; who may connect at all is the socket's mode");
  serve->add_option("--socket", flags->socket, socket_help)->type_name("PATH");
  serve->add_option("--host-memory", flags->host_memory, "Shared host memory the cache may hold (e.g. 64GiB); least recently used files go first")
      ->required()
      ->check(size_value());
  serve->add_option("--user-memory", flags->user_memory, "Of which the files one user added may hold (default: all of it)")
      ->check(size_value());
  serve->add_option("--max-files", flags->max_files,
                    "Files the cache holds at most, least recently used going first (default 0: half the server's descriptor limit)")
      ->type_name("N");
  serve->add_option("--user-files", flags->user_files, "Of which the files one user added (default 0: all of them)")->type_name("N");
  serve->add_option("--allow", flags->allow, "Only cache files under these directories (repeatable; default: any file a client opened)")
      ->type_name("DIR")
      ->check(CLI::ExistingDirectory);
  serve->add_option("--gpu-memory", flags->gpu_memory,
                    "The device tier: GPU memory the cache may hold on each GPU (e.g. 24GiB; 0: none). Files go there when "
                    "'hbmio cache add --gpu N' asks; a load into that GPU then gets a device-to-device copy")
      ->type_name("SIZE")
      ->check(size_value())
      ->capture_default_str();
  serve->add_option("--mode", flags->mode, "The socket's file mode: 0600 (this user only) or 0666 (every user of the node)")
      ->check(CLI::IsMember({"0600", "0660", "0666"}))
      ->capture_default_str();
  serve->callback([flags, &exit_status] {
    CacheServerOptions options{.socket = flags->socket.empty() ? configured_cache_socket() : flags->socket,
                               .host_bytes = parse_size(flags->host_memory),
                               .user_bytes = parse_size(flags->user_memory),
                               .allow = flags->allow,
                               .socket_mode = static_cast<unsigned>(std::stoul(flags->mode, nullptr, 8)),
                               .gpu_bytes = parse_size(flags->gpu_memory),
                               .max_files = flags->max_files,
                               .user_files = flags->user_files};
    if (options.socket.empty()) options.socket = default_cache_socket();
    CacheServer server(options);
    fmt::print(stderr, "hbmio cache: serving on {} (host memory {}{}, socket mode {}); point loads at it with HBMIO_CACHE={}\n",
               options.socket, format_size(options.host_bytes),
               options.gpu_bytes ? fmt::format(", GPU memory {} per GPU", format_size(options.gpu_bytes)) : std::string(), flags->mode,
               options.socket);
    exit_status = run_stoppable(
        [&](const std::atomic<bool>& stop) {
          server.run(stop);
          return 0;
        },
        [](bool) { return std::string("hbmio cache: stopped; the cached files are gone with it"); });
  });

  auto* status = cache->add_subcommand("status", "What the cache holds, where, how big; hits, misses, evictions, clients");
  status->add_option("--socket", flags->socket, socket_help)->type_name("PATH");
  add_json_option(status, flags->json, "Write the status");
  status->callback([flags, &exit_status] {
    std::string socket = flags->socket.empty() ? configured_cache_socket() : flags->socket;
    if (socket.empty()) socket = default_cache_socket();
    const CacheStatus s = cache_status(socket);
    if (!flags->json.empty()) write_json(status_json_of_command(s), flags->json);
    if (flags->json != "-") print_status(s);
    exit_status = 0;
  });

  auto* add = cache->add_subcommand("add", "Ask the cache to take in these files (it reads them itself, in the background)");
  add->add_option("paths", flags->paths, "Files to take in (a checkpoint's .safetensors shards)")->required()->check(CLI::ExistingFile);
  add->add_option("--socket", flags->socket, socket_help)->type_name("PATH");
  add->add_flag("--wait", flags->wait, "Return once each file is held (or refused), on the GPUs asked for too");
  add->add_option("--gpu", flags->gpus,
                  "Also keep a copy in this GPU's memory (this process's CUDA device number; repeatable), where the server "
                  "has a device tier (--gpu-memory)")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber);
  add_json_option(add, flags->json, "Write what the server said per file");
  add->callback([flags, &exit_status] {
    std::string socket = flags->socket.empty() ? configured_cache_socket() : flags->socket;
    if (socket.empty()) socket = default_cache_socket();
    const std::vector<std::string> said = cache_add(socket, flags->paths, flags->wait, flags->gpus);
    nlohmann::json files = nlohmann::json::array();
    bool all_held = true;
    for (std::size_t k = 0; k < said.size(); ++k) {
      files.push_back({{"path", flags->paths[k]}, {"result", said[k]}});
      all_held = all_held && (said[k].starts_with("held") || (!flags->wait && said[k].starts_with("adding"))) &&
                 said[k].find("; not on ") == std::string::npos;
      if (flags->json != "-") fmt::print("{}: {}\n", flags->paths[k], said[k]);
    }
    if (!flags->json.empty()) write_json({{"command", "cache add"}, {"version", version()}, {"socket", socket}, {"files", files}}, flags->json);
    exit_status = all_held ? 0 : 1;
  });
}

}  // namespace hbmio::cli
