#include "ckpt.hpp"

#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli_common.hpp"
#include "hbmio/checkpoint.hpp"

namespace hbmio::cli {
namespace {
namespace st = safetensors;

struct CkptFlags {
  // placement: replicate, as the Python load's default (every location gets every tensor: what a
  // program that does not know about shards expects).
  std::string path, into = "host", backend, json, names, layout = "single", placement = "replicate";
  std::string verify;  // "" (off), checksums, strict or bytes
  std::string cache;   // "" ($HBMIO_CACHE decides), use, add or off
  bool no_checksums = false, reuse_memory = false, drop_cache = false, force = false, verbose = false, share = false;
  unsigned runs = 1;
  // save: a generated checkpoint of `count` tensors of `tensor_size` bytes each
  unsigned count = 8;
  std::string tensor_size = "16MiB", dtype = "BF16", from = "host", max_shard_size;
  std::uint64_t seed = 1;
  TuningFlags tuning;
};

// A comma-separated list ("" is none). An empty item ("a,,b", "a,") is refused rather than
// skipped: it is a typo, and skipping it turned "--names ," into "load everything".
std::vector<std::string> split_list(const std::string& text, const char* option) {
  std::vector<std::string> items;
  if (text.empty()) return items;
  std::stringstream in(text + ",");  // so that a trailing comma leaves an empty last item
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) throw Error(errno_code(EINVAL), {.op = fmt::format("ckpt load {}", option)}, fmt::format("an empty item in '{}'", text));
    items.push_back(item);
  }
  return items;
}

nlohmann::json tensor_json(const std::string& name, st::Dtype dtype, const std::vector<std::uint64_t>& shape,
                           std::uint64_t bytes, const std::string& file, std::uint64_t offset) {
  return {{"name", name}, {"dtype", std::string(st::to_string(dtype))}, {"shape", shape},
          {"bytes", bytes}, {"file", file}, {"offset", offset}};
}

int run_info(const CkptFlags& f) {
  const auto files = open_checkpoint(f.path);
  nlohmann::json tensors = nlohmann::json::array(), shards = nlohmann::json::array();
  std::uint64_t total = 0, count = 0;
  bool checksums = true;
  for (const auto& file : files) {
    const bool has = file.header.metadata.contains("hbmio.checksum");
    checksums = checksums && has;
    shards.push_back({{"file", file.path}, {"tensors", file.header.tensors.size()}, {"data_bytes", file.header.data_size},
                      {"checksums", has}, {"metadata", file.header.metadata}});
    for (const auto& t : file.header.tensors) {
      tensors.push_back(tensor_json(t.name, t.dtype, t.shape, t.size(), file.path, file.header.data_offset + t.begin));
      total += t.size();
      ++count;
    }
  }
  if (!f.json.empty()) {
    write_json({{"path", f.path}, {"files", shards}, {"tensors", tensors}, {"tensor_count", count},
                {"total_bytes", total}, {"checksums", checksums}},
               f.json);
    if (f.json == "-") return 0;
  }
  fmt::print("{}: {} tensors, {} in {} file(s), checksums: {}\n", shown_path(f.path), count, format_size(total), files.size(),
             checksums ? "yes (XXH3-64)" : "no");
  // Columns as wide as their widest entry (names run long; F8_E4M3FNUZ is 11 characters).
  std::size_t name_width = 4, dtype_width = 4, shape_width = 5;
  std::vector<std::string> shapes;
  for (const auto& t : tensors) {
    shapes.push_back(fmt::format("[{}]", fmt::join(t["shape"].get<std::vector<std::uint64_t>>(), ", ")));
    name_width = std::max(name_width, t["name"].get<std::string>().size());
    dtype_width = std::max(dtype_width, t["dtype"].get<std::string>().size());
    shape_width = std::max(shape_width, shapes.back().size());
  }
  name_width = std::min<std::size_t>(name_width, 60);  // a longer name pushes its own row only
  for (std::size_t i = 0; i < tensors.size(); ++i)
    fmt::print("  {:<{}} {:<{}} {:<{}} {:>12}\n", tensors[i]["name"].get<std::string>(), name_width,
               tensors[i]["dtype"].get<std::string>(), dtype_width, shapes[i], shape_width,
               format_size(tensors[i]["bytes"].get<std::uint64_t>()));
  return 0;
}

// The median of a benchmark's runs (the upper one of an even count); `runs` is not empty.
double median_of(std::vector<double> runs) {
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

// "cuda:0,1" or "cuda:0,cuda:1" or "host,pinned": a bare number after a cuda location is the next GPU.
std::vector<MemoryLocation> parse_locations(const std::string& text) {
  std::vector<MemoryLocation> out;
  for (const std::string& token : split_list(text, "--into")) {
    const bool number = !token.empty() && std::all_of(token.begin(), token.end(), [](char c) { return c >= '0' && c <= '9'; });
    out.push_back(number && !out.empty() && out.back().kind == MemoryKind::device ? MemoryLocation::parse("cuda:" + token)
                                                                                 : MemoryLocation::parse(token));
  }
  if (out.empty()) throw Error(errno_code(EINVAL), {.op = "ckpt load"}, "--into names no memory location");
  return out;
}

// --verify=bytes: every loaded tensor against a plain read of its bytes in its file (an
// independent read, for files without checksums). Throws Error(Errc::verify_failed) at the first
// difference, naming the tensor.
void check_bytes(const LoadedCheckpoint& loaded) {
  for (const auto& t : loaded.tensors())
    if (const auto at = first_difference(t.data, t.file, t.file_offset))
      throw Error(make_error_code(Errc::verify_failed), {.op = "verify", .path = t.file, .offset = *at},
                  fmt::format("tensor '{}' as loaded differs from a plain read of the file at byte {}", t.name, *at));
}

// What a load's --verify found, in words: which files it could not check, and why.
void report_verification(const CkptFlags& f, const LoadedCheckpoint& loaded) {
  if (f.verify == "bytes") {
    fmt::print("verified: every tensor identical to a plain read of its file\n");
  } else if (!f.verify.empty() && loaded.unverified_files().empty()) {
    fmt::print("verified: every tensor's XXH3-64 checksum matches\n");
  } else if (!f.verify.empty()) {
    const auto& files = loaded.unverified_files();
    fmt::print("not verified: {} file(s) of the checkpoint hold no hbmio checksums ({}{}); their tensors were loaded "
               "unchecked. Add checksums with `hbmio ckpt checksum`, compare bytes with --verify=bytes, or refuse such "
               "files with --verify=strict\n",
               files.size(), files.front(), files.size() > 1 ? fmt::format(" and {} more", files.size() - 1) : "");
  }
}

// Several locations: one pipeline each, all at once (load() with LoadRequest::locations).
int run_load_multi(const CkptFlags& f, const std::vector<MemoryLocation>& into) {
  if (f.placement != "shard" && f.placement != "replicate")
    throw Error(errno_code(EINVAL), {.op = "ckpt load"}, fmt::format("--placement must be shard or replicate, not '{}'", f.placement));
  if (f.reuse_memory || f.layout != "single")
    throw Error(errno_code(EINVAL), {.op = "ckpt load"}, "--reuse-memory and --layout take one location in --into");
  for (const auto& where : into)
    if (where.kind == MemoryKind::device) Buffer::allocate(where, 1);  // contexts made before timing
  LoadRequest request{.path = f.path, .locations = into, .placement = f.placement == "shard" ? Placement::shard : Placement::replicate};
  request.options.names = split_list(f.names, "--names");
  request.options.verify = f.verify == "checksums" || f.verify == "strict";
  request.options.require_checksums = f.verify == "strict";
  request.options.backend = f.backend;
  request.options.engine_options = f.tuning.resolve();
  // One engine per location for every run: rings and pinned buffers are set up once.
  std::vector<std::unique_ptr<Engine>> engines;
  for (std::size_t k = 0; k < into.size(); ++k) {
    engines.push_back(make_engine(f.backend, *request.options.engine_options));
    request.engines.push_back(engines.back().get());
  }
  std::vector<double> seconds;
  std::optional<LoadResult> loaded;
  for (unsigned run = 1; run <= f.runs; ++run) {
    loaded.reset();  // frees the previous run's memory first
    if (f.drop_cache)
      for (const auto& file : open_checkpoint(f.path)) drop_page_cache(file.path);
    loaded = load(request);
    seconds.push_back(loaded->seconds);
    if (f.runs > 1 && f.json != "-") fmt::print("run {}/{}: {:.3f} s\n", run, f.runs, loaded->seconds);
  }
  const double median = median_of(seconds);
  const LoadResult& r = *loaded;
  nlohmann::json locations = nlohmann::json::array();
  for (std::size_t k = 0; k < into.size(); ++k) {
    const LoadedCheckpoint& c = r.locations[k];
    std::uint64_t bytes = 0;
    for (const auto& t : c.tensors()) bytes += t.data.size;
    locations.push_back({{"into", into[k].to_string()}, {"tensors", c.tensors().size()}, {"tensor_bytes", bytes},
                         {"bytes_from_storage", c.stats().bytes}, {"verified", c.verified()}, {"stats", to_json(c.stats())}});
    if (f.verify == "bytes") check_bytes(c);
  }
  const double gib = static_cast<double>(f.placement == "shard" ? r.bytes_from_storage : r.bytes_from_storage * into.size()) / (1 << 30);
  if (!f.json.empty()) {
    write_json({{"path", f.path}, {"placement", f.placement}, {"seconds", r.seconds}, {"bytes_from_storage", r.bytes_from_storage},
                {"bytes_between_locations", r.bytes_between}, {"gib_per_second_delivered", gib / r.seconds},
                {"verify", f.verify.empty() ? "off" : f.verify}, {"unverified_files", r.locations[0].unverified_files()},
                {"run_seconds", seconds}, {"median_seconds", median}, {"median_gib_per_second_delivered", gib / median},
                {"locations", locations}},
               f.json);
    if (f.json == "-") return 0;
  }
  for (const auto& l : locations)
    fmt::print("  {:<8} {:>6} tensors  {:>12} in memory  {:>12} read from storage{}\n", l["into"].get<std::string>(),
               l["tensors"].get<std::size_t>(), format_size(l["tensor_bytes"].get<std::uint64_t>()),
               format_size(l["bytes_from_storage"].get<std::uint64_t>()), l["verified"].get<bool>() ? ", verified" : "");
  fmt::print("{} into {} location(s): {:.3f} s, {} from storage (each byte once), {} between locations, {:.2f} GiB/s delivered\n",
             f.placement, into.size(), r.seconds, format_size(r.bytes_from_storage), format_size(r.bytes_between),
             gib / r.seconds);
  if (f.runs > 1) fmt::print("median of {} runs: {:.3f} s, {:.2f} GiB/s delivered\n", f.runs, median, gib / median);
  report_verification(f, r.locations[0]);
  return 0;
}

int run_load(const CkptFlags& f) {
  if (const auto all = parse_locations(f.into); all.size() > 1) return run_load_multi(f, all);
  const MemoryLocation into = MemoryLocation::parse(f.into);
  // One engine for every run: its rings and pinned bounce buffers are set up once, as in a
  // program that loads several checkpoints.
  auto engine = make_engine(f.backend, f.tuning.resolve());
  // The device's context is created before timing (a framework has it already when it loads).
  if (into.kind == MemoryKind::device) Buffer::allocate(into, 1);
  std::uint64_t total = 0;
  for (const auto& file : open_checkpoint(f.path))
    for (const auto& t : file.header.tensors) total += t.size();
  LoadOptions options{.into = into, .names = split_list(f.names, "--names"),
                      .layout = f.layout == "per-tensor" ? TensorLayout::per_tensor : TensorLayout::single_allocation,
                      .verify = f.verify == "checksums" || f.verify == "strict", .require_checksums = f.verify == "strict",
                      .engine = engine.get(),
                      .cache = f.cache == "use"   ? CacheUse::use
                               : f.cache == "add" ? CacheUse::add
                               : f.cache == "off" ? CacheUse::off
                                                  : CacheUse::configured,
                      .share = f.share};
  // --reuse-memory: one allocation, made before timing, that every run loads into (what a
  // framework's caching allocator gives its loaders after the first load).
  Buffer reused;
  if (f.reuse_memory) {
    reused = Buffer::allocate(into, plan_load({.path = f.path, .options = options}).bytes);
    options.destination = reused.span();
  }
  std::vector<double> seconds;
  std::vector<std::string> notes;
  std::optional<LoadedCheckpoint> loaded;
  std::string cache;
  for (unsigned run = 1; run <= f.runs; ++run) {
    loaded.reset();  // frees the previous run's memory first
    if (f.drop_cache)
      for (const auto& file : open_checkpoint(f.path)) cache = drop_page_cache(file.path);
    loaded = with_progress(fmt::format("load {} -> {}", shown_path(f.path), f.into), total, [&](std::atomic<std::uint64_t>* progress) {
      options.progress = progress;
      return load_checkpoint(f.path, options);
    });
    seconds.push_back(loaded->stats().seconds);
    notes.push_back(loaded->stats().note);  // the first run's says what first use cost
    if (f.runs > 1 && f.json != "-") fmt::print("run {}/{}: {}\n", run, f.runs, summary_line(loaded->stats(), f.verbose));
  }
  if (f.verify == "bytes") check_bytes(*loaded);
  const double median = median_of(seconds);
  const Stats& s = loaded->stats();
  if (!f.json.empty()) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto& t : loaded->tensors()) tensors.push_back(tensor_json(t.name, t.dtype, t.shape, t.data.size, t.file, t.file_offset));
    write_json({{"path", f.path}, {"into", f.into}, {"verify", f.verify.empty() ? "off" : f.verify},
                {"verified", loaded->verified() || f.verify == "bytes"}, {"unverified_files", loaded->unverified_files()},
                {"reuse_memory", f.reuse_memory}, {"share", f.share},
                {"page_cache", f.drop_cache ? cache : std::string("as found")}, {"stats", to_json(s)},
                {"run_seconds", seconds}, {"run_notes", notes}, {"median_seconds", median},
                {"median_gib_per_second", static_cast<double>(s.bytes) / median / (1 << 30)}, {"tensors", tensors}},
               f.json);
    if (f.json == "-") return 0;
  }
  if (f.runs > 1)
    fmt::print("median of {} runs: {:.3f} s, {:.2f} GiB/s\n", f.runs, median, static_cast<double>(s.bytes) / median / (1 << 30));
  else
    fmt::print("{}\n", summary_line(s, f.verbose));
  report_verification(f, *loaded);
  return 0;
}

// A check that the value is one of `choices`, saying which they are.
CLI::Validator one_of(std::vector<std::string> choices) {
  return CLI::Validator(
      [choices](std::string& value) -> std::string {
        if (std::find(choices.begin(), choices.end(), value) != choices.end()) return {};
        return fmt::format("must be {}, not '{}'", fmt::join(choices, " or "), value);
      },
      "");
}

// ckpt generate writes random tensors: an existing checkpoint at PATH is replaced only with
// --force (a file, or a directory holding safetensors files or an index; an empty directory or
// one of other files is filled).
void refuse_to_replace(const CkptFlags& f) {
  if (f.force) return;
  if (is_remote_url(f.path)) {
    // An object already at the URL (or the index of a prefix) is a checkpoint.
    const std::string base = f.path.ends_with("/") ? f.path + "model.safetensors.index.json" : f.path;
    try {
      RemoteObject::open(base);
    } catch (const Error& e) {
      if (e.code() == std::errc::no_such_file_or_directory) return;
      throw;
    }
    throw Error(errno_code(EEXIST), {.op = "ckpt generate", .path = f.path},
                "an object is there already, and ckpt generate would replace it with random tensors: add --force to do that");
  }
  struct stat st {};
  if (::stat(f.path.c_str(), &st) != 0) return;
  bool checkpoint = !S_ISDIR(st.st_mode);
  if (!checkpoint) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(f.path, ec)) {
      const std::string name = entry.path().filename().string();
      checkpoint = checkpoint || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
    }
  }
  if (checkpoint)
    throw Error(errno_code(EEXIST), {.op = "ckpt generate", .path = f.path},
                fmt::format("{} is there already, and ckpt generate would replace it with random tensors: add --force to do that",
                            S_ISDIR(st.st_mode) ? "a checkpoint" : "a file"));
}

int run_save(const CkptFlags& f, const std::atomic<bool>& stop) {
  refuse_to_replace(f);
  // A file's header spells dtypes in capitals (and a reader must refuse other spellings); a user
  // typing one need not: bf16 is BF16.
  std::string upper = f.dtype;
  for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const auto dtype = st::parse_dtype(upper);
  if (!dtype)
    throw Error(errno_code(EINVAL), {.op = "ckpt generate --dtype"},
                fmt::format("unknown dtype '{}' (one of BOOL U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 "
                            "BF16 I32 U32 F32 C64 F64 I64 U64 F4 F6_E2M3 F6_E3M2, in any case)",
                            f.dtype));
  const std::uint64_t bytes = parse_size(f.tensor_size);
  std::uint64_t max_shard_size = 0;
  if (!f.max_shard_size.empty() && (max_shard_size = parse_size(f.max_shard_size)) == 0)
    throw Error(errno_code(EINVAL), {.op = "ckpt generate --max-shard-size"}, "must be at least 1 byte (leave it out for one file)");
  const unsigned bits = st::bits_per_element(*dtype);
  if (bytes * 8 % bits != 0)
    throw Error(errno_code(EINVAL), {.op = "ckpt generate"}, fmt::format("{} bytes is not a whole number of {} elements", bytes, f.dtype));
  const std::uint64_t elements = bytes * 8 / bits;
  // Matrices of 1024 columns where the size allows (like real weights), else vectors.
  const std::vector<std::uint64_t> shape =
      elements % 1024 == 0 && elements >= 1024 ? std::vector<std::uint64_t>{elements / 1024, 1024} : std::vector<std::uint64_t>{elements};
  const MemoryLocation from = MemoryLocation::parse(f.from);
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;
  Buffer staging = Buffer::allocate({MemoryKind::host}, bytes);
  for (unsigned i = 0; i < f.count; ++i) {
    fill_random(staging.data(), bytes, f.seed + i);
    buffers.push_back(Buffer::allocate(from, bytes));
    copy_memory(buffers.back().span(), staging.span());
    tensors.push_back({fmt::format("layers.{}.weight", i), *dtype, shape, buffers.back().span()});
  }
  const Stats s = with_progress(fmt::format("save {} -> {}", shown_path(f.from), shown_path(f.path)), bytes * f.count,
                                [&](std::atomic<std::uint64_t>* progress) {
                                  return save_checkpoint(f.path, tensors,
                                                         {.metadata = {{"format", "pt"}, {"generator", "hbmio ckpt generate"}},
                                                          .checksums = !f.no_checksums, .backend = f.backend,
                                                          .engine_options = f.tuning.resolve(), .max_shard_size = max_shard_size,
                                                          .progress = progress, .cancel = &stop});
                                });
  if (!f.json.empty()) {
    write_json({{"path", f.path}, {"from", f.from}, {"tensors", f.count}, {"stats", to_json(s)}}, f.json);
    if (f.json == "-") return 0;
  }
  fmt::print("{}\n", summary_line(s));
  return 0;
}

int run_verify(const CkptFlags& f) {
  const VerifyResult r = verify_checkpoint(f.path);
  if (!f.json.empty()) {
    nlohmann::json j = {{"path", f.path},
                        {"verified", !r.first_bad && r.has_checksums},
                        {"checksums", r.has_checksums},
                        {"tensors_checked", r.tensors_checked},
                        {"headers_checked", r.headers_checked}};
    if (r.first_bad) j["first_bad"] = *r.first_bad;
    write_json(j, f.json);
    if (f.json == "-") return !r.first_bad && r.has_checksums ? 0 : 1;
  }
  if (r.first_bad) {  // also where the damage hides the checksums themselves
    fmt::print(stderr, "hbmio: verify FAILED: {}\n", *r.first_bad);
    return 1;
  }
  if (!r.has_checksums) {
    fmt::print(stderr, "hbmio: {} holds no hbmio checksums: nothing to verify (add them with `hbmio ckpt checksum`)\n", shown_path(f.path));
    return 1;
  }
  fmt::print("{}: {} tensors verified (XXH3-64){}\n", shown_path(f.path), r.tensors_checked,
             r.headers_checked ? fmt::format(", and the header of {} file(s)", r.headers_checked) : "");
  return 0;
}

}  // namespace

void add_ckpt_command(CLI::App& app, int& exit_status) {
  auto flags = std::make_shared<CkptFlags>();
  auto* ckpt = app.add_subcommand("ckpt", "safetensors checkpoints: info, load, verify, checksum, generate");
  ckpt->footer("Examples:\n"
               "  hbmio ckpt info ~/models/llama/                      tensors, dtypes, sizes, checksums\n"
               "  hbmio ckpt load ~/models/llama/ --into cuda:0 --verify\n"
               "  hbmio ckpt generate /tmp/w.safetensors --count 48 --tensor-size 128MiB --from cuda:0\n"
               "  hbmio ckpt checksum ~/models/llama/ && hbmio ckpt verify ~/models/llama/");
  ckpt->require_subcommand(1);
  const std::string local_help = "A .safetensors file, a *.safetensors.index.json, or a directory holding either";
  const std::string path_help = local_help + "; or an s3://BUCKET/KEY or http(s):// URL of either (a prefix ending in '/' "
                                             "for a sharded checkpoint; see docs/remote.md)";

  auto* info = ckpt->add_subcommand("info", "List the tensors (name, dtype, shape, bytes) and whether checksums are stored");
  info->add_option("path", flags->path, path_help)->required();
  add_json_option(info, flags->json, "Write the listing");
  info->callback([flags, &exit_status] { exit_status = run_info(*flags); });

  auto* load = ckpt->add_subcommand("load", "Load every tensor (or --names) into memory and report the throughput");
  load->add_option("path", flags->path, path_help)->required();
  load->add_option("--into", flags->into,
                   "host (or cpu), pinned, cuda or cuda:N; several, comma-separated (cuda:0,1), load with one pipeline each (see --placement)")
      ->capture_default_str();
  load->add_option("--placement", flags->placement,
                   "With several --into locations: shard (each tensor to one location, balanced by bytes) or replicate "
                   "(every location gets everything; each byte is read from storage once, the rest is copied between "
                   "locations)")
      ->check(one_of({"shard", "replicate"}))
      ->capture_default_str();
  load->add_option("--backend,-b", flags->backend, kBackendHelp);
  load->add_option("--names", flags->names, "Comma-separated tensor names to load (default: all)");
  load->add_option("--layout", flags->layout, "single: one allocation, tensors 256-byte aligned; per-tensor: one each")
      ->check(one_of({"single", "per-tensor"}))
      ->check(CLI::IsMember({"single", "per-tensor"}))
      ->capture_default_str();
  load->add_flag("--verify{checksums}", flags->verify,
                 "Check what was loaded. --verify (=checksums): every tensor against its file's stored XXH3-64 "
                 "checksum; files without checksums (written by other tools) load unchecked, and the output names "
                 "them. --verify=strict: such files are an error. --verify=bytes: every tensor against a plain read of "
                 "the file (any file; reads the checkpoint twice)")
      ->type_name("[=checksums|strict|bytes]")
      ->check(one_of({"checksums", "strict", "bytes"}));
  load->add_option("--cache", flags->cache,
                   "The node's resident cache (hbmio cache serve, docs/cache.md): use (take the files it holds), add "
                   "(also ask it to take in the others) or off; default: use where $HBMIO_CACHE names its socket")
      ->check(one_of({"use", "add", "off"}));
  load->add_flag("--share", flags->share,
                 "Into a GPU: take the files the resident cache holds in that GPU's memory (hbmio cache add --gpu) as "
                 "its own copy mapped in place (CUDA IPC), copying nothing; the others load as usual (docs/cache.md)");
  load->add_flag("-v,--verbose", flags->verbose, "Print the load's whole note (the engine's choices, first-use set-up)");
  load->add_option("--runs", flags->runs, "Load N times with one engine and report the median (a benchmark)")
      ->check(CLI::Range(1u, 1000u))
      ->capture_default_str();
  load->add_flag("--reuse-memory", flags->reuse_memory,
                 "Allocate the destination once, before timing, and load every run into it (as a framework's caching "
                 "allocator would); without it each run allocates and frees its memory inside the timing");
  load->add_flag("--drop-cache", flags->drop_cache,
                 "Empty the page cache of the checkpoint's files before every run, so each load comes from storage "
                 "(drop_caches as root, else posix_fadvise(DONTNEED))");
  add_json_option(load, flags->json, "Write the result");
  flags->tuning.add_to(load);
  load->footer("Examples:\n"
               "  hbmio ckpt load ~/models/llama/ --into cuda:0 --verify          every tensor into GPU 0, checked\n"
               "  hbmio ckpt load model.safetensors --into cuda:0 --runs 5 --drop-cache   a cold-load benchmark\n"
               "  hbmio ckpt load ~/models/llama/ --into cuda:0,1 --placement shard     half the tensors on each GPU");
  load->callback([flags, &exit_status] { exit_status = run_load(*flags); });

  auto* save = ckpt->add_subcommand(
      "generate", "Save generated random tensors as a checkpoint (for tests and benchmarks), crash-safe; an existing "
                  "checkpoint at PATH is replaced only with --force");
  save->add_option("path", flags->path,
                   "The .safetensors file to write (a directory with --max-shard-size), or an s3://BUCKET/KEY URL (a\n"
                   "prefix with --max-shard-size): a multipart upload that publishes the whole object or nothing")
      ->required();
  save->add_option("--max-shard-size", flags->max_shard_size,
                   "Write a sharded checkpoint into the directory PATH: shards of at most this many tensor bytes "
                   "(e.g. 2GiB; headers not counted, as in Hugging Face's max_shard_size; a larger tensor gets a shard "
                   "of its own) + index")
      ->check(size_value());
  save->add_option("--count", flags->count, "Number of tensors")->capture_default_str();
  save->add_option("--tensor-size", flags->tensor_size, "Bytes per tensor (e.g. 128MiB)")->capture_default_str()->check(size_value());
  save->add_option("--dtype", flags->dtype, "Element type (BF16, F32, U8, ...)")->capture_default_str();
  save->add_option("--from", flags->from, "Memory the tensors live in: host (or cpu), pinned, cuda or cuda:N")->capture_default_str();
  save->add_option("--seed", flags->seed, "Seed of the generated data")->capture_default_str();
  save->add_option("--backend,-b", flags->backend, kBackendHelp);
  save->add_flag("--no-checksums", flags->no_checksums, "Do not store XXH3-64 checksums");
  save->add_flag("--force", flags->force, "Replace the checkpoint at PATH (a file, or a directory holding one) with the generated one");
  add_json_option(save, flags->json, "Write the result");
  flags->tuning.add_to(save);
  save->footer("Example: hbmio ckpt generate /tmp/w --count 96 --tensor-size 128MiB --from cuda:0 --max-shard-size 5GiB\n"
               "Ctrl-C stops the save before it publishes, removing what it wrote: PATH keeps what it held (a\n"
               "save that had already published finishes, and the message says PATH holds the new checkpoint).");
  save->callback([flags, &exit_status] {
    exit_status = run_stoppable([flags](const std::atomic<bool>& stop) { return run_save(*flags, stop); },
                                [flags](bool stopped) {
                                  return stopped ? fmt::format("{} holds what it held before; nothing of this save is left", shown_path(flags->path))
                                                 : fmt::format("the save had published already: {} holds the new checkpoint", shown_path(flags->path));
                                });
  });

  auto* verify = ckpt->add_subcommand("verify", "Recompute the stored checksums; name the first bad tensor and its offset");
  verify->add_option("path", flags->path, path_help)->required();
  add_json_option(verify, flags->json, "Write the outcome {path, verified, checksums, tensors_checked, headers_checked, first_bad}");
  verify->footer("Exit status 0 when every stored checksum matches, 1 when one does not or there are none.\n"
                 "Example: hbmio ckpt verify ~/models/llama/ --json -");
  verify->callback([flags, &exit_status] { exit_status = run_verify(*flags); });

  auto* checksum = ckpt->add_subcommand(
      "checksum",
      "Add checksums to an existing checkpoint: a crash-safe rewrite of each file that lacks them, keeping its mode "
      "and owner (a symbolic link, as in the Hugging Face cache, is followed: the file it names is rewritten). "
      "Files whose checksums already match are left alone; files whose checksums do not match are refused");
  checksum->add_option("path", flags->path, local_help)->required();
  checksum->add_flag("--force", flags->force,
                     "Recompute the checksums of files whose stored ones do not match (the data is taken as it is now)");
  add_json_option(checksum, flags->json, "Write the outcome {path, files_rewritten, files_already_valid}");
  checksum->callback([flags, &exit_status] {
    const auto work = [flags](const std::atomic<bool>& stop) {
      const AddChecksumsResult r = add_checksums(flags->path, flags->force, &stop);
      if (!flags->json.empty())
        write_json({{"command", "ckpt checksum"}, {"path", flags->path}, {"files_rewritten", r.files_rewritten},
                    {"files_already_valid", r.files_already_valid}},
                   flags->json);
      if (flags->json == "-") return 0;
      if (r.files_rewritten == 0)
        fmt::print("{}: checksums already present and matching ({} file(s)); nothing rewritten\n", shown_path(flags->path), r.files_already_valid);
      else
        fmt::print("{}: checksums added to {} file(s){}\n", shown_path(flags->path), r.files_rewritten,
                   r.files_already_valid ? fmt::format(", {} already had matching ones", r.files_already_valid) : "");
      return 0;
    };
    exit_status = run_stoppable(work, [](bool stopped) {
      return stopped ? std::string("files already rewritten keep their checksums, the others are unchanged")
                     : std::string("every file had been rewritten (or the command failed, as said above)");
    });
  });
}

}  // namespace hbmio::cli
