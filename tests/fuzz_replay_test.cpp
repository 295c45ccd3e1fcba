// Replays every file under fuzz/corpus/<target>/ and fuzz/regressions/<target>/ through the same
// function the libFuzzer binary calls, so a crash found once stays fixed in ordinary CI (g++,
// no libFuzzer). The targets catch hbmio::Error themselves; anything else escaping is a bug.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_targets.hpp"

namespace {

namespace fs = std::filesystem;
using Target = int (*)(const std::uint8_t*, std::size_t);

std::vector<fs::path> inputs_of(const std::string& target) {
  const char* env = std::getenv("HBMIO_FUZZ_DIR");
  const fs::path root = env && *env ? fs::path(env) : fs::path(HBMIO_SOURCE_FUZZ_DIR);
  std::vector<fs::path> files;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = root / kind / target;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file() && entry.path().filename() != ".gitkeep") files.push_back(entry.path());
  }
  return files;
}

void replay(const std::string& target_name, Target target) {
  const auto files = inputs_of(target_name);
  if (files.empty()) GTEST_SKIP() << "no corpus for " << target_name << " (set HBMIO_FUZZ_DIR to the repo's fuzz/)";
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    SCOPED_TRACE(file.string());
    EXPECT_NO_THROW(target(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
  }
}

TEST(FuzzReplay, SafetensorsHeader) { replay("safetensors_header_fuzzer", hbmio::fuzz::safetensors_header_one_input); }
TEST(FuzzReplay, Index) { replay("index_fuzzer", hbmio::fuzz::index_one_input); }

}  // namespace
