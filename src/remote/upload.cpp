// Objects written to S3: one PUT, or a multipart upload (CreateMultipartUpload, UploadPart on
// many connections, CompleteMultipartUpload; AbortMultipartUpload on any failure), so the key
// holds the old object or the whole new one, never a part of it. Requests are signed by libcurl
// (CURLOPT_AWS_SIGV4) as reads are.
//
// Query strings are written canonically here (parameters sorted, values percent-encoded, "="
// after a name without a value): libcurl before 8.1 signs the query as written, later ones
// canonicalise it themselves, and both then sign what S3 computes.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "hbmio/error.hpp"
#include "hbmio/remote.hpp"
#include "remote/http.hpp"

namespace hbmio {
namespace {

using remote::Response;
using remote::Target;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMaxParts = 10000;             // S3's limit per upload
constexpr std::uint64_t kMinPart = std::uint64_t{5} << 20;  // S3's smallest part but the last

// A request of an upload: method, query (canonical, see above), and body.
struct Call {
  const char* method = "PUT";
  std::string query;                      // without '?'
  std::span<const std::byte> body;        // sent as is
  std::size_t keep = 0;                   // bytes of a 2xx body kept (an XML answer)
  const char* content_type = nullptr;     // a POST body's (libcurl's default is a form's, which servers parse as one)
  // A request the server may work on for minutes, sending only whitespace meanwhile (completing a
  // large multipart upload, as AWS documents): a deadline of kPatientSeconds and no minimum rate.
  bool patient = false;
};
constexpr long kPatientSeconds = 15 * 60;

struct Body {
  std::span<const std::byte> data;
  std::size_t at = 0;
};

std::size_t on_read(char* buffer, std::size_t size, std::size_t n, void* user) {
  auto* body = static_cast<Body*>(user);
  const std::size_t bytes = std::min(size * n, body->data.size() - body->at);
  std::memcpy(buffer, body->data.data() + body->at, bytes);
  body->at += bytes;
  return bytes;
}

struct PartAttempt {
  CURLcode curl = CURLE_OK;
  Response response;
};

PartAttempt perform_once(const Target& target, const RemoteOptions& options, const Call& call, const std::atomic<bool>* stop,
                     const std::atomic<bool>* cancel) {
  const auto& curl = shim::curl_api();
  remote::Handle handle;
  CURL* h = handle.get();
  curl.easy_reset(h);
  PartAttempt a;
  remote::Sink sink{.keep = call.keep, .response = &a.response, .stop = stop, .cancel = cancel};
  Body body{call.body};
  curl_slist* headers = nullptr;
  std::string userpwd, sigv4;
  if (call.content_type != nullptr) headers = curl.slist_append(headers, fmt::format("Content-Type: {}", call.content_type).c_str());
  remote::prepare(h, target, options, sink, headers, userpwd, sigv4, call.body.size());
  // No wait for "100 Continue" before each part's body: S3 reports errors after the body as well.
  // (Removing the Expect header instead would break signatures: libcurl before 8.x signs the
  // empty header it is told to drop.)
  curl.easy_setopt(h, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
  if (call.patient) {
    curl.easy_setopt(h, CURLOPT_TIMEOUT_MS, kPatientSeconds * 1000);
    curl.easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 0L);
  }
  const std::string url = call.query.empty() ? target.request_url : target.request_url + "?" + call.query;
  curl.easy_setopt(h, CURLOPT_URL, url.c_str());
  curl.easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  const std::string_view method = call.method;
  if (method == "PUT") {
    curl.easy_setopt(h, CURLOPT_UPLOAD, 1L);
    curl.easy_setopt(h, CURLOPT_READFUNCTION, &on_read);
    curl.easy_setopt(h, CURLOPT_READDATA, &body);
    curl.easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(call.body.size()));
  } else if (method == "POST") {
    curl.easy_setopt(h, CURLOPT_POST, 1L);
    curl.easy_setopt(h, CURLOPT_POSTFIELDS, call.body.empty() ? "" : reinterpret_cast<const char*>(call.body.data()));
    curl.easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(call.body.size()));
  } else {
    curl.easy_setopt(h, CURLOPT_CUSTOMREQUEST, call.method);
  }
  a.curl = remote::perform(h, headers, a.response);
  return a;
}

// A request with the retry policy of reads: transient failures retried with backoff, others thrown.
// S3 may answer CompleteMultipartUpload with 200 and an <Error> body: that is a failure too.
// `stop` and `cancel` (either may be null): once either is set, the request in flight is cut off
// and no other attempt made.
Response perform(const Target& target, const RemoteOptions& options, const Call& call, const ErrorContext& context,
                 const std::atomic<bool>* stop, const std::atomic<bool>* cancel = nullptr) {
  const unsigned attempts = std::max(1u, options.max_attempts);
  const auto stopped = [&] { return (stop != nullptr && stop->load()) || (cancel != nullptr && cancel->load()); };
  for (unsigned attempt = 1;; ++attempt) {
    if (stopped()) throw Error(errno_code(ECANCELED), context, "stopped before the request");
    PartAttempt a = perform_once(target, options, call, stop, cancel);
    Response& r = a.response;
    const bool error_body = a.curl == CURLE_OK && r.status == 200 && r.body.find("<Error>") != std::string::npos;
    // A request the server carried out stays done, stop or not: the caller must not treat a
    // stored object as one that was not.
    if (a.curl == CURLE_OK && r.status >= 200 && r.status < 300 && !error_body) return std::move(r);
    if (stopped()) throw Error(errno_code(ECANCELED), context, "stopped");
    std::string retry_why;
    if (a.curl == CURLE_OK) {
      if (error_body) {
        retry_why = fmt::format("HTTP 200 with an error: {} {}", remote::xml_field(r.body, "Code"), remote::xml_field(r.body, "Message"));
        if (remote::xml_field(r.body, "Code") != "InternalError" && remote::xml_field(r.body, "Code") != "SlowDown")
          throw Error(errno_code(EIO), context, fmt::format("attempt {} of {}: {}", attempt, attempts, retry_why));
      } else if (remote::transient_status(r.status)) {
        retry_why = remote::describe(a.curl, r);
      } else {
        throw Error(errno_code(remote::errno_of_status(r.status)), context,
                    fmt::format("attempt {} of {}: {}", attempt, attempts, remote::describe(a.curl, r)));
      }
    } else if (remote::transient(a.curl)) {
      retry_why = remote::describe(a.curl, r);
    } else {
      throw Error(errno_code(EIO), context, fmt::format("attempt {} of {}: {}", attempt, attempts, remote::describe(a.curl, r)));
    }
    if (attempt >= attempts)
      throw Error(errno_code(remote::errno_of_failure(a.curl, r.status)), context,
                  fmt::format("attempt {} of {}: {} (gave up)", attempt, attempts, retry_why));
    remote::backoff(attempt, options, r.retry_after);
  }
}

// AWS's URI encoding of a query value: unreserved characters kept, every other byte %XX.
std::string encode_value(std::string_view value) {
  std::string out;
  for (const unsigned char c : value) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') out += static_cast<char>(c);
    else out += fmt::format("%{:02X}", c);
  }
  return out;
}

std::span<const std::byte> bytes_of(const std::string& text) { return {reinterpret_cast<const std::byte*>(text.data()), text.size()}; }

// One part's buffer per worker, reused across its parts.
class PartBuffer {
 public:
  PartBuffer(bool pinned, std::uint64_t size) : pinned_(pinned), size_(size) {}
  std::span<std::byte> get(std::uint64_t length) {
    if (buffer_.size() == 0) buffer_ = Buffer::allocate({pinned_ ? MemoryKind::pinned : MemoryKind::host}, size_);
    return {buffer_.data(), length};
  }

 private:
  bool pinned_;
  std::uint64_t size_;
  Buffer buffer_;
};

// Multipart uploads of the key that are still open although they started before ours: left by
// saves that were killed (SIGKILL, a lost node) before they could abort them. S3 keeps, and bills,
// their parts until they are aborted. Listed while ours is still open (AWS drops an upload from the
// listing once it is completed, and without our own start time a newer upload could not be told
// from an older one), aborted once ours has published (abort_uploads).
struct OpenUpload {
  std::string id, initiated;
};
std::vector<OpenUpload> older_uploads(const Target& target, const RemoteOptions& options, const std::string& own_id) {
  Target bucket = target;
  bucket.request_url = target.bucket_url;
  const ErrorContext context{.op = "list open multipart uploads", .path = target.shown};
  std::vector<OpenUpload> open;
  std::string own_initiated;
  try {
    const Response listing = perform(bucket, options, {.method = "GET", .query = "prefix=" + encode_value(target.key) + "&uploads=", .keep = 1 << 20},
                                     context, nullptr);
    for (std::size_t at = listing.body.find("<Upload>"); at != std::string::npos; at = listing.body.find("<Upload>", at + 8)) {
      const std::size_t end = listing.body.find("</Upload>", at);
      const std::string one = listing.body.substr(at, end == std::string::npos ? std::string::npos : end - at);
      if (remote::xml_field(one, "Key") != target.key) continue;  // a prefix matches longer keys too
      OpenUpload u{remote::xml_field(one, "UploadId"), remote::xml_field(one, "Initiated")};
      if (u.id == own_id) own_initiated = u.initiated;
      else open.push_back(std::move(u));
    }
  } catch (const Error&) {
    return {};  // a listing refused (permissions) leaves cleaning to the bucket's lifecycle rule
  }
  // ISO 8601 times of one server compare as text; one started in the same instant as ours counts
  // as older (the listing cannot order them). Without our own start (a server that does not list
  // open uploads as S3 does), nothing can be told older: nothing is aborted.
  std::erase_if(open, [&](const OpenUpload& u) { return own_initiated.empty() || u.initiated > own_initiated; });
  return open;
}

// Best effort (the save has succeeded whatever happens): a slower concurrent save of the same key
// that started earlier is aborted too and fails cleanly, leaving this newer object. Returns how many.
unsigned abort_uploads(const Target& target, const RemoteOptions& options, const std::vector<OpenUpload>& uploads) {
  unsigned aborted = 0;
  for (const OpenUpload& u : uploads) {
    try {
      perform(target, options, {.method = "DELETE", .query = "uploadId=" + encode_value(u.id)},
              {.op = "abort a multipart upload left by an earlier save", .path = target.shown}, nullptr);
      ++aborted;
    } catch (const Error&) {
    }
  }
  return aborted;
}

}  // namespace

Stats write_remote(const std::string& url, std::uint64_t size, const FillFunction& fill, const UploadOptions& upload,
                   const RemoteOptions& options) {
  const Target target = remote::resolve(url, options);
  const ErrorContext context{.op = "upload", .path = target.shown, .offset = 0, .length = size};
  if (!target.s3) throw Error(errno_code(ENOTSUP), context, "uploads go to s3:// URLs only (an HTTP server takes no writes here)");
  // Parts: the configured size, larger where the object would need more than S3's 10,000, never
  // below S3's 5 MiB minimum; rounded to whole MiB.
  std::uint64_t part = std::max({options.part_size_for(size, RemoteOptions::kLargestUploadPart), kMinPart, (size + kMaxParts - 1) / kMaxParts});
  part = (part + (1u << 20) - 1) / (1u << 20) * (1u << 20);
  const std::uint64_t parts = std::max<std::uint64_t>(1, (size + part - 1) / part);

  Stats stats;
  stats.backend = "remote";
  const Clock::time_point start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  const std::atomic<bool>* cancel = upload.cancel;
  if (parts == 1) {
    PartBuffer buffer(upload.pinned, std::max<std::uint64_t>(size, 1));
    const std::span<std::byte> data = buffer.get(size);
    if (size > 0) fill(0, data);
    perform(target, options, {.method = "PUT", .body = data}, context, cancel);
    if (upload.progress) *upload.progress += size;
  } else {
    const Response created = perform(target, options, {.method = "POST", .query = "uploads=", .keep = 4096},
                                     {.op = "start a multipart upload", .path = target.shown}, cancel);
    const std::string upload_id = remote::xml_field(created.body, "UploadId");
    if (upload_id.empty())
      throw Error(errno_code(EPROTO), {.op = "start a multipart upload", .path = target.shown}, "the answer holds no UploadId");
    const std::string id_query = "uploadId=" + encode_value(upload_id);
    std::vector<std::string> etags(parts);
    unsigned leftovers = 0;
    std::atomic<std::uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr first_error;
    std::mutex error_mutex;
    const auto work = [&] {
      try {
        PartBuffer buffer(upload.pinned, part);
        // Parts 2..N in order, then part 1 (the object's start) last.
        for (std::uint64_t k = next++; k < parts && !failed && !(cancel && cancel->load()); k = next++) {
          const std::uint64_t index = k + 1 < parts ? k + 1 : 0;
          const std::uint64_t offset = index * part;
          const std::uint64_t length = std::min(part, size - offset);
          const std::span<std::byte> data = buffer.get(length);
          fill(offset, data);
          const ErrorContext part_context{.op = fmt::format("upload part {} of {}", index + 1, parts), .path = target.shown,
                                          .offset = offset, .length = length};
          const Response r = perform(target, options,
                                     {.method = "PUT", .query = fmt::format("partNumber={}&{}", index + 1, id_query), .body = data},
                                     part_context, &failed, cancel);
          if (r.etag.empty()) throw Error(errno_code(EPROTO), part_context, "the answer holds no ETag for the part");
          etags[index] = r.etag;
          if (upload.progress) *upload.progress += length;
        }
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    };
    const unsigned workers = static_cast<unsigned>(std::min<std::uint64_t>(std::max(1u, options.connections), parts));
    detail::Executor::shared().run(workers, workers, [&](std::size_t) { work(); });
    if (!first_error && cancel != nullptr && cancel->load())
      first_error = std::make_exception_ptr(Error(errno_code(ECANCELED), context, "stopped: the upload was aborted, the key is as it was"));
    if (!first_error) {
      std::string xml = "<CompleteMultipartUpload>";
      for (std::uint64_t i = 0; i < parts; ++i) xml += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, etags[i]);
      xml += "</CompleteMultipartUpload>";
      try {
        const std::vector<OpenUpload> older = older_uploads(target, options, upload_id);
        const ErrorContext complete{.op = "complete the multipart upload", .path = target.shown};
        const Response done = perform(
            target, options, {.method = "POST", .query = id_query, .body = bytes_of(xml), .keep = 4096, .content_type = "application/xml", .patient = true},
            complete, nullptr);
        // Only this answer says the object was published (a 200 may carry an <Error> after its
        // whitespace, which perform sees, or be cut short).
        if (done.body.find("<CompleteMultipartUploadResult") == std::string::npos)
          throw Error(errno_code(EPROTO), complete, fmt::format("the answer is no CompleteMultipartUploadResult: \"{}\"", done.body.substr(0, 200)));
        leftovers = abort_uploads(target, options, older);
      } catch (...) {
        first_error = std::current_exception();
      }
    }
    if (first_error) {
      // Nothing was published: drop the stored parts (S3 keeps them, and bills them, until then).
      try {
        perform(target, options, {.method = "DELETE", .query = id_query}, {.op = "abort the multipart upload", .path = target.shown},
                nullptr);
      } catch (const Error&) {
        // The first error is the one to report; a bucket lifecycle rule removes what is left.
      }
      std::rethrow_exception(first_error);
    }
    stats.workers = workers;
    if (leftovers > 0) stats.note = fmt::format("; aborted {} multipart upload(s) of this key left by earlier saves", leftovers);
  }
  stats.bytes = size;
  stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  stats.cpu_seconds = process_cpu_seconds() - cpu_start;
  stats.note = (parts == 1 ? std::string("one PUT") : fmt::format("multipart upload: {} parts of up to {}", parts, format_size(part))) + stats.note;
  stats.paths.push_back({.file = target.shown,
                         .path = DataPath::remote,
                         .reason = "an s3:// URL: " + (parts == 1 ? std::string("one PUT") : fmt::format("a multipart upload of {} parts", parts)),
                         .bytes = size});
  return stats;
}

void delete_remote(const std::string& url, const RemoteOptions& options) {
  const Target target = remote::resolve(url, options);
  const ErrorContext context{.op = "delete", .path = target.shown};
  if (!target.s3) throw Error(errno_code(ENOTSUP), context, "deletes go to s3:// URLs only");
  perform(target, options, {.method = "DELETE"}, context, nullptr);
}

}  // namespace hbmio
