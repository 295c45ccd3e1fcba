// Objects on S3 (s3://bucket/key) and HTTP(S) servers (http://, https://: presigned URLs, web
// servers, Hugging Face "resolve" URLs), read by byte ranges straight into host or GPU memory.
//
// HTTP, TLS and S3's SigV4 signatures are libcurl's (loaded at run time: libcurl.so.4, or
// $HBMIO_CURL_LIBRARY; a machine without it can do everything else). Many ranged GETs run at
// once, each worker on its own connection kept open between requests; a GET into GPU memory lands
// in a few pinned chunks per connection, each copied to the device while the next ones arrive.
//
// S3 the way AWS tools find it: credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
// AWS_SESSION_TOKEN, else the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, default
// ~/.aws/credentials) under AWS_PROFILE (default "default"); the region from AWS_REGION /
// AWS_DEFAULT_REGION, else the config file (AWS_CONFIG_FILE, default ~/.aws/config), else
// us-east-1; AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible servers (path-style
// addressing, as those servers expect); no credentials at all: unsigned requests (public buckets).
//
// Consistency: every GET after the first asks for the version the first one saw (If-Match with
// its ETag) and checks the ETag it gets, so an object replaced during a load is an error, never a
// mix of two versions. Transient failures (5xx, 429, resets, timeouts, short bodies) are retried
// with bounded exponential backoff and full jitter; 403, 404 and other 4xx are reported at once.
// Errors name the URL without its query string (where presigned URLs keep their signatures),
// never credentials.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"

namespace hbmio {

// True for s3://, http:// and https:// (what every path-taking call accepts as a URL).
bool is_remote_url(std::string_view path) noexcept;

// Connections, part sizes, retries and timeouts: RemoteOptions, in hbmio/options.hpp beside the
// other options (a load or save carries them too: LoadOptions::remote, SaveOptions::remote).

struct RemoteRead;
// Told that bytes [at, at + length) of read `read` are in place (see read_remote).
using LandedFunction = std::function<void(std::size_t read, std::uint64_t at, std::uint64_t length)>;

// One object, opened so its size and version are known: a ranged GET of its first byte (not a
// HEAD: a presigned URL is signed for one method, and its GET answers with the object's size in
// Content-Range and its ETag). Thread-safe; reads of one object may run at once.
class RemoteObject {
 public:
  static std::shared_ptr<RemoteObject> open(const std::string& url, const RemoteOptions& options = RemoteOptions::from_env());
  ~RemoteObject();

  const std::string& url() const noexcept;    // as given
  const std::string& shown() const noexcept;  // for messages: no query string, no credentials
  std::uint64_t size() const noexcept;
  const std::string& etag() const noexcept;   // "" when the server sends none
  const std::string& last_modified() const noexcept;  // "" when the server sends none
  const RemoteOptions& options() const noexcept;  // as opened with: what read() uses

  // Bytes [offset, offset + into.size) of the object into any memory. Throws Error.
  void read(std::uint64_t offset, MemorySpan into) const;

  struct State;

 private:
  friend Stats read_remote(std::span<const RemoteRead> reads, const RemoteOptions& options,
                           std::atomic<std::uint64_t>* progress, const LandedFunction& landed);
  explicit RemoteObject(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// A read of a range of one object into memory.
struct RemoteRead {
  const RemoteObject* object = nullptr;
  std::uint64_t offset = 0;
  MemorySpan into{};
};

// Every read at once, cut into parts of options.part_size over options.connections workers (the
// ranges of many objects share them). `landed`, where given, is called as each part is in place
// (GPU copies done) with its read's index and its range within the read, on the worker that
// fetched it while the others go on: a check of the data (hbmio's checksums) runs as it streams
// in, and a throw from it fails the whole call. Returns bytes, seconds and CPU time; throws the
// first failure after the others have stopped.
Stats read_remote(std::span<const RemoteRead> reads, const RemoteOptions& options = RemoteOptions::from_env(),
                  std::atomic<std::uint64_t>* progress = nullptr, const LandedFunction& landed = {});

// Puts the bytes [offset, offset + into.size()) of an object being written into `into` (host
// memory). Called from several threads at once.
using FillFunction = std::function<void(std::uint64_t offset, std::span<std::byte> into)>;

struct UploadOptions {
  bool pinned = false;                        // page-locked part buffers (fills that copy from a GPU)
  std::atomic<std::uint64_t>* progress = nullptr;  // object bytes stored so far
  const std::atomic<bool>* cancel = nullptr;  // once true: stop, abort the upload, throw ECANCELED
};

// Writes an object of `size` bytes at an s3:// URL (HTTP servers take no uploads here: ENOTSUP),
// published whole or not at all. Up to one part (options.part_size; more where an object would
// need over 10,000 parts): one PUT. Larger: a multipart upload whose parts go up on
// options.connections connections at once, each filled by `fill` just before it is sent, and
// retried as reads are; the object appears only when every part is stored
// (CompleteMultipartUpload), and on any failure or stop the upload is aborted, so the key keeps
// its previous object. The part holding offset 0 is filled last (after every other part has been
// taken): a header that depends on the data, such as its checksums, can be computed meanwhile.
// Returns bytes, seconds and CPU time; throws Error naming the URL, the part's range and the attempt.
Stats write_remote(const std::string& url, std::uint64_t size, const FillFunction& fill, const UploadOptions& upload = {},
                   const RemoteOptions& options = RemoteOptions::from_env());

// Deletes the object at an s3:// URL: one DELETE (S3 answers it whether or not the key exists).
// Throws Error naming the URL.
void delete_remote(const std::string& url, const RemoteOptions& options = RemoteOptions::from_env());

// The URL of `name` beside `url` (a sibling key of an S3 object, or a relative reference on the
// same server): how a sharded checkpoint's index names its shards.
std::string remote_sibling(const std::string& url, const std::string& name);

}  // namespace hbmio
