// The resident cache's wire format, shared by the server (`hbmio cache serve`) and the loads that
// ask it for files. A Unix stream socket carries frames: a 4-byte little-endian length, then that
// many bytes of JSON; a frame may carry open descriptors (SCM_RIGHTS) with its first byte. A client
// names a file by sending a descriptor it opened itself, never a path, so the server never opens a
// path on a client's behalf and a client can only ask for files it could open (see server.cpp).
//
//   {"op": "get", "add": bool, "count": bool (false: not a load's, kept out of hits and misses)}
//       + one descriptor per file (at most kMaxDescriptors)
//       -> {"results": [{"hit": true, "tier": "host", "bytes": N} | {"hit": false, "reason": "..."}]}
//          + one descriptor per hit, in order: a sealed memfd holding the file's bytes
//   {"op": "copy", ...} -> {"ok": true, "bytes": N}: a DMA into the client's GPU memory (server.cpp)
//   {"op": "status"} -> the server's CacheStatus (cache.cpp: to_json / from_json)
//   any failure      -> {"error": "..."}
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "hbmio/cache.hpp"

namespace hbmio::cache_detail {

// An owned descriptor: closed by the destructor.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) noexcept : fd_(fd) {}
  ~OwnedFd();
  OwnedFd(OwnedFd&& other) noexcept : fd_(other.release()) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  int get() const noexcept { return fd_; }
  int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  explicit operator bool() const noexcept { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Descriptors one frame may carry (the kernel's SCM_MAX_FD is 253).
inline constexpr std::size_t kMaxDescriptors = 250;
// A frame's JSON at most: a status of many thousand entries fits.
inline constexpr std::uint32_t kMaxFrame = 64u << 20;
// The deepest nesting a frame's JSON may have (the messages use four levels at most).
inline constexpr int kMaxDepth = 16;

struct Message {
  nlohmann::json body;
  std::vector<OwnedFd> descriptors;
};

// Sends one frame. Throws Error (op "cache", naming `socket_path`) when the peer is gone.
// `deadline`: a frame the other side has not taken whole by then is given up (Error ETIMEDOUT):
// the server's single serving thread is never held by a client that reads slowly.
void send_message(int socket, const nlohmann::json& body, std::span<const int> descriptors, const std::string& socket_path,
                  std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt);
// Receives one frame; nullopt when the peer closed the connection before its first byte. Throws
// Error on a broken or oversized frame, or when the socket's receive timeout passes mid-frame.
// With `deadline`, a frame not whole by then is an Error (ETIMEDOUT), however slowly it trickles.
std::optional<Message> receive_message(int socket, const std::string& socket_path,
                                       std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt);

// A status as the "status" request's reply carries it, and back.
nlohmann::json to_json(const CacheStatus& status);
CacheStatus status_from_json(const nlohmann::json& body);

// A connected client socket (SOCK_CLOEXEC), with send and receive timeouts of `timeout_ms`.
// Throws Error (op "connect to the resident cache") naming the path and the system's reason.
OwnedFd connect_to(const std::string& socket_path, int timeout_ms);

// Binary (a CUDA IPC handle's 64 bytes) as lower-case hex for a JSON field, and back (a pair of
// digits per byte; what is not hex reads as a short or wrong handle, which opening it refuses).
std::string to_hex(std::string_view bytes);
std::string from_hex(std::string_view hex);

}  // namespace hbmio::cache_detail
