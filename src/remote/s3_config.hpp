// Where a URL is fetched from and how requests to it are signed: S3 URLs resolved to an HTTP(S)
// endpoint with the AWS tools' rules for credentials, region and endpoint; http(s) URLs as given.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "hbmio/remote.hpp"

namespace hbmio::remote {

struct Credentials {
  std::string access_key, secret_key, session_token;
};

struct Target {
  std::string request_url;  // what is fetched (S3: the endpoint's URL of the object)
  std::string shown;        // for messages: s3://bucket/key, or the URL without query or user info
  bool s3 = false;
  std::string bucket_url, key;             // S3 only: the bucket's URL (for bucket-level requests) and the key
  std::string region;                      // S3 only
  std::optional<Credentials> credentials;  // S3 with credentials: SigV4-signed requests
};

// Throws Error(EINVAL) for a URL that is not s3://bucket/key or http(s)://host/...
Target resolve(const std::string& url, const RemoteOptions& options);

// An INI file as the AWS tools write them: {section: {key: value}} (keys lower-cased; comments
// and blank lines skipped). Empty when the file does not exist.
std::map<std::string, std::map<std::string, std::string>> read_ini(const std::string& path);

// Percent-encoding of an S3 key for a URL path: everything but unreserved characters and '/'.
std::string encode_key(std::string_view key);

}  // namespace hbmio::remote
