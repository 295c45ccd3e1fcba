// `hbmio bench`: the table, the JSON record and the SVG chart of a finished run. Nothing here
// measures; everything reads the Report.
#include "bench_report.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace hbmio::cli {
namespace {

constexpr int kSchemaVersion = 1;

// The groups the table and the chart show, in order: read cold, read warm, write.
struct Group {
  std::string op, mode, title;
};
std::vector<Group> groups_of(const Report& report) {
  std::vector<Group> groups;
  auto add = [&](const std::string& op, const std::string& mode, const std::string& title) {
    for (const Row& r : report.rows)
      if (!r.ceiling && r.op == op && r.mode == mode) return groups.push_back({op, mode, title});
  };
  add("read", "cold", "read, cold: page cache emptied before each run");
  add("read", "warm", "read, warm: file in the page cache (one untimed read first)");
  add("write", "durable", "write, durable: memory -> new file, fsync counted");
  return groups;
}
// A group's rows: its ceilings first (the host-to-device copy bounds every read), then backends.
std::vector<const Row*> rows_of(const Report& report, const Group& group) {
  std::vector<const Row*> rows;
  for (const Row& r : report.rows)
    if (r.ceiling && ((r.op == group.op && r.mode == group.mode) || (r.op == "copy" && group.op == "read")))
      rows.push_back(&r);
  for (const Row& r : report.rows)
    if (!r.ceiling && r.op == group.op && r.mode == group.mode) rows.push_back(&r);
  return rows;
}

std::string gpu_line(const Report& r) {
  if (r.machine.gpu) return fmt::format("{} ({} device(s))", r.machine.gpu_name, cuda_device_count());
  return "none: " + r.machine.gpu_reason;
}

std::string shorten(const std::string& text, std::size_t width) {
  return text.size() <= width ? text : text.substr(0, width - 3) + "...";
}

}  // namespace

void print_table(const Report& r) {
  const Machine& m = r.machine;
  fmt::print("hbmio bench {}  {}\n", version(), r.date);
  if (!m.gpu) fmt::print("no GPU: measuring storage into host memory ({})\n", r.into);
  fmt::print("machine  {}, {} cores, {} memory, {}\n", m.cpu_model, m.cpus, format_size(m.memory_bytes), m.kernel);
  fmt::print("GPU      {}\n", gpu_line(r));
  fmt::print("file     {}, {}{}, {} on {}{}\n", r.file_path, format_size(r.size),
             r.generated ? " of random data (generated, removed afterwards)" : "", m.file_system, m.device,
             m.device_model.empty() ? "" : " (" + m.device_model + ")");
  fmt::print("into     {}; {} timed runs per row; chunk {}, bounce buffers {} x {}, queue depth {}, {} workers, direct_io {}\n",
             r.into, r.runs, format_size(r.options.chunk_size), r.options.bounce_buffers,
             format_size(r.options.bounce_buffer_size), r.options.queue_depth, r.options.resolved_workers(),
             to_string(r.options.direct_io));
  fmt::print("CPU % is of all {} cores; GiB/s is from the median latency; 'of bound' is the share of the slowest ceiling\n"
             "the data passes (above 100%: the path beat the ceiling's own run, e.g. through readahead or a virtual disk's cache).\n",
             m.cpus);

  for (const Group& g : groups_of(r)) {
    std::string cache_drop;
    for (const Row* row : rows_of(r, g))
      if (!row->cache_drop.empty()) cache_drop = row->cache_drop;
    fmt::print("\n{}{}\n", g.title, cache_drop.empty() ? "" : " (" + cache_drop + ")");
    fmt::print("  {:<36} {:>9} {:>9} {:>7} {:>6} {:>9} {:>8} {:>8}  {}\n", "path", "median s", "p99 s", "GiB/s", "CPU %",
               "CPU s/GiB", "O_DIRECT", "of bound", "notes");
    for (const Row* row : rows_of(r, g)) {
      if (row->status == "unavailable") {
        fmt::print("  {:<36} unavailable: {}\n", row->label(), row->reason);
        continue;
      }
      const std::string bound = row->bound_by.empty() ? "-" : fmt::format("{:.0f}%", 100 * row->fraction_of_bound);
      std::string notes = row->status == "failed" ? "FAILED: " + row->reason : shorten(row->note, 90);
      fmt::print("  {:<36} {:>9.4f} {:>9.4f} {:>7.2f} {:>6.1f} {:>9.3f} {:>7.0f}% {:>8}  {}\n", row->label(),
                 row->median_seconds, row->p99_seconds, row->gib_per_second, row->cpu_percent, row->cpu_seconds_per_gib,
                 100 * row->direct_fraction, bound, notes);
    }
  }
}

namespace {

nlohmann::json to_json(const Row& row) {
  nlohmann::json runs = nlohmann::json::array();
  for (const Run& run : row.runs)
    runs.push_back({{"seconds", run.seconds}, {"cpu_seconds", run.cpu_seconds}, {"bytes", run.bytes},
                    {"bytes_direct", run.bytes_direct}, {"backend", run.backend}, {"note", run.note}});
  nlohmann::json j = {{"name", row.name},
                      {"op", row.op},
                      {"mode", row.mode},
                      {"available", row.status != "unavailable"},
                      {"status", row.status},
                      {"reason", row.reason},
                      {"backend_used", row.backend_used},
                      {"note", row.note},
                      {"runs", runs},
                      {"median_seconds", row.median_seconds},
                      {"p99_seconds", row.p99_seconds},
                      {"gib_per_second", row.gib_per_second},
                      {"cpu_percent_of_all_cores", row.cpu_percent},
                      {"cpu_seconds_per_gib", row.cpu_seconds_per_gib},
                      {"direct_io_fraction", row.direct_fraction}};
  if (!row.cache_drop.empty()) j["cache_drop"] = row.cache_drop;
  if (row.verified) j["verified"] = *row.verified;
  if (!row.ceiling)
    j["bound"] = row.bound_by.empty() ? nlohmann::json(nullptr)
                                      : nlohmann::json{{"ceiling", row.bound_by},
                                                       {"gib_per_second", row.bound_gib_per_second},
                                                       {"fraction", row.fraction_of_bound}};
  return j;
}

}  // namespace

nlohmann::json to_json(const Report& r) {
  const Machine& m = r.machine;
  nlohmann::json results = nlohmann::json::array(), ceilings = nlohmann::json::array();
  for (const Row& row : r.rows) (row.ceiling ? ceilings : results).push_back(to_json(row));
  return {{"schema_version", kSchemaVersion},
          {"hbmio_version", version()},
          {"date", r.date},
          {"command_line", r.command},
          {"machine",
           {{"cpu_model", m.cpu_model},
            {"cpus", m.cpus},
            {"memory_bytes", m.memory_bytes},
            {"kernel", m.kernel},
            {"gpu", {{"present", m.gpu}, {"name", m.gpu_name}, {"reason", m.gpu_reason}}}}},
          {"file",
           {{"path", r.file_path},
            {"bytes", r.size},
            {"generated", r.generated},
            {"file_system", m.file_system},
            {"device", m.device},
            {"device_model", m.device_model}}},
          {"settings",
           {{"into", r.into},
            {"runs", r.runs},
            {"options",
             {{"chunk_size", r.options.chunk_size},
              {"bounce_buffer_size", r.options.bounce_buffer_size},
              {"bounce_buffers", r.options.bounce_buffers},
              {"queue_depth", r.options.queue_depth},
              {"workers", r.options.resolved_workers()},
              {"direct_io", to_string(r.options.direct_io)}}}}},
          {"ceilings", ceilings},
          {"results", results}};
}

namespace {

// Text for XML: markup characters escaped, control characters (invalid in XML 1.0) dropped.
std::string xml_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        if (static_cast<unsigned char>(c) >= 0x20) out += c;
    }
  }
  return out;
}

}  // namespace

std::string render_svg(const Report& r) {
  constexpr int kWidth = 1000, kLabelX = 12, kBarX = 270, kBarWidth = 380, kCpuX = 760, kCpuWidth = 160, kLine = 22;
  // One colour per backend, the same in every group; ceilings grey.
  auto color_of = [](const Row& row) {
    if (row.ceiling) return "#9e9e9e";
    if (row.name == "posix") return "#4e79a7";
    if (row.name == "uring") return "#f28e2b";
    if (row.name == "cufile") return "#59a14f";
    return "#b07aa1";
  };
  std::string body;
  int y = 54;
  auto text = [&](int x, int ty, const std::string& s, const char* extra = "") {
    body += fmt::format("<text x=\"{}\" y=\"{}\"{}>{}</text>\n", x, ty, extra, xml_escape(s));
  };
  for (const Group& g : groups_of(r)) {
    const auto rows = rows_of(r, g);
    double max_rate = 0;
    for (const Row* row : rows) max_rate = std::max(max_rate, row->gib_per_second);
    if (max_rate <= 0) max_rate = 1;
    y += 26;
    text(kLabelX, y, g.title, " font-weight=\"bold\"");
    text(kBarX, y + 16, "throughput, GiB/s", " fill=\"#555\"");
    text(kCpuX, y + 16, fmt::format("host CPU, % of {} cores", r.machine.cpus), " fill=\"#555\"");
    y += 22;
    const int top = y;
    double bound = 0;
    for (const Row* row : rows) {
      const int mid = y + kLine / 2;
      text(kLabelX, mid + 4, row->label());
      if (!row->ok() && row->runs.empty()) {
        text(kBarX + 4, mid + 4, shorten(row->status + ": " + row->reason, 110), " fill=\"#b00\"");
      } else {
        const char* fill = color_of(*row);
        const int w = static_cast<int>(kBarWidth * row->gib_per_second / max_rate);
        body += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n", kBarX, y + 3, std::max(w, 1),
                            kLine - 6, fill);
        text(kBarX + std::max(w, 1) + 4, mid + 4,
             fmt::format("{:.2f}{}", row->gib_per_second, row->status == "failed" ? " FAILED" : ""));
        const int cw = static_cast<int>(kCpuWidth * std::min(row->cpu_percent, 100.0) / 100.0);
        body += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n", kCpuX, y + 3, std::max(cw, 1),
                            kLine - 6, fill);
        text(kCpuX + std::max(cw, 1) + 4, mid + 4, fmt::format("{:.1f}%", row->cpu_percent));
      }
      if (!row->ceiling && row->bound_gib_per_second > 0) bound = row->bound_gib_per_second;
      y += kLine;
    }
    body += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n", kBarX, top, y);
    body += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n", kCpuX, top, y);
    if (bound > 0) {
      const int x = kBarX + static_cast<int>(kBarWidth * bound / max_rate);
      body += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#c00\" stroke-dasharray=\"4,3\"/>\n", x,
                          top - 2, y + 2);
      text(x + 3, y + 13, fmt::format("bound {:.2f} GiB/s", bound), " fill=\"#c00\"");
      y += 14;
    }
  }
  const Machine& m = r.machine;
  std::string header;
  header += fmt::format("<text x=\"{}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n", kLabelX,
                        xml_escape(fmt::format("hbmio bench: {} {} into {}, {} runs per row ({})", format_size(r.size),
                                               m.file_system, r.into, r.runs, r.date)));
  header += fmt::format("<text x=\"{}\" y=\"42\">{}</text>\n", kLabelX,
                        xml_escape(fmt::format("{} x{}, {}; GPU: {}; device {}", m.cpu_model, m.cpus, m.kernel,
                                               m.gpu ? m.gpu_name : "none", m.device)));
  const int height = y + 20;
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{2}{3}</svg>\n",
      kWidth, height, header, body);
}

}  // namespace hbmio::cli
