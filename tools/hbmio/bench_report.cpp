// `hbmio bench`: the table, the JSON record and the SVG chart of a finished run. Nothing here
// measures; everything reads the Report.
//
// Rows carry notes (why a backend cannot run, what auto passed over, cuFile's mode) that run to
// hundreds of characters. The table and the chart give each row a cause of a few words and the
// number of a note below them that holds the full text once; the JSON keeps every text whole.
#include "bench_report.hpp"

#include <algorithm>
#include <sstream>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace hbmio::cli {
namespace {

constexpr int kSchemaVersion = 1;
constexpr std::size_t kTableWidth = 120;

// ---------------------------------------------------------------------------------------------
// Groups: what the table and the chart show, in order: read cold, read warm, write.

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
  add("read", "remote", "read from a URL: the whole object, ranged GETs on parallel connections");
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

// ---------------------------------------------------------------------------------------------
// Text

// Breaks `text` into lines of at most `width` characters at spaces; a word longer than `width`
// gets a line of its own rather than being cut.
std::vector<std::string> wrap(const std::string& text, std::size_t width) {
  std::vector<std::string> lines;
  std::string line;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!line.empty() && line.size() + 1 + word.size() > width) lines.push_back(std::exchange(line, {}));
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty() || lines.empty()) lines.push_back(line);
  return lines;
}

// ---------------------------------------------------------------------------------------------
// Notes

// A text this short is shown whole in the row ("P2PDMA", "GDS (nvidia-fs 2.17)"); a longer one
// becomes a numbered note.
constexpr std::size_t kShortText = 20;

// Phrases of the engines' notes and errors, and the few words that name each, in the order a
// reader would act on them (no GPU first: it explains most of the rest).
constexpr std::pair<std::string_view, std::string_view> kCauses[] = {
    {"built without CUDA", "no CUDA build"},
    {"no CUDA device", "no GPU"},
    {"libcufile could not be loaded", "no libcufile"},
    {"nvidia-fs is not loaded", "no nvidia-fs"},
    {"cuFileDriverOpen failed", "cuFile open failed"},
    {"no udev database", "no udev data"},  // before compat mode, which its text also mentions
    {"compatibility mode (", "compat mode"},  // the engine's mode: "compatibility mode (no nvidia-fs ..."
    {"auto: cufile (GDS", "GDS"},
    {"auto: cufile (P2PDMA", "P2PDMA"},
    {"io_uring_queue_init", "no io_uring"},
    {"O_DIRECT unavailable", "no O_DIRECT"},
    {"refused O_DIRECT", "no O_DIRECT"},
    {"O_DIRECT needs", "O_DIRECT alignment"},
    {"O_DIRECT auto:", "O_DIRECT auto"},
    {"first-use set-up", "first-use set-up"},
    {"not registered with io_uring", "unregistered buffers"},
    {"data differs", "wrong data"},
};

// The causes named in `text`; for a text none of kCauses knows, its first words.
std::vector<std::string> causes_of(const std::string& text) {
  std::vector<std::string> causes;
  for (const auto& [phrase, cause] : kCauses)
    if (text.find(phrase) != std::string::npos && std::find(causes.begin(), causes.end(), cause) == causes.end())
      causes.emplace_back(cause);
  if (causes.empty()) {
    std::string words = wrap(text, kShortText - 3).front();
    if (words.size() < text.size()) words += "...";
    causes.push_back(std::move(words));
  }
  return causes;
}

// What a row says beyond its figures, in parts: why it is not ok (one error, kept whole), else
// the engine's notes, which the engines and measure_row join with "; " (split there, outside
// parentheses, so that a note every auto row repeats is one note, not one per row).
std::vector<std::string> details_of(const Row& row) {
  if (!row.ok()) return {row.reason};
  std::vector<std::string> parts;
  int depth = 0;
  std::string part;
  for (std::size_t i = 0; i < row.note.size(); ++i) {
    const char c = row.note[i];
    depth += c == '(' ? 1 : c == ')' ? -1 : 0;
    if (depth == 0 && row.note.compare(i, 2, "; ") == 0) {
      parts.push_back(std::exchange(part, {}));
      ++i;
    } else {
      part += c;
    }
  }
  parts.push_back(part);
  std::erase_if(parts, [](const std::string& p) { return p.empty(); });
  return parts;
}

// The numbered notes of a report: every long text a row shows, once, numbered in the order the
// rows appear; rows with the same text share its number.
class Notes {
 public:
  explicit Notes(const Report& report) {
    for (const Group& g : groups_of(report))
      for (const Row* row : rows_of(report, g))
        for (const std::string& text : details_of(*row))
          if (text.size() > kShortText && number_of(text) == 0) texts_.push_back(text);
  }

  const std::vector<std::string>& texts() const { return texts_; }

  // The numbers of a row's notes ("1,4"), or "" when it has none.
  std::string numbers(const Row& row) const {
    std::vector<std::size_t> numbers;
    for (const std::string& text : details_of(row))
      if (const std::size_t n = number_of(text); n != 0) numbers.push_back(n);
    return fmt::format("{}", fmt::join(numbers, ","));
  }

  // What the row shows of its details in at most `width` characters where the causes allow:
  // `prefix` ("unavailable: ", "FAILED: ", ""), then short texts whole and the causes of long
  // ones (as many as fit, the first always), then the numbers of its notes:
  // "no GPU, no libcufile [1]".
  std::string cell(const Row& row, const std::string& prefix, std::size_t width) const {
    std::vector<std::string> causes;
    for (const std::string& text : details_of(row)) {
      if (text == "auto picked " + row.backend_used) continue;  // the label says so: "auto (uring)"
      for (std::string& cause : number_of(text) == 0 ? std::vector<std::string>{text} : causes_of(text))
        if (std::find(causes.begin(), causes.end(), cause) == causes.end()) causes.push_back(std::move(cause));
    }
    if (causes.empty()) return {};
    const std::string list = numbers(row), mark = list.empty() ? "" : " [" + list + "]";
    std::string out = prefix + causes.front();
    for (std::size_t i = 1; i < causes.size() && out.size() + 2 + causes[i].size() + mark.size() <= width; ++i)
      out += ", " + causes[i];
    return out + mark;
  }

 private:
  // The note's number, 1 up; 0 when `text` has none (short enough to show whole).
  std::size_t number_of(const std::string& text) const {
    const auto it = std::find(texts_.begin(), texts_.end(), text);
    return it == texts_.end() ? 0 : static_cast<std::size_t>(it - texts_.begin()) + 1;
  }

  std::vector<std::string> texts_;
};

// ---------------------------------------------------------------------------------------------
// Table

std::string gpu_line(const Report& r) {
  if (r.machine.gpu) return fmt::format("{} ({} device(s))", r.machine.gpu_name, cuda_device_count());
  return "none: " + r.machine.gpu_reason;
}

// Columns of a table row: path, then the figures, then the notes in what is left of kTableWidth.
constexpr std::string_view kColumns = "  {:<33} {:>8} {:>8} {:>6} {:>5} {:>9} {:>8} {:>8}  {}";
constexpr std::size_t kPathWidth = 2 + 33 + 1;
constexpr std::size_t kFiguresWidth = kPathWidth + 8 + 1 + 8 + 1 + 6 + 1 + 5 + 1 + 9 + 1 + 8 + 1 + 8 + 2;
constexpr std::size_t kNotesWidth = kTableWidth - kFiguresWidth;

std::string without_trailing_spaces(std::string line) {
  line.erase(line.find_last_not_of(' ') + 1);
  return line;
}

}  // namespace

std::string render_table(const Report& r) {
  const Machine& m = r.machine;
  const Notes notes(r);
  std::string out;
  // "machine  <text>", the text wrapped and its further lines indented under it.
  auto field = [&](const char* name, const std::string& text) {
    const auto lines = wrap(text, kTableWidth - 9);
    for (std::size_t i = 0; i < lines.size(); ++i) out += fmt::format("{:<9}{}\n", i == 0 ? name : "", lines[i]);
  };
  auto paragraph = [&](const std::string& text) {
    for (const std::string& line : wrap(text, kTableWidth)) out += line + "\n";
  };

  out += fmt::format("hbmio bench {}  {}\n", version(), r.date);
  const bool url = is_remote_url(r.file_path);
  if (!m.gpu) out += fmt::format("no GPU: measuring {} into host memory ({})\n", url ? "the URL" : "storage", r.into);
  field("machine", fmt::format("{}, {} cores, {} memory, {}", m.cpu_model, m.cpus, format_size(m.memory_bytes), m.kernel));
  field("GPU", gpu_line(r));
  if (url) {
    const RemoteOptions remote = RemoteOptions::from_env();
    field("object", fmt::format("{}, {}", r.file_path, format_size(r.size)));
    field("into", fmt::format("{}; {} timed runs per row", r.into, r.runs));
    field("remote", fmt::format("{} connections, parts of {} (HBMIO_REMOTE_CONNECTIONS, HBMIO_REMOTE_PART_SIZE)", remote.connections,
                                format_size(remote.part_size_for(r.size))));
  } else {
    field("file", fmt::format("{}, {}{}, {} on {}{}", r.file_path, format_size(r.size),
                              r.generated ? " of random data (generated, removed afterwards)" : "", m.file_system, m.device,
                              m.device_model.empty() ? "" : " (" + m.device_model + ")"));
    field("into", fmt::format("{}; {} timed runs per row", r.into, r.runs));
    field("tuning", fmt::format("chunk {}, bounce buffers {} x {}, queue depth {}, {} workers, direct_io {}",
                                format_size(r.options.chunk_size), r.options.bounce_buffers, format_size(r.options.bounce_buffer_size),
                                r.options.queue_depth, r.options.resolved_workers(), to_string(r.options.direct_io)));
  }
  paragraph(fmt::format("CPU % is of all {} cores; GiB/s is from the median latency; 'of bound' is the share of the slowest "
                        "ceiling the data passes (above 100%: the path beat the ceiling's own run, e.g. through readahead or "
                        "a virtual disk's cache).",
                        m.cpus));

  for (const Group& g : groups_of(r)) {
    std::string cache_drop;
    for (const Row* row : rows_of(r, g))
      if (!row->cache_drop.empty()) cache_drop = row->cache_drop;
    out += fmt::format("\n{}{}\n", g.title, cache_drop.empty() ? "" : " (" + cache_drop + ")");
    out += fmt::format(kColumns, "path", "median s", "p99 s", "GiB/s", "CPU %", "CPU s/GiB", "O_DIRECT", "of bound", "notes") + "\n";
    for (const Row* row : rows_of(r, g)) {
      if (row->status == "unavailable") {
        out += fmt::format("  {:<33} {}\n", row->label(), notes.cell(*row, "unavailable: ", kTableWidth - kPathWidth));
        continue;
      }
      const std::string bound = row->bound_by.empty() ? "-" : fmt::format("{:.0f}%", 100 * row->fraction_of_bound);
      out += without_trailing_spaces(fmt::format(
                 kColumns, row->label(), fmt::format("{:.4f}", row->median_seconds), fmt::format("{:.4f}", row->p99_seconds),
                 fmt::format("{:.2f}", row->gib_per_second), fmt::format("{:.1f}", row->cpu_percent),
                 fmt::format("{:.3f}", row->cpu_seconds_per_gib), fmt::format("{:.0f}%", 100 * row->direct_fraction), bound,
                 notes.cell(*row, row->status == "failed" ? "FAILED: " : "", kNotesWidth))) +
             "\n";
    }
  }

  if (!notes.texts().empty()) out += "\nnotes\n";
  for (std::size_t i = 0; i < notes.texts().size(); ++i) {
    const std::string mark = fmt::format("  [{}] ", i + 1);
    const auto lines = wrap(notes.texts()[i], kTableWidth - mark.size());
    for (std::size_t l = 0; l < lines.size(); ++l) out += (l == 0 ? mark : std::string(mark.size(), ' ')) + lines[l] + "\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// JSON

namespace {

nlohmann::json row_json(const Row& row) {
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
  for (const Row& row : r.rows) (row.ceiling ? ceilings : results).push_back(row_json(row));
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

// ---------------------------------------------------------------------------------------------
// SVG

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

// One colour per backend, the same in every group; ceilings grey.
const char* color_of(const Row& row) {
  if (row.ceiling) return "#9e9e9e";
  if (row.name == "posix") return "#4e79a7";
  if (row.name == "uring") return "#f28e2b";
  if (row.name == "cufile") return "#59a14f";
  return "#b07aa1";
}

}  // namespace

std::string render_svg(const Report& r) {
  constexpr int kWidth = 1000, kLabelX = 12, kBarX = 270, kBarWidth = 380, kCpuX = 760, kCpuWidth = 160, kLine = 22;
  // Characters of 12-pixel sans-serif text (about 6.5 pixels each) across the chart, and across
  // the space right of the labels; the 15-pixel title fits fewer.
  constexpr std::size_t kChars = 140, kBarChars = 105, kTitleChars = 110;
  const Notes notes(r);
  const Machine& m = r.machine;
  std::string body;
  auto text = [&](int x, int y, const std::string& s, const char* extra = "") {
    body += fmt::format("<text x=\"{}\" y=\"{}\"{}>{}</text>\n", x, y, extra, xml_escape(s));
  };

  int y = 22;
  for (const std::string& line : wrap(fmt::format("hbmio bench: {} {} into {}, {} runs per row ({})", format_size(r.size),
                                                  m.file_system, r.into, r.runs, r.date),
                                      kTitleChars)) {
    text(kLabelX, y, line, " font-size=\"15\" font-weight=\"bold\"");
    y += 20;
  }
  for (const std::string& line : wrap(fmt::format("{} x{}, {}; GPU: {}; device {}", m.cpu_model, m.cpus, m.kernel,
                                                  m.gpu ? m.gpu_name : "none", m.device),
                                      kChars)) {
    text(kLabelX, y, line);
    y += 16;
  }
  y -= 4;

  for (const Group& g : groups_of(r)) {
    const auto rows = rows_of(r, g);
    double max_rate = 0;
    for (const Row* row : rows) max_rate = std::max(max_rate, row->gib_per_second);
    if (max_rate <= 0) max_rate = 1;
    y += 26;
    text(kLabelX, y, g.title, " font-weight=\"bold\"");
    text(kBarX, y + 16, "throughput, GiB/s", " fill=\"#555\"");
    text(kCpuX, y + 16, fmt::format("host CPU, % of {} cores", m.cpus), " fill=\"#555\"");
    y += 22;
    const int top = y;
    double bound = 0;
    for (const Row* row : rows) {
      const int mid = y + kLine / 2;
      if (!row->ok() && row->runs.empty()) {
        text(kLabelX, mid + 4, row->label());
        text(kBarX + 4, mid + 4, notes.cell(*row, row->status + ": ", kBarChars), " fill=\"#b00\"");
      } else {
        // The bars leave no room for causes: the label points to the notes below.
        const std::string numbers = notes.numbers(*row);
        text(kLabelX, mid + 4, numbers.empty() ? row->label() : fmt::format("{} [{}]", row->label(), numbers));
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

  if (!notes.texts().empty()) {
    y += 26;
    text(kLabelX, y, "notes", " font-weight=\"bold\"");
    y += 4;
  }
  for (std::size_t i = 0; i < notes.texts().size(); ++i) {
    y += 16;
    text(kLabelX, y, fmt::format("[{}]", i + 1));
    for (const std::string& line : wrap(notes.texts()[i], kChars - 6)) {
      text(kLabelX + 30, y, line);
      y += 15;
    }
    y -= 15;
  }

  const int height = y + 20;
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{2}</svg>\n",
      kWidth, height, body);
}

}  // namespace hbmio::cli
