// Ranged GETs with libcurl's easy interface: one handle per worker thread, each keeping its
// connection open between requests (handles go back to a process-wide pool, so a header read and
// the data read after it share connections). Parallelism is threads rather than curl's multi
// interface so that each part's copy into GPU memory runs on its worker, beside the others' GETs.
#include "hbmio/remote.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "hbmio/error.hpp"
#include "memory/cuda_runtime.hpp"
#include "remote/s3_config.hpp"
#include "shim/curl_api.hpp"

namespace hbmio {
namespace {

using remote::Target;
using Clock = std::chrono::steady_clock;

// Idle easy handles, reused (with their connections) by later requests.
class HandlePool {
 public:
  CURL* take() {
    {
      std::lock_guard lock(mutex_);
      if (!idle_.empty()) {
        CURL* h = idle_.back();
        idle_.pop_back();
        return h;
      }
    }
    CURL* h = shim::curl_api().easy_init();
    if (h == nullptr) throw Error(errno_code(ENOMEM), {.op = "GET"}, "curl_easy_init failed");
    return h;
  }
  void give_back(CURL* h) {
    std::lock_guard lock(mutex_);
    if (idle_.size() < 64) idle_.push_back(h);
    else shim::curl_api().easy_cleanup(h);
  }
  static HandlePool& shared() {
    static HandlePool* pool = new HandlePool();  // never destroyed: handles may outlive static destructors' order
    return *pool;
  }

 private:
  std::mutex mutex_;
  std::vector<CURL*> idle_;
};

class Handle {
 public:
  Handle() : h_(HandlePool::shared().take()) {}
  ~Handle() { HandlePool::shared().give_back(h_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  CURL* get() const noexcept { return h_; }

 private:
  CURL* h_;
};

// What a response said, and where its body went.
struct Response {
  long status = 0;
  std::string etag, content_range, error_code, error_message;
  std::uint64_t received = 0;
  bool overflow = false;   // more body than the range asked for
  std::string error_body;  // the start of a non-2xx body (S3's XML error), for its <Code> only
};

struct Sink {
  std::byte* data = nullptr;
  std::uint64_t capacity = 0;
  Response* response = nullptr;
  const std::atomic<bool>* stop = nullptr;
};

std::size_t on_body(char* ptr, std::size_t size, std::size_t n, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const std::size_t bytes = size * n;
  Response& r = *sink->response;
  if (r.status < 200 || r.status >= 300) {
    if (r.error_body.size() < 4096) r.error_body.append(ptr, std::min<std::size_t>(bytes, 4096 - r.error_body.size()));
    return bytes;
  }
  if (r.received + bytes > sink->capacity) {
    r.overflow = true;
    return 0;  // aborts the transfer: the server sent more than the range
  }
  if (sink->data != nullptr) std::memcpy(sink->data + r.received, ptr, bytes);
  r.received += bytes;
  return bytes;
}

std::size_t on_header(char* ptr, std::size_t size, std::size_t n, void* user) {
  auto* r = static_cast<Response*>(user);
  const std::size_t bytes = size * n;
  std::string_view line(ptr, bytes);
  while (!line.empty() && (line.back() == '\r' || line.back() == '\n')) line.remove_suffix(1);
  if (line.starts_with("HTTP/")) {  // a new response (after a redirect or 100-continue): start over
    *r = {};
    const std::size_t sp = line.find(' ');
    if (sp != std::string_view::npos) r->status = std::strtol(std::string(line.substr(sp + 1, 3)).c_str(), nullptr, 10);
    return bytes;
  }
  const std::size_t colon = line.find(':');
  if (colon == std::string_view::npos) return bytes;
  std::string name(line.substr(0, colon));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (name == "etag") r->etag = value;
  else if (name == "content-range") r->content_range = value;
  return bytes;
}

int on_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  const auto* stop = static_cast<const std::atomic<bool>*>(user);
  return stop != nullptr && stop->load(std::memory_order_relaxed) ? 1 : 0;
}

// The text between <Tag> and </Tag> of S3's error XML (its Code and Message carry no secrets;
// other elements, such as a signature mismatch's canonical request, may).
std::string xml_field(const std::string& body, const std::string& tag) {
  const std::size_t a = body.find("<" + tag + ">");
  if (a == std::string::npos) return {};
  const std::size_t start = a + tag.size() + 2;
  const std::size_t b = body.find("</" + tag + ">", start);
  return b == std::string::npos ? std::string() : body.substr(start, std::min<std::size_t>(b - start, 200));
}

struct Attempt {
  CURLcode curl = CURLE_OK;
  Response response;
};

// One GET of bytes [offset, offset + length) (length 0: the first byte, to learn the size).
Attempt get_once(const Target& target, const RemoteOptions& options, std::uint64_t offset, std::uint64_t length, const std::string& if_match,
                 std::byte* into, const std::atomic<bool>* stop) {
  const auto& curl = shim::curl_api();
  Handle handle;
  CURL* h = handle.get();
  curl.easy_reset(h);  // keeps the connection, forgets the last request's options
  Attempt a;
  Sink sink{into, length == 0 ? 1 : length, &a.response, stop};
  const std::string range = fmt::format("{}-{}", offset, offset + std::max<std::uint64_t>(length, 1) - 1);
  curl_slist* headers = nullptr;
  std::string userpwd, sigv4;
  if (!if_match.empty()) headers = curl.slist_append(headers, ("If-Match: " + if_match).c_str());
  if (target.s3 && target.credentials) {
    // The payload hash S3 requires; curl signs this header and uses its value as the hash.
    headers = curl.slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!target.credentials->session_token.empty())
      headers = curl.slist_append(headers, ("x-amz-security-token: " + target.credentials->session_token).c_str());
    userpwd = target.credentials->access_key + ":" + target.credentials->secret_key;
    sigv4 = "aws:amz:" + target.region + ":s3";
    curl.easy_setopt(h, CURLOPT_USERPWD, userpwd.c_str());
    curl.easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
  } else {
    curl.easy_setopt(h, CURLOPT_FOLLOWLOCATION, 1L);  // Hugging Face's resolve URLs redirect to a CDN
    curl.easy_setopt(h, CURLOPT_MAXREDIRS, 10L);
  }
  curl.easy_setopt(h, CURLOPT_URL, target.request_url.c_str());
  curl.easy_setopt(h, CURLOPT_RANGE, range.c_str());
  curl.easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  curl.easy_setopt(h, CURLOPT_WRITEFUNCTION, &on_body);
  curl.easy_setopt(h, CURLOPT_WRITEDATA, &sink);
  curl.easy_setopt(h, CURLOPT_HEADERFUNCTION, &on_header);
  curl.easy_setopt(h, CURLOPT_HEADERDATA, &a.response);
  curl.easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  // Bigger receive buffers: fewer callbacks and copies per part (libcurl's default is 16 KiB).
  curl.easy_setopt(h, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl.easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options.connect_timeout_seconds * 1000));
  curl.easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl.easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max(1.0, options.stall_timeout_seconds)));
  curl.easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl.easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &on_progress);
  curl.easy_setopt(h, CURLOPT_XFERINFODATA, stop);
  curl.easy_setopt(h, CURLOPT_ACCEPT_ENCODING, nullptr);  // bytes as stored: a range of a compressed body is another range
  a.curl = curl.easy_perform(h);
  if (a.response.status == 0) {
    long code = 0;
    curl.easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    a.response.status = code;
  }
  curl.slist_free_all(headers);
  // Only Code and Message of an error body are kept (see xml_field).
  a.response.error_code = xml_field(a.response.error_body, "Code");
  a.response.error_message = xml_field(a.response.error_body, "Message");
  a.response.error_body.clear();
  return a;
}

bool transient(CURLcode c) {
  switch (c) {
    case CURLE_COULDNT_CONNECT: case CURLE_OPERATION_TIMEDOUT: case CURLE_RECV_ERROR: case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE: case CURLE_GOT_NOTHING: case CURLE_SSL_CONNECT_ERROR: case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_HTTP2: case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

int errno_of_status(long status) {
  if (status == 404) return ENOENT;
  if (status == 401 || status == 403) return EACCES;
  if (status == 412) return ESTALE;
  if (status == 408 || status == 504) return ETIMEDOUT;
  return EIO;
}

std::string describe(const Attempt& a) {
  const Response& r = a.response;
  std::string s = a.curl != CURLE_OK && a.curl != CURLE_WRITE_ERROR ? shim::curl_api().easy_strerror(a.curl)
                                                                   : fmt::format("HTTP {}", r.status);
  if (!r.error_code.empty()) s += " " + r.error_code;
  if (!r.error_message.empty()) s += ": " + r.error_message;
  return s;
}

// "bytes 0-0/1234" (or "bytes */1234" with 416) -> 1234.
std::optional<std::uint64_t> total_of(const std::string& content_range) {
  const std::size_t slash = content_range.rfind('/');
  if (slash == std::string::npos || content_range.substr(slash + 1) == "*") return std::nullopt;
  return std::strtoull(content_range.c_str() + slash + 1, nullptr, 10);
}

// A GET with the retry policy. `expect_etag`: the version every later GET must see.
Response get(const Target& target, const RemoteOptions& options, std::uint64_t offset, std::uint64_t length,
             const std::string& expect_etag, std::byte* into, const std::atomic<bool>* stop) {
  const ErrorContext context{.op = "GET", .path = target.shown, .offset = offset, .length = length};
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const unsigned attempts = std::max(1u, options.max_attempts);
  for (unsigned attempt = 1;; ++attempt) {
    // If-Match compares strongly: a weak ETag (W/"...") never matches, so it is only compared.
    const bool strong = !expect_etag.empty() && !expect_etag.starts_with("W/");
    Attempt a = get_once(target, options, offset, length, strong ? expect_etag : std::string(), into, stop);
    const Response& r = a.response;
    if (stop != nullptr && stop->load()) throw Error(errno_code(ECANCELED), context, "stopped: another part failed");
    std::string retry_why;
    const bool answered = a.curl == CURLE_OK || (a.curl == CURLE_WRITE_ERROR && r.overflow);
    if (answered) {
      if (r.status == 412)
        throw Error(errno_code(ESTALE), context,
                    fmt::format("the object changed during the load (its ETag is no longer {}): nothing of the new version was used", expect_etag));
      const bool whole = r.status == 200 && length != 0 && offset == 0 && !r.overflow && r.received == length;
      if (r.status == 200 && !whole)
        throw Error(errno_code(ENOTSUP), context, "the server ignored the byte range (HTTP 200 with the whole object): it cannot serve parts of it");
      if (whole || r.status == 206 || (r.status == 416 && length == 0)) {
        if (r.overflow) throw Error(errno_code(EPROTO), context, "the server sent more bytes than the range asked for");
        if (!expect_etag.empty() && !r.etag.empty() && r.etag != expect_etag)
          throw Error(errno_code(ESTALE), context, fmt::format("the object changed during the load (ETag {} then {})", expect_etag, r.etag));
        if (length == 0 || r.received == length) return r;
        retry_why = fmt::format("short body: {} of {} bytes", r.received, length);
      } else if (r.status >= 500 || r.status == 429 || r.status == 408) {
        retry_why = describe(a);
      } else {
        throw Error(errno_code(errno_of_status(r.status)), context, fmt::format("attempt {} of {}: {}", attempt, attempts, describe(a)));
      }
    } else if (transient(a.curl)) {
      retry_why = describe(a);
    } else {
      throw Error(errno_code(EIO), context, fmt::format("attempt {} of {}: {}", attempt, attempts, describe(a)));
    }
    if (attempt >= attempts)
      throw Error(errno_code(r.status == 0 ? ETIMEDOUT : errno_of_status(r.status)), context,
                  fmt::format("attempt {} of {}: {} (gave up)", attempt, attempts, retry_why));
    // Exponential backoff with full jitter (a random wait up to the bound), so that many workers
    // retrying after one server hiccup do not return in step.
    const double bound = std::min(10.0, options.backoff_seconds * static_cast<double>(1u << std::min(attempt - 1, 16u)));
    std::uniform_real_distribution<double> wait(0, bound);
    std::this_thread::sleep_for(std::chrono::duration<double>(wait(rng)));
  }
}

}  // namespace

bool is_remote_url(std::string_view path) noexcept {
  return path.starts_with("s3://") || path.starts_with("http://") || path.starts_with("https://");
}

RemoteOptions RemoteOptions::from_env() {
  RemoteOptions o;
  if (const char* v = std::getenv("HBMIO_REMOTE_CONNECTIONS"); v && *v) o.connections = static_cast<unsigned>(parse_size(v));
  if (const char* v = std::getenv("HBMIO_REMOTE_PART_SIZE"); v && *v) o.part_size = parse_size(v);
  if (const char* v = std::getenv("HBMIO_REMOTE_ATTEMPTS"); v && *v) o.max_attempts = static_cast<unsigned>(parse_size(v));
  if (o.connections == 0 || o.connections > 1024) throw Error(errno_code(EINVAL), {.op = "configure"}, "HBMIO_REMOTE_CONNECTIONS: 1..1024");
  if (o.part_size < 4096) throw Error(errno_code(EINVAL), {.op = "configure"}, "HBMIO_REMOTE_PART_SIZE: at least 4 KiB");
  return o;
}

struct RemoteObject::State {
  std::string url;
  Target target;
  RemoteOptions options;
  std::uint64_t size = 0;
  std::string etag;
};

RemoteObject::RemoteObject(std::unique_ptr<State> state) : state_(std::move(state)) {}
RemoteObject::~RemoteObject() = default;

std::shared_ptr<RemoteObject> RemoteObject::open(const std::string& url, const RemoteOptions& options) {
  auto state = std::make_unique<State>();
  state->url = url;
  state->options = options;
  state->target = remote::resolve(url, options);
  // A GET of the first byte rather than a HEAD: presigned URLs are signed for one method.
  const Response r = get(state->target, options, 0, 0, "", nullptr, nullptr);
  if (r.status == 206 || r.status == 416) {
    const auto total = total_of(r.content_range);
    if (!total)
      throw Error(errno_code(EPROTO), {.op = "GET", .path = state->target.shown},
                  fmt::format("no object size in the response's Content-Range ('{}')", r.content_range));
    state->size = *total;
  } else {
    throw Error(errno_code(ENOTSUP), {.op = "GET", .path = state->target.shown},
                fmt::format("HTTP {} to a byte-range request: the server cannot serve parts of the object", r.status));
  }
  state->etag = r.etag;
  return std::shared_ptr<RemoteObject>(new RemoteObject(std::move(state)));
}

const std::string& RemoteObject::url() const noexcept { return state_->url; }
const std::string& RemoteObject::shown() const noexcept { return state_->target.shown; }
std::uint64_t RemoteObject::size() const noexcept { return state_->size; }
const std::string& RemoteObject::etag() const noexcept { return state_->etag; }

void RemoteObject::read(std::uint64_t offset, MemorySpan into) const {
  const RemoteRead r{this, offset, into};
  read_remote({&r, 1}, state_->options);
}

Stats read_remote(std::span<const RemoteRead> reads, const RemoteOptions& options, std::atomic<std::uint64_t>* progress) {
  struct Part {
    const RemoteRead* read;
    std::uint64_t at, length;  // within the read
  };
  std::vector<Part> parts;
  for (const RemoteRead& r : reads) {
    if (r.offset + r.into.size > r.object->size())
      throw Error(errno_code(EINVAL), {.op = "GET", .path = r.object->shown(), .offset = r.offset, .length = r.into.size},
                  fmt::format("the range passes the object's end ({} bytes)", r.object->size()));
    for (std::uint64_t at = 0; at < r.into.size; at += options.part_size)
      parts.push_back({&r, at, std::min<std::uint64_t>(options.part_size, r.into.size - at)});
  }
  Stats stats;
  stats.backend = "remote";
  const Clock::time_point start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  const unsigned workers = static_cast<unsigned>(std::min<std::size_t>(std::max(1u, options.connections), parts.size()));
  const auto work = [&] {
    try {
      // GPU destinations land in a pinned buffer first, copied to the device when the part is in.
      Buffer bounce;
      for (std::size_t i = next++; i < parts.size() && !failed; i = next++) {
        const Part& p = parts[i];
        const RemoteRead& r = *p.read;
        const auto& state = *r.object;
        std::byte* dest = r.into.data + p.at;
        const bool device = r.into.kind() == MemoryKind::device;
        if (device) {
          if (bounce.size() < p.length) bounce = Buffer::allocate({MemoryKind::pinned}, options.part_size);
          dest = bounce.data();
        }
        get(state.state_->target, options, r.offset + p.at, p.length, state.etag(), dest, &failed);
        if (device) {
          const ErrorContext context{.op = "copy to the device", .path = state.shown(), .offset = r.offset + p.at, .length = p.length};
          cuda::DeviceGuard guard(r.into.location.device, context);
          cuda::memcpy_sync(r.into.data + p.at, bounce.data(), p.length, context);
        }
        if (progress) *progress += p.length;
      }
    } catch (...) {
      std::lock_guard lock(error_mutex);
      // The first real failure wins over the ECANCELED of the parts it stopped.
      if (!first_error) first_error = std::current_exception();
      failed = true;
    }
  };
  {
    std::vector<std::jthread> threads;
    for (unsigned w = 1; w < workers; ++w) threads.emplace_back(work);
    if (workers > 0) work();
  }
  if (first_error) std::rethrow_exception(first_error);
  for (const RemoteRead& r : reads) stats.bytes += r.into.size;
  stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  stats.cpu_seconds = process_cpu_seconds() - cpu_start;
  stats.workers = workers;
  stats.note = fmt::format("{} ranged GETs of up to {} over {} connections", parts.size(), format_size(options.part_size), workers);
  return stats;
}

std::string remote_sibling(const std::string& url, const std::string& name) {
  const std::size_t query = url.find_first_of("?#");
  const std::string base = url.substr(0, query);
  const std::size_t slash = base.rfind('/');
  return base.substr(0, slash + 1) + name;
}

}  // namespace hbmio
