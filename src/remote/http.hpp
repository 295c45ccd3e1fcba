// What the remote reads and uploads share: pooled libcurl handles, response parsing (status,
// ETag, Content-Range, S3's error Code and Message), request signing, and the retry policy's
// classification and backoff.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "hbmio/remote.hpp"
#include "remote/s3_config.hpp"
#include "shim/curl_api.hpp"

namespace hbmio::remote {

// An easy handle from a process-wide pool, returned to it (with its open connection) when done:
// later requests, of this transfer or the next, reuse the connections.
class Handle {
 public:
  Handle();
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  CURL* get() const noexcept { return h_; }

 private:
  CURL* h_;
};

// What a response said.
struct Response {
  long status = 0;
  std::string etag, last_modified, content_range, error_code, error_message;
  // What the body claims to be: its length (where sent) and its encoding ("" or "identity": the
  // bytes as stored; anything else is refused, never taken as the object's bytes).
  std::optional<std::uint64_t> content_length;
  std::string content_encoding;
  unsigned retry_after = 0;  // Retry-After in seconds (503 SlowDown, 429), where given as a number
  std::string location;      // a redirect's target (not followed with credentials: said in the message)
  std::uint64_t received = 0;  // body bytes delivered
  bool overflow = false;       // more body than the caller could take
  // The body was not read to its end on purpose: an error body past what is kept, a 200 to a
  // ranged request, a 206 of another range (`refused` says why). Nothing of it was delivered.
  bool cut = false;
  std::string refused;
  std::string body;            // a non-2xx body's start (S3's XML error), or a kept 2xx body (see Sink)
  std::string unresolved_host; // CURLE_COULDNT_RESOLVE_HOST: the name DNS did not know, for the message
};

// What a ranged GET must get back: bytes [first, last] of an object of `total` bytes (0: not known
// yet, the first GET of an object). Checked before the first byte of a 206 body is delivered.
struct ExpectedRange {
  bool ranged = false;  // a Range header was sent
  std::uint64_t first = 0, last = 0, total = 0;
};

// Why a 206's Content-Range is not the one asked for ("" when it is).
std::string range_mismatch(const std::string& content_range, const ExpectedRange& expected);

// Where a response's body goes: `data` (capacity bytes) or `deliver` for a GET's payload, else
// kept in Response::body up to `keep` bytes (an S3 XML answer).
struct Sink {
  std::byte* data = nullptr;
  // Instead of `data`: called with each piece of the payload and its offset in the body (memory
  // that is not a plain pointer, such as GPU memory reached through bounce buffers). A throw
  // aborts the transfer and is kept in `error`.
  std::function<void(std::uint64_t at, const std::byte* bytes, std::size_t size)> deliver;
  std::exception_ptr error;
  std::uint64_t capacity = 0;
  std::size_t keep = 0;
  bool discard = false;  // a GET's payload counted and dropped (RemoteOptions::discard)
  Response* response = nullptr;
  const std::atomic<bool>* stop = nullptr;
  const std::atomic<bool>* cancel = nullptr;  // a second reason to stop: the caller's (Ctrl-C), beside the request's own
  ExpectedRange expect;
  bool checked = false;  // the 206's Content-Range was compared with `expect`
};

// libcurl callbacks: body into a Sink, headers into a Response, the Sink's stop flags as progress abort.
std::size_t on_body(char* ptr, std::size_t size, std::size_t n, void* sink);
std::size_t on_header(char* ptr, std::size_t size, std::size_t n, void* response);
int on_progress(void* sink, curl_off_t, curl_off_t, curl_off_t, curl_off_t);

// The options every request sets: callbacks, timeouts (a deadline of
// RemoteOptions::deadline_seconds(`bytes`) for the whole request), buffers, and the signing (S3 with
// credentials: SigV4 with an unsigned payload and the session token) or redirects (HTTP).
// Appends the headers it needs to `headers`; `userpwd` and `sigv4` must outlive the request.
void prepare(CURL* h, const Target& target, const RemoteOptions& options, Sink& sink, curl_slist*& headers, std::string& userpwd,
             std::string& sigv4, std::uint64_t bytes);

// Runs the request set up on `h`, frees `headers`, and completes the response: its status where
// no status line was seen, S3's error Code and Message of a non-2xx body.
CURLcode perform(CURL* h, curl_slist* headers, Response& response);

// S3's error XML: the text of <Tag> (only Code and Message are kept: other elements, such as a
// signature mismatch's canonical request, may carry secrets).
std::string xml_field(const std::string& body, const std::string& tag);

bool transient(CURLcode c);
bool transient_status(long status);  // 5xx, 429, 408
int errno_of_status(long status);
// The errno of a request that failed, for a message: a name DNS does not know is EHOSTUNREACH, not
// the ETIMEDOUT of a server that never answered (status 0 otherwise means it did not).
int errno_of_failure(CURLcode c, long status);
std::string describe(CURLcode c, const Response& r);

// Sleeps before retry `attempt` + 1: exponential backoff with full jitter (a random wait up to
// the bound), so that many workers retrying after one server hiccup do not return in step.
// At least `retry_after` seconds where the server asked for that (capped at 30); returns early
// once `stop` is set.
void backoff(unsigned attempt, const RemoteOptions& options, unsigned retry_after = 0, const std::atomic<bool>* stop = nullptr);

}  // namespace hbmio::remote
