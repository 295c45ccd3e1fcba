#include "remote/s3_config.hpp"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <fstream>

#include <fmt/format.h>

#include "hbmio/error.hpp"

namespace hbmio::remote {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string home_file(const char* variable, const char* relative) {
  if (std::string v = env(variable); !v.empty()) return v;
  const std::string home = env("HOME");
  return home.empty() ? std::string() : home + "/" + relative;
}

std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

Error bad_url(const std::string& url, const std::string& why) {
  return Error(errno_code(EINVAL), {.op = "open URL", .path = shown_path(url)}, why);
}

}  // namespace

std::map<std::string, std::map<std::string, std::string>> read_ini(const std::string& path) {
  std::map<std::string, std::map<std::string, std::string>> out;
  std::ifstream in(path);
  std::string line, section;
  while (std::getline(in, line)) {
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[' && t.back() == ']') {
      section = trim(std::string_view(t).substr(1, t.size() - 2));
      continue;
    }
    const std::size_t eq = t.find('=');
    if (eq == std::string::npos) continue;
    std::string key = trim(std::string_view(t).substr(0, eq));
    for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    out[section][key] = trim(std::string_view(t).substr(eq + 1));
  }
  return out;
}

std::string encode_key(std::string_view key) {
  std::string out;
  for (const unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || c == '/') out += static_cast<char>(c);
    else out += fmt::format("%{:02X}", c);
  }
  return out;
}

Target resolve(const std::string& url, const RemoteOptions& options) {
  Target t;
  if (url.starts_with("http://") || url.starts_with("https://")) {
    t.request_url = url;
    t.shown = shown_path(url);
    if (url.find('/', url.find("://") + 3) == std::string::npos) throw bad_url(url, "the URL names no object (no path after the host)");
    return t;
  }
  if (!url.starts_with("s3://")) throw bad_url(url, "not an s3://, http:// or https:// URL");
  const std::string rest = url.substr(5);
  const std::size_t slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash);
  const std::string key = slash == std::string::npos ? std::string() : rest.substr(slash + 1);
  if (bucket.empty() || key.empty()) throw bad_url(url, "an S3 URL is s3://BUCKET/KEY");
  t.s3 = true;
  t.shown = "s3://" + bucket + "/" + key;
  t.key = key;

  const std::string profile = !options.profile.empty() ? options.profile : !env("AWS_PROFILE").empty() ? env("AWS_PROFILE") : "default";
  // The region: the option, the environment, the config file's profile, then AWS's default.
  t.region = options.region;
  if (t.region.empty()) t.region = env("AWS_REGION");
  if (t.region.empty()) t.region = env("AWS_DEFAULT_REGION");
  if (t.region.empty()) {
    const auto config = read_ini(home_file("AWS_CONFIG_FILE", ".aws/config"));
    for (const std::string& section : {profile == "default" ? std::string("default") : "profile " + profile, profile})
      if (auto it = config.find(section); it != config.end() && it->second.contains("region")) {
        t.region = it->second.at("region");
        break;
      }
  }
  if (t.region.empty()) t.region = "us-east-1";
  // Credentials: the environment, else the shared credentials file; none: unsigned requests.
  if (!env("AWS_ACCESS_KEY_ID").empty() && !env("AWS_SECRET_ACCESS_KEY").empty()) {
    t.credentials = Credentials{env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"), env("AWS_SESSION_TOKEN")};
  } else {
    const auto file = read_ini(home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"));
    if (auto it = file.find(profile); it != file.end() && it->second.contains("aws_access_key_id") &&
                                      it->second.contains("aws_secret_access_key")) {
      const auto& s = it->second;
      t.credentials = Credentials{s.at("aws_access_key_id"), s.at("aws_secret_access_key"),
                                  s.contains("aws_session_token") ? s.at("aws_session_token") : std::string()};
    }
  }
  // The endpoint: S3-compatible servers take path-style URLs; AWS itself virtual-hosted ones.
  std::string endpoint = options.endpoint;
  if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL");
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  if (!endpoint.empty()) {
    if (!endpoint.starts_with("http://") && !endpoint.starts_with("https://"))
      throw bad_url(url, fmt::format("the S3 endpoint '{}' is not an http:// or https:// URL", shown_path(endpoint)));
    t.bucket_url = endpoint + "/" + bucket;
    t.request_url = t.bucket_url + "/" + encode_key(key);
  } else {
    t.bucket_url = fmt::format("https://{}.s3.{}.amazonaws.com", bucket, t.region);
    t.request_url = t.bucket_url + "/" + encode_key(key);
  }
  return t;
}

}  // namespace hbmio::remote
