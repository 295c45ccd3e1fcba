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

struct RemoteOptions {
  unsigned connections = 16;                 // GETs in flight (one connection each)
  // Bytes per ranged GET (or uploaded part). 0: chosen per transfer, two parts per connection
  // from 8 MiB up to 256 MiB for reads (large parts cost fewer requests: 6 GiB into an H200 from
  // a local S3 server, 6.5 GiB/s with 64 MiB parts, 7.3 with 193; bench/RESULTS.md; a read's
  // pinned memory does not grow with its parts) and up to 64 MiB for uploads (each part in flight
  // is a buffer of that size); small parts keep every connection busy on a small checkpoint.
  std::size_t part_size = 0;
  unsigned max_attempts = 5;                 // per part, the first included
  double backoff_seconds = 0.2;              // before the first retry; doubles, jittered, up to 10 s
  double connect_timeout_seconds = 10;
  double stall_timeout_seconds = 30;         // a transfer below 1 KiB/s this long is retried
  // The slowest rate a request may average: each request must end within
  // deadline_seconds(its bytes), or it is timed out (ETIMEDOUT) and retried for its missing bytes.
  // A body that trickles just above the stall limit would otherwise hold a load forever.
  double min_rate_bytes_per_second = 256 * 1024;
  std::string endpoint;                      // S3: overrides AWS_ENDPOINT_URL(_S3)
  std::string region;                        // S3: overrides AWS_REGION & co.
  std::string profile;                       // S3: overrides AWS_PROFILE
  // Benchmark support: reads receive every byte and drop it (the destination is not written):
  // what the connections deliver when nothing is done with the data.
  bool discard = false;

  // HBMIO_REMOTE_CONNECTIONS, HBMIO_REMOTE_PART_SIZE ("8MiB"), HBMIO_REMOTE_ATTEMPTS,
  // HBMIO_REMOTE_MIN_RATE ("256KiB", per second), HBMIO_REMOTE_STALL_TIMEOUT (seconds).
  static RemoteOptions from_env();
  // A request of `bytes` must be done within: the stall timeout (first byte, latency) plus its
  // bytes at the minimum rate.
  double deadline_seconds(std::uint64_t bytes) const noexcept {
    return stall_timeout_seconds + static_cast<double>(bytes) / min_rate_bytes_per_second;
  }
  static constexpr std::uint64_t kLargestReadPart = std::uint64_t{256} << 20;
  static constexpr std::uint64_t kLargestUploadPart = std::uint64_t{64} << 20;
  // The part size for a transfer of `bytes` in all: part_size, or where that is 0 the rule above
  // with `largest` as its bound.
  std::uint64_t part_size_for(std::uint64_t bytes, std::uint64_t largest = kLargestReadPart) const noexcept;
};

struct RemoteRead;
// Told that bytes [at, at + length) of read `read` are in place (see read_remote).
using LandedFunction = std::function<void(std::size_t read, std::uint64_t at, std::uint64_t length)>;

// One object, opened (a HEAD, or a one-byte GET where HEAD is refused) so its size and version
// are known. Thread-safe; reads of one object may run at once.
class RemoteObject {
 public:
  static std::shared_ptr<RemoteObject> open(const std::string& url, const RemoteOptions& options = RemoteOptions::from_env());
  ~RemoteObject();

  const std::string& url() const noexcept;    // as given
  const std::string& shown() const noexcept;  // for messages: no query string, no credentials
  std::uint64_t size() const noexcept;
  const std::string& etag() const noexcept;   // "" when the server sends none
  const std::string& last_modified() const noexcept;  // "" when the server sends none

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

// The URL of `name` beside `url` (a sibling key of an S3 object, or a relative reference on the
// same server): how a sharded checkpoint's index names its shards.
std::string remote_sibling(const std::string& url, const std::string& name);

}  // namespace hbmio
