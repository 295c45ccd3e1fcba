// The one configuration (include/hbmio/config.hpp): the table of src/core/config.cpp is the one
// docs/configuration.md shows, no other file of the library reads an HBMIO_* variable, every
// HBMIO_* name the library or the docs mention is known, and an invalid value's error names the
// variable, its value and what it accepts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "hbmio/checkpoint.hpp"
#include "hbmio/config.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/options.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;
using namespace hbmio;

namespace {

// The sources are compiled by absolute path, so the repository is two folders above this file.
const fs::path kRepo = fs::path(__FILE__).parent_path().parent_path();

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The cells of a Markdown table row ("| a | `b \| c` |" -> {"a", "b | c"}), backticks dropped.
std::vector<std::string> cells(const std::string& row) {
  std::vector<std::string> out;
  std::string cell;
  for (std::size_t i = 1; i < row.size(); ++i) {
    if (row[i] == '\\' && i + 1 < row.size() && row[i + 1] == '|') {
      cell += '|';
      ++i;
    } else if (row[i] == '|') {
      const auto first = cell.find_first_not_of(' '), last = cell.find_last_not_of(' ');
      std::string trimmed = first == std::string::npos ? "" : cell.substr(first, last - first + 1);
      std::erase(trimmed, '`');
      out.push_back(trimmed);
      cell.clear();
    } else {
      cell += row[i];
    }
  }
  return out;
}

// The rows of the first table after `heading` in docs/configuration.md.
std::vector<std::vector<std::string>> table_after(const std::string& heading) {
  std::ifstream in(kRepo / "docs" / "configuration.md");
  std::vector<std::vector<std::string>> rows;
  std::string line;
  bool in_section = false, in_table = false;
  while (std::getline(in, line)) {
    if (!in_section) {
      in_section = line == heading;
      continue;
    }
    if (line.starts_with("|")) {
      in_table = true;
      if (!line.starts_with("|---") && !line.starts_with("| variable")) rows.push_back(cells(line));
    } else if (in_table) {
      break;
    }
  }
  return rows;
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The files of the library and its faces, where no HBMIO_* variable may be read but in config.cpp.
std::vector<fs::path> library_sources() {
  std::vector<fs::path> files;
  for (const char* dir : {"src", "include", "tools", "python/src", "python/hbmio"})
    for (const auto& entry : fs::recursive_directory_iterator(kRepo / dir)) {
      const auto ext = entry.path().extension();
      if (entry.is_regular_file() && (ext == ".cpp" || ext == ".hpp" || ext == ".h" || ext == ".py")) files.push_back(entry.path());
    }
  return files;
}

}  // namespace

TEST(Config, DocsTableIsTheCodeTable) {
  const auto rows = table_after("## Variables");
  const auto variables = config_variables();
  ASSERT_FALSE(rows.empty()) << "no table under '## Variables' in docs/configuration.md";
  for (std::size_t i = 0; i < std::max(rows.size(), variables.size()); ++i) {
    ASSERT_LT(i, variables.size()) << "docs/configuration.md lists " << rows[i][0] << ", which src/core/config.cpp does not know";
    ASSERT_LT(i, rows.size()) << variables[i].name << " (src/core/config.cpp) is missing from docs/configuration.md";
    const auto& v = variables[i];
    ASSERT_EQ(rows[i].size(), 4u) << "docs/configuration.md, row of " << v.name;
    EXPECT_EQ(rows[i][0], v.name) << "row " << i + 1 << ": docs and src/core/config.cpp list the variables in another order";
    EXPECT_EQ(rows[i][1], v.default_value) << v.name << ": default";
    EXPECT_EQ(rows[i][2], v.accepted) << v.name << ": accepted values";
    EXPECT_EQ(rows[i][3], v.meaning) << v.name << ": meaning";
  }
}

TEST(Config, OnlyConfigCppReadsTheEnvironmentForHbmio) {
  // A read of the environment (C++ getenv, Python os.environ / os.getenv) on a line that names an
  // HBMIO_* variable; the variables other programs own must be in the docs' second table.
  const std::regex read_env(R"(\bgetenv\s*\(|\benviron\b)");
  const std::regex literal(R"(getenv\s*\(\s*"([A-Za-z_][A-Za-z0-9_]*)\")");
  const std::string docs = read_text(kRepo / "docs" / "configuration.md");
  for (const fs::path& file : library_sources()) {
    if (file == kRepo / "src" / "core" / "config.cpp") continue;
    std::ifstream in(file);
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      if (!std::regex_search(line, read_env)) continue;
      const std::string where = fs::relative(file, kRepo).string() + ":" + std::to_string(number);
      EXPECT_EQ(line.find("HBMIO_"), std::string::npos) << where << " reads an HBMIO_ variable; read it in src/core/config.cpp: " << line;
      for (std::sregex_iterator it(line.begin(), line.end(), literal), end; it != end; ++it)
        EXPECT_NE(docs.find("`" + (*it)[1].str() + "`"), std::string::npos)
            << where << " reads " << (*it)[1] << ", which docs/configuration.md does not list";
    }
  }
}

TEST(Config, EveryHbmioNameMentionedIsKnown) {
  // Build switches, not variables of the environment.
  const std::set<std::string> build = {"HBMIO_CUDA", "HBMIO_HAVE_CUDA", "HBMIO_VERSION", "HBMIO_BUILDING", "HBMIO_BUILD_TOOLS",
                                       "HBMIO_TSAN", "HBMIO_SANITIZE", "HBMIO_UNITY_BUILD"};
  std::set<std::string> known(build);
  for (const auto& v : config_variables()) known.emplace(v.name);
  // "HBMIO_REMOTE_*" (a family, written with its wildcard) is not matched: the name must not end in '_'.
  const std::regex name(R"(HBMIO_[A-Z][A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]))");
  for (const fs::path& file : library_sources()) {
    const std::string text = read_text(file);
    for (std::sregex_iterator it(text.begin(), text.end(), name), end; it != end; ++it)
      EXPECT_TRUE(known.contains(it->str())) << fs::relative(file, kRepo).string() << " names " << it->str()
                                             << ", which is in no table of src/core/config.cpp";
  }
  // The docs may also name the variables of the tests and scripts (their own table).
  for (const auto& row : table_after("## Variables of the tests and scripts")) {
    const std::string& names = row.at(0);
    for (std::sregex_iterator it(names.begin(), names.end(), name), end; it != end; ++it) known.insert(it->str());
  }
  std::vector<fs::path> docs = {kRepo / "README.md"};
  for (const auto& entry : fs::directory_iterator(kRepo / "docs"))
    if (entry.path().extension() == ".md") docs.push_back(entry.path());
  for (const fs::path& file : docs) {
    const std::string text = read_text(file);
    for (std::sregex_iterator it(text.begin(), text.end(), name), end; it != end; ++it)
      EXPECT_TRUE(known.contains(it->str())) << fs::relative(file, kRepo).string() << " names " << it->str()
                                             << ", which docs/configuration.md does not list";
  }
}

TEST(Config, DefaultsWhereUnset) {
  for (const auto& v : config_variables())
    if (std::getenv(std::string(v.name).c_str()) != nullptr) GTEST_SKIP() << v.name << " is set in this environment";
  EXPECT_EQ(configured_backend(), "auto");
  EXPECT_EQ(configured_readahead(), std::uint64_t{1} << 30);
  EXPECT_EQ(configured_library("HBMIO_CURL_LIBRARY"), "");
  const Options o = Options::from_env();
  EXPECT_EQ(o.chunk_size, Options{}.chunk_size);
  const RemoteOptions r = RemoteOptions::from_env();
  EXPECT_EQ(r.connections, RemoteOptions{}.connections);
  EXPECT_EQ(r.part_size, 0u);
  EXPECT_THROW(configured_library("HBMIO_CHUNK_SIZE"), std::logic_error);
}

TEST(Config, ValuesApply) {
  {
    const ScopedEnv backend("HBMIO_BACKEND", "posix"), readahead("HBMIO_READAHEAD", "0"), library("HBMIO_NCCL_LIBRARY", "/x/libnccl.so.2");
    EXPECT_EQ(configured_backend(), "posix");
    EXPECT_EQ(configured_readahead(), 0u);
    EXPECT_EQ(configured_library("HBMIO_NCCL_LIBRARY"), "/x/libnccl.so.2");
  }
  {
    const ScopedEnv empty("HBMIO_BACKEND", "");  // an empty variable counts as unset
    EXPECT_EQ(configured_backend(), "auto");
  }
  const ScopedEnv connections("HBMIO_REMOTE_CONNECTIONS", "4"), part("HBMIO_REMOTE_PART_SIZE", "64KiB"),
      attempts("HBMIO_REMOTE_ATTEMPTS", "2"), rate("HBMIO_REMOTE_MIN_RATE", "1MiB"), stall("HBMIO_REMOTE_STALL_TIMEOUT", "1.5");
  const RemoteOptions r = RemoteOptions::from_env();
  EXPECT_EQ(r.connections, 4u);
  EXPECT_EQ(r.part_size, 64u << 10);
  EXPECT_EQ(r.max_attempts, 2u);
  EXPECT_EQ(r.min_rate_bytes_per_second, 1 << 20);
  EXPECT_EQ(r.stall_timeout_seconds, 1.5);
}

// Each invalid value: an Error(EINVAL) whose message names the variable, the value and the
// accepted values, as the table states them.
TEST(Config, InvalidValuesNameVariableValueAndRange) {
  struct Case {
    const char* name;
    const char* value;
    std::function<void()> use;
  };
  const auto options = [] { (void)Options::from_env(); };
  const auto remote = [] { (void)RemoteOptions::from_env(); };
  const std::vector<Case> cases = {
      {"HBMIO_BACKEND", "warp", [] { (void)configured_backend(); }},
      {"HBMIO_CHUNK_SIZE", "lots", options},
      {"HBMIO_CHUNK_SIZE", "0", options},
      {"HBMIO_BOUNCE_BUFFER_SIZE", "2GiB", options},
      {"HBMIO_BOUNCE_BUFFERS", "0", options},
      {"HBMIO_QUEUE_DEPTH", "5000", options},
      {"HBMIO_WORKERS", "-1", options},
      {"HBMIO_DIRECT_IO", "maybe", options},
      {"HBMIO_REMOTE_CONNECTIONS", "0", remote},
      {"HBMIO_REMOTE_PART_SIZE", "1K", remote},
      {"HBMIO_REMOTE_ATTEMPTS", "0", remote},
      {"HBMIO_REMOTE_MIN_RATE", "100", remote},
      {"HBMIO_REMOTE_STALL_TIMEOUT", "soon", remote},
      {"HBMIO_REMOTE_STALL_TIMEOUT", "0.5", remote},
      {"HBMIO_READAHEAD", "2TiB", [] { (void)configured_readahead(); }},
  };
  for (const Case& c : cases) {
    const ScopedEnv set(c.name, c.value);
    std::string accepted;
    for (const auto& v : config_variables())
      if (v.name == c.name) accepted = v.accepted;
    try {
      c.use();
      ADD_FAILURE() << c.name << "=" << c.value << " was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), std::errc::invalid_argument) << what;
      EXPECT_NE(what.find(c.name), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("'") + c.value + "'"), std::string::npos) << what;
      EXPECT_NE(what.find(accepted), std::string::npos) << what;
    }
  }
  // Valid alone, invalid together: the error names both variables and their values.
  const ScopedEnv chunk("HBMIO_CHUNK_SIZE", "12MiB"), bounce("HBMIO_BOUNCE_BUFFER_SIZE", "8MiB");
  try {
    (void)Options::from_env();
    ADD_FAILURE() << "a chunk of 12 MiB over 8 MiB bounce buffers was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("HBMIO_CHUNK_SIZE"), std::string::npos) << what;
    EXPECT_NE(what.find("HBMIO_BOUNCE_BUFFER_SIZE"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(12u << 20)), std::string::npos) << what;
  }
}

// An empty backend name is the configured one wherever a backend is chosen: make_engine, the
// engine pool (which keeps the engine under the name it resolved to), and a load or save whose
// options name none.
TEST(Config, AnEmptyBackendIsHbmioBackend) {
  const ScopedEnv backend("HBMIO_BACKEND", "posix");
  EXPECT_EQ(make_engine("")->name(), "posix");
  EnginePool pool;
  {
    const EnginePool::Lease lease = pool.acquire("");
    EXPECT_EQ(lease->name(), "posix");
  }
  EXPECT_EQ(pool.idle_counts(), (std::map<std::string, std::size_t>{{"posix", 1}}));

  const test::TempDir dir;
  const std::string path = dir.file("a.safetensors");
  std::vector<std::byte> bytes(4096, std::byte{7});
  save_checkpoint(path, {{.name = "a", .dtype = safetensors::Dtype::U8, .shape = {bytes.size()},
                          .data = {bytes.data(), bytes.size(), {}}}});
  EXPECT_EQ(load_checkpoint(path).stats().backend, "posix");
  EXPECT_EQ(load_checkpoint(path, {.backend = "uring"}).stats().backend, "uring");  // a name given wins

  const ScopedEnv bad("HBMIO_BACKEND", "warp");
  try {
    (void)load_checkpoint(path);
    ADD_FAILURE() << "HBMIO_BACKEND=warp was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("HBMIO_BACKEND='warp'"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW((void)load_checkpoint(path, {.backend = "posix"}));  // the variable is not read
}

// RemoteOptions given with a call are the ones used: the environment, here invalid, is not read.
// (No server is needed: what fails is the connection to a closed port, or libcurl's absence.)
TEST(Config, RemoteOptionsGivenWinOverTheEnvironment) {
  const ScopedEnv connections("HBMIO_REMOTE_CONNECTIONS", "0");
  const RemoteOptions given{.max_attempts = 1, .connect_timeout_seconds = 1};
  const std::string url = "http://127.0.0.1:1/model.safetensors";
  const auto fails_without_naming_the_variable = [](const std::function<void()>& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << what << " reached a closed port";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("HBMIO_REMOTE_CONNECTIONS"), std::string::npos) << what << ": " << e.what();
    }
  };
  fails_without_naming_the_variable([&] { (void)open_checkpoint(url, given); }, "open_checkpoint");
  fails_without_naming_the_variable([&] { (void)load_checkpoint(url, {.remote = given}); }, "load_checkpoint");
  // Without options the environment is the default, and its error says so.
  EXPECT_THROW((void)open_checkpoint(url), Error);
  try {
    (void)load_checkpoint(url);
    ADD_FAILURE() << "load_checkpoint reached a closed port";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("HBMIO_REMOTE_CONNECTIONS='0'"), std::string::npos) << e.what();
  }
}
