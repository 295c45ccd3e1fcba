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
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "hbmio/error.hpp"
#include "memory/cuda_runtime.hpp"
#include "memory/staging_ring.hpp"
#include "remote/http.hpp"

namespace hbmio {
namespace {

using remote::Handle;
using remote::Response;
using remote::Sink;
using remote::Target;
using Clock = std::chrono::steady_clock;
using detail::StagingRing;

struct Attempt {
  CURLcode curl = CURLE_OK;
  Response response;
};

// Where a GET's payload goes: a plain pointer (host memory), or a function given each piece with
// its offset in the range (GPU memory, through a DeviceLanding); neither: dropped (discard) or,
// for a size probe, nowhere.
struct Destination {
  std::byte* data = nullptr;
  std::function<void(std::uint64_t at, const std::byte* bytes, std::size_t size)> deliver;
};

// The version of an object that every GET of it must see: fixed by its first GET.
struct Version {
  std::string etag, last_modified;
  std::uint64_t size = 0;  // 0: not known yet (the first GET)
};

// "bytes 0-0/1234" (or "bytes */1234" with 416) -> 1234.
std::optional<std::uint64_t> total_of(const std::string& content_range) {
  const std::size_t slash = content_range.rfind('/');
  if (slash == std::string::npos || content_range.substr(slash + 1) == "*") return std::nullopt;
  return std::strtoull(content_range.c_str() + slash + 1, nullptr, 10);
}

// One GET of bytes [offset, offset + length) (length 0: the first byte, to learn the size), its
// payload put at `at` onwards of `to`.
Attempt get_once(const Target& target, const RemoteOptions& options, std::uint64_t offset, std::uint64_t length, const std::string& if_match,
                 std::uint64_t size, const Destination& to, std::uint64_t at, const std::atomic<bool>* stop) {
  const auto& curl = shim::curl_api();
  Handle handle;
  CURL* h = handle.get();
  curl.easy_reset(h);  // keeps the connection, forgets the last request's options
  Attempt a;
  Sink sink{.data = to.data == nullptr ? nullptr : to.data + at,
            .capacity = length == 0 ? 1 : length,
            .discard = options.discard && length > 0,
            .response = &a.response,
            .stop = stop,
            .expect = {.ranged = true, .first = offset, .last = offset + std::max<std::uint64_t>(length, 1) - 1, .total = size}};
  if (to.deliver) sink.deliver = [&](std::uint64_t received, const std::byte* bytes, std::size_t n) { to.deliver(at + received, bytes, n); };
  const std::string range = fmt::format("{}-{}", offset, offset + std::max<std::uint64_t>(length, 1) - 1);
  curl_slist* headers = nullptr;
  std::string userpwd, sigv4;
  if (!if_match.empty()) headers = curl.slist_append(headers, ("If-Match: " + if_match).c_str());
  remote::prepare(h, target, options, sink, headers, userpwd, sigv4, std::max<std::uint64_t>(length, 1));
  curl.easy_setopt(h, CURLOPT_URL, target.request_url.c_str());
  curl.easy_setopt(h, CURLOPT_RANGE, range.c_str());
  curl.easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  a.curl = remote::perform(h, headers, a.response);
  if (sink.error) std::rethrow_exception(sink.error);  // the destination failed (a CUDA copy)
  // A 206 without a body never reached the body callback's check.
  if (a.response.status == 206 && !sink.checked) a.response.refused = remote::range_mismatch(a.response.content_range, sink.expect);
  return a;
}

// A GET with the retry policy. `expect`: the version every later GET must see (its ETag, else its
// Last-Modified, and its size, checked on every answer). A retry after a body that broke off asks
// only for the bytes still missing: a reset late in a large part costs its rest, not the whole
// part again.
Response get(const Target& target, const RemoteOptions& options, std::uint64_t offset, std::uint64_t length,
             const Version& expect, const Destination& to, const std::atomic<bool>* stop) {
  const ErrorContext context{.op = "GET", .path = target.shown, .offset = offset, .length = length};
  const unsigned attempts = std::max(1u, options.max_attempts);
  const auto changed = [&](const Response& r) {
    return Error(errno_code(ESTALE), context,
                 !r.etag.empty() ? fmt::format("the object changed during the load (ETag {} then {})", expect.etag, r.etag)
                                 : fmt::format("the object changed during the load (Last-Modified {} then {})", expect.last_modified, r.last_modified));
  };
  std::uint64_t done = 0;  // bytes of the range in place from earlier attempts
  for (unsigned attempt = 1;; ++attempt) {
    // If-Match compares strongly: a weak ETag (W/"...") never matches, so it is only compared.
    const bool strong = !expect.etag.empty() && !expect.etag.starts_with("W/");
    Attempt a = get_once(target, options, offset + done, length - done, strong ? expect.etag : std::string(), expect.size, to, done, stop);
    const Response& r = a.response;
    if (stop != nullptr && stop->load()) throw Error(errno_code(ECANCELED), context, "stopped: another part failed");
    const bool answered = a.curl == CURLE_OK || (a.curl == CURLE_WRITE_ERROR && r.overflow);
    if (r.status == 200 || r.status == 206) {
      // Which version answered is known from the headers alone: checked before anything else
      // (before bytes of a broken-off body are kept for a resumed attempt, too).
      if (!expect.etag.empty() && !r.etag.empty() && r.etag != expect.etag) throw changed(r);
      if (expect.etag.empty() && !expect.last_modified.empty() && !r.last_modified.empty() && r.last_modified != expect.last_modified)
        throw changed(r);
      // A version seen first must be seen again: an answer without it could be of another object
      // of the same size (HTTP requires a 206 to carry the validators a 200 would have).
      if ((!expect.etag.empty() && r.etag.empty()) || (expect.etag.empty() && !expect.last_modified.empty() && r.last_modified.empty()))
        throw Error(errno_code(ESTALE), context,
                    fmt::format("the server answered without the {} its first answer had ({}): the object's version cannot be checked",
                                expect.etag.empty() ? "Last-Modified" : "ETag", expect.etag.empty() ? expect.last_modified : expect.etag));
    }
    if (!r.refused.empty()) {
      // A 206 of another range or size, or a 200 to a ranged GET: not an accident a retry mends.
      const auto total = total_of(r.content_range);
      const bool resized = r.status == 206 && expect.size != 0 && total && *total != expect.size;
      throw Error(errno_code(r.status == 200 ? ENOTSUP : resized ? ESTALE : EPROTO), context, r.refused);
    }
    std::string retry_why;
    if (answered) {
      if (r.status == 412)
        throw Error(errno_code(ESTALE), context,
                    fmt::format("the object changed during the load (its ETag is no longer {}): nothing of the new version was used", expect.etag));
      const bool whole = r.status == 200 && length != 0 && offset + done == 0 && !r.overflow && r.received == length;
      if (r.status == 200 && !whole)
        throw Error(errno_code(ENOTSUP), context, "the server ignored the byte range (HTTP 200 with the whole object): it cannot serve parts of it");
      if (whole || r.status == 206 || (r.status == 416 && length == 0)) {
        if (r.overflow) throw Error(errno_code(EPROTO), context, "the server sent more bytes than the range asked for");
        if (length == 0 || done + r.received == length) return r;
        // A body that ended without a transfer error but short was sent as whole by the server
        // (a shorter Content-Length, a chunked body ended early): its bytes are not the range's,
        // and resuming after them would keep them. (A body that broke off is a transfer error:
        // resumed below.)
        throw Error(errno_code(EPROTO), context,
                    fmt::format("the server ended the body after {} of the range's {} bytes without an error: its answer "
                                "is not the range asked for", r.received, length - done));
      } else if (remote::transient_status(r.status)) {
        retry_why = remote::describe(a.curl, a.response);
      } else {
        throw Error(errno_code(remote::errno_of_status(r.status)), context, fmt::format("attempt {} of {}: {}", attempt, attempts, remote::describe(a.curl, a.response)));
      }
    } else if (remote::transient(a.curl)) {
      retry_why = remote::describe(a.curl, a.response);
    } else {
      throw Error(errno_code(EIO), context, fmt::format("attempt {} of {}: {}", attempt, attempts, remote::describe(a.curl, a.response)));
    }
    // Bytes of a ranged answer of the expected version are kept; the next attempt resumes after
    // them. Every byte there (the error came after the body, e.g. a lost final chunk): done.
    if (r.status == 206 && length != 0) {
      done += r.received;
      if (done == length) return r;
    }
    if (attempt >= attempts)
      throw Error(errno_code(remote::errno_of_failure(a.curl, r.status)), context,
                  fmt::format("attempt {} of {}: {} (gave up)", attempt, attempts, retry_why));
    remote::backoff(attempt, options, r.retry_after, stop);
  }
}

// A worker's way into GPU memory. The part's bytes land in a ring of pinned chunks (StagingRing),
// and each full chunk is copied to the device on the ring's stream at once, so the copy runs while
// the rest of the part is still arriving; a chunk is written again only once its copy is done
// (waits that sleep rather than spin: the cores are the network's). A few chunks, not a
// part-sized buffer, per connection: the part size is the network's choice, not a pinned-memory
// cost.
class DeviceLanding {
 public:
  static constexpr std::size_t kChunk = std::size_t{4} << 20;
  static constexpr std::size_t kChunks = 4;

  DeviceLanding(int device, const ErrorContext& context) : ring_(MemoryKind::pinned, kChunks, kChunk), device_(device) {
    ring_.use_device(device, context);
    current_ = ring_.acquire();
  }
  int device() const noexcept { return device_; }

  // A part going to `dest` (device memory) starts.
  void start(std::byte* dest, const ErrorContext& context) {
    dest_ = dest;
    begin_ = filled_ = 0;
    context_ = context;
  }
  // Bytes at offset `at` of the part. A new attempt resuming elsewhere sends what the chunk holds
  // (valid bytes of the part) and starts a new chunk there.
  void write(std::uint64_t at, const std::byte* bytes, std::size_t size) {
    if (at != begin_ + filled_) {
      send();
      begin_ = at;
    }
    while (size > 0) {
      const std::size_t n = std::min(size, kChunk - filled_);
      std::memcpy(ring_.data(current_) + filled_, bytes, n);
      filled_ += n;
      bytes += n;
      size -= n;
      if (filled_ == kChunk) send();
    }
  }
  // Sends the last chunk and waits until every byte of the part is in device memory.
  void finish() {
    send();
    while (ring_.copying()) ring_.reclaim_oldest(std::chrono::microseconds(0), context_);
  }

 private:
  void send() {
    if (filled_ == 0) return;
    ring_.copy_to_device(current_, 0, dest_ + begin_, filled_, context_);
    begin_ += filled_;
    filled_ = 0;
    current_ = ring_.acquire();
    if (current_ < 0) {  // every chunk is being copied: the oldest must be done before it is refilled
      ring_.reclaim_oldest(std::chrono::microseconds(0), context_);
      current_ = ring_.acquire();
    }
  }

  StagingRing ring_;
  int device_;
  int current_ = -1;  // the chunk being filled
  std::byte* dest_ = nullptr;
  std::uint64_t begin_ = 0;  // the part offset of the current chunk's first byte
  std::size_t filled_ = 0;
  ErrorContext context_;
};

}  // namespace

bool is_remote_url(std::string_view path) noexcept {
  return path.starts_with("s3://") || path.starts_with("http://") || path.starts_with("https://");
}

struct RemoteObject::State {
  std::string url;
  Target target;
  RemoteOptions options;
  Version version;
};

RemoteObject::RemoteObject(std::unique_ptr<State> state) : state_(std::move(state)) {}
RemoteObject::~RemoteObject() = default;

std::shared_ptr<RemoteObject> RemoteObject::open(const std::string& url, const RemoteOptions& options) {
  auto state = std::make_unique<State>();
  state->url = url;
  state->options = options;
  state->target = remote::resolve(url, options);
  // A GET of the first byte rather than a HEAD: presigned URLs are signed for one method.
  const Response r = get(state->target, options, 0, 0, Version{}, {}, nullptr);
  if (r.status == 206 || r.status == 416) {
    const auto total = total_of(r.content_range);
    if (!total)
      throw Error(errno_code(EPROTO), {.op = "GET", .path = state->target.shown},
                  fmt::format("no object size in the response's Content-Range ('{}')", r.content_range));
    state->version.size = *total;
  } else {
    throw Error(errno_code(ENOTSUP), {.op = "GET", .path = state->target.shown},
                fmt::format("HTTP {} to a byte-range request: the server cannot serve parts of the object", r.status));
  }
  state->version.etag = r.etag;
  state->version.last_modified = r.last_modified;
  return std::shared_ptr<RemoteObject>(new RemoteObject(std::move(state)));
}

const std::string& RemoteObject::url() const noexcept { return state_->url; }
const std::string& RemoteObject::shown() const noexcept { return state_->target.shown; }
std::uint64_t RemoteObject::size() const noexcept { return state_->version.size; }
const std::string& RemoteObject::etag() const noexcept { return state_->version.etag; }
const std::string& RemoteObject::last_modified() const noexcept { return state_->version.last_modified; }
const RemoteOptions& RemoteObject::options() const noexcept { return state_->options; }

void RemoteObject::read(std::uint64_t offset, MemorySpan into) const {
  const RemoteRead r{this, offset, into};
  read_remote({&r, 1}, state_->options);
}

Stats read_remote(std::span<const RemoteRead> reads, const RemoteOptions& options, std::atomic<std::uint64_t>* progress,
                  const LandedFunction& landed) {
  struct Part {
    std::size_t read;
    std::uint64_t at, length;  // within the read
  };
  std::uint64_t total = 0;
  for (const RemoteRead& r : reads) total += r.into.size;
  const std::uint64_t part_size = options.part_size_for(total);
  std::vector<Part> parts;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const RemoteRead& r = reads[i];
    if (r.offset + r.into.size > r.object->size())
      throw Error(errno_code(EINVAL), {.op = "GET", .path = r.object->shown(), .offset = r.offset, .length = r.into.size},
                  fmt::format("the range passes the object's end ({} bytes)", r.object->size()));
    for (std::uint64_t at = 0; at < r.into.size; at += part_size)
      parts.push_back({i, at, std::min<std::uint64_t>(part_size, r.into.size - at)});
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
      std::vector<DeviceLanding> landings;  // one per GPU this worker has written to
      for (std::size_t i = next++; i < parts.size() && !failed; i = next++) {
        const Part& p = parts[i];
        const RemoteRead& r = reads[p.read];
        const auto& state = *r.object;
        const ErrorContext context{.op = "copy to the device", .path = state.shown(), .offset = r.offset + p.at, .length = p.length};
        if (options.discard || r.into.kind() != MemoryKind::device) {
          get(state.state_->target, options, r.offset + p.at, p.length, state.state_->version, {.data = options.discard ? nullptr : r.into.data + p.at}, &failed);
        } else {
          const int device = r.into.location.device;
          cuda::DeviceGuard guard(device, context);
          auto landing = std::find_if(landings.begin(), landings.end(), [&](const DeviceLanding& l) { return l.device() == device; });
          if (landing == landings.end()) landing = landings.emplace(landings.end(), device, context);
          landing->start(r.into.data + p.at, context);
          get(state.state_->target, options, r.offset + p.at, p.length, state.state_->version,
              {.deliver = [&](std::uint64_t at, const std::byte* bytes, std::size_t size) { landing->write(at, bytes, size); }}, &failed);
          landing->finish();
        }
        if (progress) *progress += p.length;
        if (landed) landed(p.read, p.at, p.length);  // a check of what is complete now runs beside the other GETs
      }
    } catch (...) {
      std::lock_guard lock(error_mutex);
      // The first real failure wins over the ECANCELED of the parts it stopped.
      if (!first_error) first_error = std::current_exception();
      failed = true;
    }
  };
  detail::Executor::shared().run(workers, workers, [&](std::size_t) { work(); });
  if (first_error) std::rethrow_exception(first_error);
  for (const RemoteRead& r : reads) stats.bytes += r.into.size;
  stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  stats.cpu_seconds = process_cpu_seconds() - cpu_start;
  stats.workers = workers;
  stats.note = fmt::format("{} ranged GETs of up to {} over {} connections", parts.size(), format_size(part_size), workers);
  // Objects by the name messages use (no query string: a presigned URL's signature stays out).
  const std::string how = fmt::format("an object at a URL: ranged GETs of up to {} over {} connection(s){}", format_size(part_size), workers,
                                      options.discard ? ", bytes dropped on arrival (discard)" : "");
  for (const RemoteRead& r : reads)
    if (r.into.size > 0) stats.add_path({.file = r.object->shown(), .path = DataPath::remote, .reason = how, .bytes = r.into.size});
  return stats;
}

std::string remote_sibling(const std::string& url, const std::string& name) {
  const std::size_t query = url.find_first_of("?#");
  const std::string base = url.substr(0, query);
  const std::size_t slash = base.rfind('/');
  return base.substr(0, slash + 1) + name;
}

}  // namespace hbmio
