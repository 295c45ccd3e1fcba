#include "remote/http.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "hbmio/error.hpp"

namespace hbmio::remote {
namespace {

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
    if (h == nullptr) throw Error(errno_code(ENOMEM), {.op = "HTTP request"}, "curl_easy_init failed");
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

}  // namespace

Handle::Handle() : h_(HandlePool::shared().take()) {}
Handle::~Handle() { HandlePool::shared().give_back(h_); }

std::string range_mismatch(const std::string& content_range, const ExpectedRange& expected) {
  // "bytes FIRST-LAST/TOTAL" (RFC 9110 14.4); TOTAL may be "*" (size unknown to the server).
  unsigned long long first = 0, last = 0, total = 0;
  char star = 0;
  const bool with_total = std::sscanf(content_range.c_str(), "bytes %llu-%llu/%llu", &first, &last, &total) == 3;
  const bool without_total = !with_total && std::sscanf(content_range.c_str(), "bytes %llu-%llu/%c", &first, &last, &star) == 3 && star == '*';
  const std::string asked = fmt::format("bytes {}-{} of {}", expected.first, expected.last,
                                        expected.total != 0 ? fmt::format("{}", expected.total) : std::string("the object"));
  if (!with_total && !without_total)
    return fmt::format("the answer's Content-Range '{}' is not a byte range (asked for {})", content_range, asked);
  if (first != expected.first || last != expected.last)
    return fmt::format("the server answered with bytes {}-{} when asked for {}: another range", first, last, asked);
  if (expected.total != 0 && with_total && total != expected.total)
    return fmt::format("the object's size changed during the load ({} bytes, then {}): it was replaced", expected.total, total);
  return {};
}

namespace {

// Whether a body is taken: a 206 must carry the range asked for, and a ranged GET answered 200 is
// the whole object, which is taken only when the range asked for was the whole object (known size).
// Anything else is cut at its first byte: a server that ignores ranges must not make a load
// download a 20 GiB body before it fails.
bool accept_body(Sink& sink, Response& r) {
  if (sink.checked || !sink.expect.ranged) return true;
  if (r.status == 206) {
    r.refused = range_mismatch(r.content_range, sink.expect);
    // A body of another length than its range, or an encoded one (gzip: curl is not asked to
    // decode, so the bytes would be the compressed ones), is not the range: a proxy or server that
    // sends one once would otherwise have its bytes kept as the object's.
    const std::uint64_t range_bytes = sink.expect.last - sink.expect.first + 1;
    if (r.refused.empty() && r.content_length && *r.content_length != range_bytes)
      r.refused = fmt::format("the server's 206 announced a body of {} bytes for the {} bytes of the range {}", *r.content_length,
                              range_bytes, r.content_range);
    if (r.refused.empty() && !r.content_encoding.empty() && r.content_encoding != "identity")
      r.refused = fmt::format("the server sent the range encoded (Content-Encoding: {}), not as the object's bytes", r.content_encoding);
  } else if (r.status == 200) {
    const ExpectedRange& e = sink.expect;
    const bool whole = e.first == 0 && e.total != 0 && e.last + 1 == e.total;
    if (!whole) r.refused = "the server ignored the byte range (HTTP 200 with the whole object): it cannot serve parts of it";
  }
  sink.checked = true;
  return r.refused.empty();
}

}  // namespace

std::size_t on_body(char* ptr, std::size_t size, std::size_t n, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const std::size_t bytes = size * n;
  Response& r = *sink->response;
  if (r.status >= 200 && r.status < 300 && !accept_body(*sink, r)) {
    r.cut = true;
    return 0;  // aborts the transfer before a byte of the wrong range lands anywhere
  }
  if (r.status < 200 || r.status >= 300 || (sink->data == nullptr && !sink->deliver && !sink->discard)) {
    const std::size_t limit = r.status >= 200 && r.status < 300 ? sink->keep : 4096;
    if (r.body.size() >= limit && (r.status < 200 || r.status >= 300)) {
      r.cut = true;  // an error body's start is all a message needs: the rest is not read
      return 0;
    }
    std::string_view piece(ptr, bytes);
    // S3 sends whitespace to keep a CompleteMultipartUpload's connection open while it works:
    // what is kept of a 2xx answer starts at the answer itself, however long that took.
    if (r.body.empty() && r.status >= 200 && r.status < 300)
      while (!piece.empty() && std::isspace(static_cast<unsigned char>(piece.front())) != 0) piece.remove_prefix(1);
    if (r.body.size() < limit) r.body.append(piece.data(), std::min<std::size_t>(piece.size(), limit - r.body.size()));
    return bytes;
  }
  if (r.received + bytes > sink->capacity) {
    r.overflow = true;
    return 0;  // aborts the transfer: the server sent more than the range
  }
  if (sink->deliver) {
    try {
      sink->deliver(r.received, reinterpret_cast<const std::byte*>(ptr), bytes);
    } catch (...) {  // no exception may cross libcurl's C frames
      sink->error = std::current_exception();
      return 0;
    }
  } else if (sink->data != nullptr) {
    std::memcpy(sink->data + r.received, ptr, bytes);
  }
  r.received += bytes;
  return bytes;
}

namespace {

// A header's value as a whole decimal number; nullopt for anything else.
template <typename T>
std::optional<T> number_of(std::string_view value) {
  T n{};
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), n);
  return error == std::errc() && end == value.data() + value.size() ? std::optional<T>(n) : std::nullopt;
}

}  // namespace

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
  else if (name == "last-modified") r->last_modified = value;
  else if (name == "content-range") r->content_range = value;
  else if (name == "content-encoding") r->content_encoding = value;
  else if (name == "location") r->location = value;
  else if (name == "retry-after") r->retry_after = number_of<unsigned>(value).value_or(0);  // (an HTTP date: ignored)
  else if (name == "content-length") r->content_length = number_of<std::uint64_t>(value);
  return bytes;
}

int on_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  const auto* sink = static_cast<const Sink*>(user);
  const auto set = [](const std::atomic<bool>* flag) { return flag != nullptr && flag->load(std::memory_order_relaxed); };
  return set(sink->stop) || set(sink->cancel) ? 1 : 0;
}

void prepare(CURL* h, const Target& target, const RemoteOptions& options, Sink& sink, curl_slist*& headers, std::string& userpwd,
             std::string& sigv4, std::uint64_t bytes) {
  const auto& curl = shim::curl_api();
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
    // Redirects stay on HTTP(S), and an https:// URL on HTTPS (libcurl would follow FTP, or drop
    // to plain HTTP). An older libcurl without the option keeps its default.
    curl.easy_setopt(h, CURLOPT_REDIR_PROTOCOLS_STR, target.request_url.starts_with("https://") ? "https" : "http,https");
  }
  curl.easy_setopt(h, CURLOPT_WRITEFUNCTION, &on_body);
  curl.easy_setopt(h, CURLOPT_WRITEDATA, &sink);
  curl.easy_setopt(h, CURLOPT_HEADERFUNCTION, &on_header);
  curl.easy_setopt(h, CURLOPT_HEADERDATA, sink.response);
  curl.easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  // Bigger receive buffers: fewer callbacks and copies per part (libcurl's default is 16 KiB).
  curl.easy_setopt(h, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl.easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options.connect_timeout_seconds * 1000));
  curl.easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl.easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max(1.0, options.stall_timeout_seconds)));
  // A body that trickles just above the stall limit would otherwise never end: every request has
  // a deadline from its size and the minimum rate.
  curl.easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(options.deadline_seconds(bytes) * 1000));
  curl.easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl.easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &on_progress);
  curl.easy_setopt(h, CURLOPT_XFERINFODATA, &sink);
  curl.easy_setopt(h, CURLOPT_ACCEPT_ENCODING, nullptr);  // bytes as stored: a range of a compressed body is another range
}

// Keeps Code and Message of an S3 error body, and drops the rest.
void keep_error_fields(Response& r) {
  r.error_code = xml_field(r.body, "Code");
  r.error_message = xml_field(r.body, "Message");
  if (r.status < 200 || r.status >= 300) r.body.clear();
}

CURLcode perform(CURL* h, curl_slist* headers, Response& response) {
  const auto& curl = shim::curl_api();
  CURLcode result = curl.easy_perform(h);
  if (result == CURLE_WRITE_ERROR && response.cut) result = CURLE_OK;  // we stopped reading: the status says the rest
  if (response.status == 0) {
    long code = 0;
    curl.easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    response.status = code;
  }
  if (result == CURLE_COULDNT_RESOLVE_HOST) {
    // The host of the URL asked for: "scheme://[user@]host[:port]/...". The URL's secrets stay out.
    char* url = nullptr;
    curl.easy_getinfo(h, CURLINFO_EFFECTIVE_URL, &url);
    std::string_view rest = url != nullptr ? std::string_view(url) : std::string_view();
    if (const auto scheme = rest.find("://"); scheme != std::string_view::npos) rest.remove_prefix(scheme + 3);
    rest = rest.substr(0, rest.find_first_of("/?#"));
    if (const auto at = rest.rfind('@'); at != std::string_view::npos) rest.remove_prefix(at + 1);
    response.unresolved_host = std::string(rest.substr(0, rest.starts_with('[') ? rest.find(']') + 1 : rest.find(':')));
  }
  curl.slist_free_all(headers);
  keep_error_fields(response);
  return result;
}

std::string xml_field(const std::string& body, const std::string& tag) {
  const std::size_t a = body.find("<" + tag + ">");
  if (a == std::string::npos) return {};
  const std::size_t start = a + tag.size() + 2;
  const std::size_t b = body.find("</" + tag + ">", start);
  return b == std::string::npos ? std::string() : body.substr(start, std::min<std::size_t>(b - start, 200));
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

bool transient_status(long status) { return status >= 500 || status == 429 || status == 408; }

int errno_of_status(long status) {
  if (status == 404) return ENOENT;
  if (status == 401 || status == 403) return EACCES;
  if (status == 412) return ESTALE;
  if (status == 408 || status == 504) return ETIMEDOUT;
  return EIO;
}

int errno_of_failure(CURLcode c, long status) {
  if (c == CURLE_COULDNT_RESOLVE_HOST) return EHOSTUNREACH;
  if (c == CURLE_OPERATION_TIMEDOUT) return ETIMEDOUT;
  if (status != 0) return errno_of_status(status);
  // No answer: say which way it failed (the message gives libcurl's words too).
  if (c == CURLE_COULDNT_CONNECT) return ECONNREFUSED;
  if (c == CURLE_GOT_NOTHING || c == CURLE_RECV_ERROR || c == CURLE_SEND_ERROR || c == CURLE_PARTIAL_FILE) return ECONNRESET;
  return ETIMEDOUT;
}

namespace {

// Where a redirect pointed, as a message may show it: a Location may be relative or of any scheme,
// and carry a presigned query or user info as any URL may.
std::string shown_location(std::string_view location) {
  const std::size_t scheme = location.find("://");
  const bool absolute = scheme != std::string_view::npos && scheme > 0 &&
                        std::all_of(location.begin(), location.begin() + static_cast<std::ptrdiff_t>(scheme),
                                    [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.'; });
  if (!absolute) return std::string(location.substr(0, location.find_first_of("?#")));
  // shown_path's rules for the part after the scheme (it knows s3 and http(s) only).
  return std::string(location.substr(0, scheme)) + shown_path("http" + std::string(location.substr(scheme))).substr(4);
}

}  // namespace

std::string describe(CURLcode c, const Response& r) {
  // libcurl says "Couldn't resolve host name" without the name; the name is what is to be checked.
  if (c == CURLE_COULDNT_RESOLVE_HOST)
    return r.unresolved_host.empty() ? std::string("could not resolve the host name")
                                     : fmt::format("could not resolve host {}", r.unresolved_host);
  std::string s = c != CURLE_OK && c != CURLE_WRITE_ERROR ? shim::curl_api().easy_strerror(c) : fmt::format("HTTP {}", r.status);
  if (!r.error_code.empty()) s += " " + r.error_code;
  if (!r.error_message.empty()) s += ": " + r.error_message;
  // A redirect not followed (a signed request is not sent on to another host): where it pointed,
  // which for S3 is the bucket's region's endpoint (S3's PermanentRedirect names it too).
  if (r.status >= 300 && r.status < 400 && !r.location.empty())
    s += fmt::format(" (the server redirected to {}; credentials are never sent on to another host: for S3, set AWS_REGION or "
                     "AWS_ENDPOINT_URL to the bucket's)",
                     shown_location(r.location));
  return s;
}

void backoff(unsigned attempt, const RemoteOptions& options, unsigned retry_after, const std::atomic<bool>* stop) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const double bound = std::min(10.0, options.backoff_seconds * static_cast<double>(1u << std::min(attempt - 1, 16u)));
  std::uniform_real_distribution<double> jitter(0, bound);
  // A server that says when to come back (S3's SlowDown) is not asked again sooner.
  const double wait = std::max(jitter(rng), static_cast<double>(std::min(retry_after, 30u)));
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(wait));
  while (std::chrono::steady_clock::now() < until && !(stop != nullptr && stop->load()))
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), until - std::chrono::steady_clock::now()));
}

}  // namespace hbmio::remote
