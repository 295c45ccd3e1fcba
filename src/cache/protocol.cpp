// The resident cache's frames over a Unix socket (protocol.hpp).
#include "cache/protocol.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "hbmio/error.hpp"

namespace hbmio::cache_detail {

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

OwnedFd& OwnedFd::operator=(OwnedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

namespace {

ErrorContext context_of(const std::string& socket_path) { return {.op = "cache", .path = socket_path}; }

// Writes all of `data`; the first sendmsg carries the descriptors. With `deadline`, a frame the
// other side has not taken whole by then is given up, however slowly it reads: the sends do not
// wait (MSG_DONTWAIT), and between them poll waits for room until the deadline only.
void send_all(int socket, const std::byte* data, std::size_t size, std::span<const int> descriptors, const std::string& socket_path,
              const std::optional<std::chrono::steady_clock::time_point>& deadline) {
  std::vector<char> control(descriptors.empty() ? 0 : CMSG_SPACE(sizeof(int) * descriptors.size()));
  bool first = true;
  while (size > 0) {
    iovec io{const_cast<std::byte*>(data), size};
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    if (first && !descriptors.empty()) {
      message.msg_control = control.data();
      message.msg_controllen = control.size();
      cmsghdr* header = CMSG_FIRSTHDR(&message);
      header->cmsg_level = SOL_SOCKET;
      header->cmsg_type = SCM_RIGHTS;
      header->cmsg_len = CMSG_LEN(sizeof(int) * descriptors.size());
      std::memcpy(CMSG_DATA(header), descriptors.data(), sizeof(int) * descriptors.size());
    }
    const ssize_t sent = ::sendmsg(socket, &message, MSG_NOSIGNAL | (deadline ? MSG_DONTWAIT : 0));
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (deadline && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now()).count();
        pollfd room{socket, POLLOUT, 0};
        if (left > 0 && ::poll(&room, 1, static_cast<int>(left)) >= 0) continue;
        if (left > 0 && errno == EINTR) continue;
        throw Error(errno_code(ETIMEDOUT), context_of(socket_path), "a frame the other side did not take in time");
      }
      throw Error(errno_code(errno == EAGAIN ? ETIMEDOUT : errno), context_of(socket_path), "send");
    }
    first = false;
    data += sent;
    size -= static_cast<std::size_t>(sent);
  }
}

// Reads exactly `size` bytes; with `descriptors`, takes those that came with them. False at the
// end of the stream before the first byte.
bool receive_all(int socket, std::byte* data, std::size_t size, std::vector<OwnedFd>* descriptors, const std::string& socket_path,
                 const std::optional<std::chrono::steady_clock::time_point>& deadline) {
  std::size_t got = 0;
  std::vector<char> control(descriptors ? CMSG_SPACE(sizeof(int) * kMaxDescriptors) : 0);
  while (got < size) {
    iovec io{data + got, size - got};
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    if (descriptors) {
      message.msg_control = control.data();
      message.msg_controllen = control.size();
    }
    const ssize_t n = ::recvmsg(socket, &message, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(errno_code(errno == EAGAIN ? ETIMEDOUT : errno), context_of(socket_path), "receive");
    }
    if (descriptors) {
      for (cmsghdr* header = CMSG_FIRSTHDR(&message); header; header = CMSG_NXTHDR(&message, header)) {
        if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t k = 0; k < count; ++k) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(header) + k * sizeof(int), sizeof(int));
          descriptors->emplace_back(fd);
        }
      }
      if (message.msg_flags & MSG_CTRUNC)
        throw Error(errno_code(EPROTO), context_of(socket_path), fmt::format("more than {} descriptors in one frame", kMaxDescriptors));
    }
    if (n == 0) {
      if (got == 0) return false;
      throw Error(errno_code(ECONNRESET), context_of(socket_path), "the peer closed the connection mid-frame");
    }
    got += static_cast<std::size_t>(n);
    if (got < size && deadline && std::chrono::steady_clock::now() > *deadline)
      throw Error(errno_code(ETIMEDOUT), context_of(socket_path), "a frame that did not arrive in time");
  }
  return true;
}

}  // namespace

void send_message(int socket, const nlohmann::json& body, std::span<const int> descriptors, const std::string& socket_path,
                  std::optional<std::chrono::steady_clock::time_point> deadline) {
  if (descriptors.size() > kMaxDescriptors)
    throw Error(errno_code(EINVAL), context_of(socket_path), fmt::format("{} descriptors in one frame (at most {})", descriptors.size(), kMaxDescriptors));
  const std::string text = body.dump();
  if (text.size() > kMaxFrame) throw Error(errno_code(EMSGSIZE), context_of(socket_path), fmt::format("a frame of {} bytes", text.size()));
  std::vector<std::byte> frame(4 + text.size());
  const auto length = static_cast<std::uint32_t>(text.size());
  for (int k = 0; k < 4; ++k) frame[k] = static_cast<std::byte>((length >> (8 * k)) & 0xff);
  std::memcpy(frame.data() + 4, text.data(), text.size());
  send_all(socket, frame.data(), frame.size(), descriptors, socket_path, deadline);
}

std::optional<Message> receive_message(int socket, const std::string& socket_path,
                                       std::optional<std::chrono::steady_clock::time_point> deadline) {
  Message message;
  std::byte header[4];
  if (!receive_all(socket, header, sizeof header, &message.descriptors, socket_path, deadline)) return std::nullopt;
  std::uint32_t length = 0;
  for (int k = 0; k < 4; ++k) length |= std::to_integer<std::uint32_t>(header[k]) << (8 * k);
  if (length > kMaxFrame) throw Error(errno_code(EMSGSIZE), context_of(socket_path), fmt::format("a frame of {} bytes (at most {})", length, kMaxFrame));
  std::string text(length, '\0');
  if (length > 0 && !receive_all(socket, reinterpret_cast<std::byte*>(text.data()), length, nullptr, socket_path, deadline))
    throw Error(errno_code(ECONNRESET), context_of(socket_path), "the peer closed the connection mid-frame");
  try {
    // The protocol's messages nest a few levels deep; a frame of brackets would otherwise make a
    // tree node per byte (dozens of times the frame in memory) before anything looked at it.
    message.body = nlohmann::json::parse(text, [&socket_path](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > kMaxDepth)
        throw Error(errno_code(EPROTO), context_of(socket_path), fmt::format("a frame nested deeper than {} levels", kMaxDepth));
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    throw Error(errno_code(EPROTO), context_of(socket_path), fmt::format("a frame that is not JSON: {}", e.what()));
  }
  return message;
}

std::string to_hex(std::string_view bytes) {
  std::string out;
  out.reserve(2 * bytes.size());
  for (const char ch : bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(ch));
  return out;
}

std::string from_hex(std::string_view hex) {
  const auto digit = [](char c) { return c >= 'a' ? c - 'a' + 10 : c >= 'A' ? c - 'A' + 10 : c - '0'; };
  std::string out;
  for (std::size_t k = 0; k + 1 < hex.size(); k += 2) out.push_back(static_cast<char>(digit(hex[k]) * 16 + digit(hex[k + 1])));
  return out;
}

OwnedFd connect_to(const std::string& socket_path, int timeout_ms) {
  const ErrorContext context{.op = "connect to the resident cache", .path = socket_path};
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof address.sun_path)
    throw Error(errno_code(ENAMETOOLONG), context, fmt::format("a socket path must have 1 to {} bytes", sizeof address.sun_path - 1));
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  OwnedFd socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket) throw Error(errno_code(errno), context, "socket");
  const timeval timeout{.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
  ::setsockopt(socket.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(socket.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  if (::connect(socket.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) throw Error(errno_code(errno), context);
  return socket;
}

}  // namespace hbmio::cache_detail
