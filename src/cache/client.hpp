// What a load asks the resident cache (hbmio/cache.hpp): for each of its open files, the cache's
// copy of the same file, if it holds one.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hbmio/file.hpp"

namespace hbmio::cache_detail {

struct Lookup {
  // Per file asked for: the cache's copy (a sealed memfd, read like the file itself; its path is
  // the file's with " (resident cache)" after it), or null where the cache does not hold it.
  std::vector<std::shared_ptr<const File>> copies;
  // What went wrong with the cache, if anything (unreachable, refused, a broken reply): the load
  // then reads the files, and says this once.
  std::string warning;
};

inline constexpr std::string_view kCopySuffix = " (resident cache)";

// Never throws for the cache's sake: a cache that cannot help is a Lookup without copies.
Lookup lookup(const std::string& socket, std::span<const int> fds, std::span<const std::string> paths, bool add);

}  // namespace hbmio::cache_detail
