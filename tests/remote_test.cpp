// The parts of remote access that need no server: URLs resolved the way the AWS tools resolve
// them, and what messages may show of a URL. (Transfers, retries and faults are tested against
// local servers in python/tests/test_remote.py.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "hbmio/error.hpp"
#include "hbmio/remote.hpp"
#include "remote/http.hpp"
#include "remote/s3_config.hpp"
#include "test_support.hpp"

using namespace hbmio;
using namespace hbmio::test;

namespace {

// Sets environment variables for a scope, and restores them.
class Env {
 public:
  Env(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v) ::setenv(k, v, 1);
      else ::unsetenv(k);
    }
  }
  ~Env() {
    for (const auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace

TEST(Remote, MessagesShowNoQueryAndNoUserInfo) {
  EXPECT_EQ(shown_path("https://h.example/a/b.safetensors?X-Amz-Signature=abc&X-Amz-Credential=k"),
            "https://h.example/a/b.safetensors");
  EXPECT_EQ(shown_path("http://user:pw@h.example:8080/x#frag"), "http://h.example:8080/x");
  EXPECT_EQ(shown_path("s3://bucket/key"), "s3://bucket/key");
  EXPECT_EQ(shown_path("/data/what?.safetensors"), "/data/what?.safetensors");  // a local name is a name
  // A scheme in capitals is a URL all the same; a password may hold '/', '?' or '#' unescaped (AWS
  // secret keys hold '/'); an object key's own '@' is no user info.
  EXPECT_EQ(shown_path("HTTP://user:pw@h/x?X-Amz-Signature=s"), "HTTP://h/x");
  EXPECT_EQ(shown_path("https://user:hun/ter2@h/k"), "https://h/k");
  EXPECT_EQ(shown_path("https://user:hun?ter2@h/k"), "https://h/k");
  EXPECT_EQ(shown_path("https://user:hun#ter2@h/k?sig=1"), "https://h/k");
  EXPECT_EQ(shown_path("s3://bucket/mail@example.com/w.safetensors"), "s3://bucket/mail@example.com/w.safetensors");
  EXPECT_EQ(shown_path("http://localhost:9000/bucket/model@v2.safetensors"), "http://localhost:9000/bucket/model@v2.safetensors");
  EXPECT_EQ(shown_path("http://u:pw@localhost:9000/bucket/model@v2.safetensors?sig=1"), "http://localhost:9000/bucket/model@v2.safetensors");
  // In free text (usage errors quote their arguments), every URL, with the sentence's punctuation kept.
  EXPECT_EQ(without_url_secrets("argument was not expected: http://u:pw@h/k?X-Amz-Signature=S"),
            "argument was not expected: http://h/k");
  EXPECT_EQ(without_url_secrets("(a copy of S3://b/k?sig=S), then 'https://u:p@h/x'."), "(a copy of S3://b/k), then 'https://h/x'.");
  EXPECT_EQ(without_url_secrets("no URL: /data/x?.bin, shttp://y"), "no URL: /data/x?.bin, shttp://y");
  const Error detail(errno_code(EINVAL), {.op = "parse"}, "the value https://u:SECRET@h/x?t=SECRET is not a size");
  EXPECT_EQ(std::string(detail.what()).find("SECRET"), std::string::npos) << detail.what();
  EXPECT_EQ(detail.detail().find("SECRET"), std::string::npos) << detail.detail();
  // Every Error keeps and shows its path that way, whoever built it.
  const Error e(errno_code(EIO), {.op = "GET", .path = "https://u:SECRET@h/x?X-Amz-Signature=SECRET"});
  EXPECT_EQ(e.context().path, "https://h/x");
  EXPECT_EQ(std::string(e.what()).find("SECRET"), std::string::npos) << e.what();
  EXPECT_TRUE(is_remote_url("s3://b/k"));
  EXPECT_TRUE(is_remote_url("https://h/x"));
  EXPECT_FALSE(is_remote_url("/data/s3://x"));
  EXPECT_EQ(remote_sibling("https://h/m/model.safetensors.index.json?sig=1", "model-00001.safetensors"), "https://h/m/model-00001.safetensors");
}

TEST(Remote, A206MustCarryTheRangeAskedFor) {
  const remote::ExpectedRange want{.ranged = true, .first = 100, .last = 199, .total = 1000};
  EXPECT_EQ(remote::range_mismatch("bytes 100-199/1000", want), "");
  EXPECT_EQ(remote::range_mismatch("bytes 100-199/*", want), "");  // the server does not know the size
  EXPECT_NE(remote::range_mismatch("bytes 0-99/1000", want).find("another range"), std::string::npos);
  EXPECT_NE(remote::range_mismatch("bytes 108-207/1000", want).find("another range"), std::string::npos);
  EXPECT_NE(remote::range_mismatch("bytes 100-150/1000", want).find("another range"), std::string::npos);
  EXPECT_NE(remote::range_mismatch("bytes 100-199/2000", want).find("size changed"), std::string::npos);
  EXPECT_NE(remote::range_mismatch("", want).find("not a byte range"), std::string::npos);
  EXPECT_NE(remote::range_mismatch("items 1-2/3", want).find("not a byte range"), std::string::npos);
  // The first GET of an object does not know its size yet: any total is taken.
  EXPECT_EQ(remote::range_mismatch("bytes 0-0/77", {.ranged = true, .first = 0, .last = 0, .total = 0}), "");
}

TEST(Remote, EveryRequestHasADeadlineFromItsSize) {
  const Env env{{"HBMIO_REMOTE_MIN_RATE", "1MiB"}, {"HBMIO_REMOTE_STALL_TIMEOUT", "2"}};
  const RemoteOptions o = RemoteOptions::from_env();
  EXPECT_DOUBLE_EQ(o.deadline_seconds(0), 2.0);
  EXPECT_DOUBLE_EQ(o.deadline_seconds(std::uint64_t{8} << 20), 10.0);
  const Env bad{{"HBMIO_REMOTE_MIN_RATE", "10"}};
  EXPECT_THROW(RemoteOptions::from_env(), Error);
  const Env bad_stall{{"HBMIO_REMOTE_MIN_RATE", nullptr}, {"HBMIO_REMOTE_STALL_TIMEOUT", "soon"}};
  EXPECT_THROW(RemoteOptions::from_env(), Error);
}

TEST(Remote, S3UrlsResolveAsTheAwsToolsDo) {
  TempDir dir;
  const std::string creds = dir.file("credentials"), config = dir.file("config");
  std::ofstream(creds) << "[default]\naws_access_key_id = D\naws_secret_access_key = DS\n\n[p]\n aws_access_key_id = P \naws_secret_access_key=PS\n# c\n";
  std::ofstream(config) << "[default]\nregion = us-west-2\n[profile p]\nregion = ap-south-1\n";
  {
    Env env{{"AWS_ACCESS_KEY_ID", nullptr}, {"AWS_SECRET_ACCESS_KEY", nullptr}, {"AWS_SESSION_TOKEN", nullptr},
            {"AWS_REGION", nullptr}, {"AWS_DEFAULT_REGION", nullptr}, {"AWS_ENDPOINT_URL", nullptr}, {"AWS_ENDPOINT_URL_S3", nullptr},
            {"AWS_SHARED_CREDENTIALS_FILE", creds.c_str()}, {"AWS_CONFIG_FILE", config.c_str()}, {"AWS_PROFILE", nullptr}};
    auto t = remote::resolve("s3://my-bucket/models/a b+c.safetensors", {});
    EXPECT_EQ(t.request_url, "https://my-bucket.s3.us-west-2.amazonaws.com/models/a%20b%2Bc.safetensors");
    EXPECT_EQ(t.shown, "s3://my-bucket/models/a b+c.safetensors");
    ASSERT_TRUE(t.credentials);
    EXPECT_EQ(t.credentials->access_key, "D");
    t = remote::resolve("s3://my-bucket/k", {.profile = "p"});
    EXPECT_EQ(t.region, "ap-south-1");
    EXPECT_EQ(t.credentials->access_key, "P");
    EXPECT_EQ(t.credentials->secret_key, "PS");
    t = remote::resolve("s3://my-bucket/k", {.endpoint = "http://127.0.0.1:9000/", .region = "r1"});
    EXPECT_EQ(t.request_url, "http://127.0.0.1:9000/my-bucket/k");  // path-style for S3-compatible servers
    EXPECT_EQ(t.region, "r1");
  }
  {
    Env env{{"AWS_ACCESS_KEY_ID", "E"}, {"AWS_SECRET_ACCESS_KEY", "ES"}, {"AWS_SESSION_TOKEN", "T"},
            {"AWS_REGION", "eu-north-1"}, {"AWS_ENDPOINT_URL", "https://minio.local"}, {"AWS_ENDPOINT_URL_S3", nullptr},
            {"AWS_SHARED_CREDENTIALS_FILE", creds.c_str()}};
    const auto t = remote::resolve("s3://b-1/x", {});
    EXPECT_EQ(t.credentials->access_key, "E");  // the environment before the file
    EXPECT_EQ(t.credentials->session_token, "T");
    EXPECT_EQ(t.region, "eu-north-1");
    EXPECT_EQ(t.request_url, "https://minio.local/b-1/x");
  }
  {
    Env env{{"AWS_ACCESS_KEY_ID", nullptr}, {"AWS_SECRET_ACCESS_KEY", nullptr}, {"AWS_REGION", nullptr},
            {"AWS_DEFAULT_REGION", nullptr}, {"AWS_SHARED_CREDENTIALS_FILE", dir.file("none").c_str()},
            {"AWS_CONFIG_FILE", dir.file("none").c_str()}, {"AWS_ENDPOINT_URL", nullptr}};
    const auto t = remote::resolve("s3://public/x", {});
    EXPECT_FALSE(t.credentials);  // unsigned requests
    EXPECT_EQ(t.region, "us-east-1");
  }
  for (const char* bad : {"s3://", "s3://bucket", "s3://bucket/", "ftp://h/x", "https://host-only"})
    EXPECT_THROW(remote::resolve(bad, {}), Error) << bad;
}

TEST(Remote, PartSizesAreTwoPerConnectionWithinBounds) {
  constexpr std::uint64_t MiB = 1u << 20;
  RemoteOptions o;  // 16 connections, part size chosen per transfer
  EXPECT_EQ(o.part_size_for(100 * MiB), 8 * MiB);        // small: never below 8 MiB
  EXPECT_EQ(o.part_size_for(1024 * MiB), 32 * MiB);      // 1 GiB / (2 x 16)
  EXPECT_EQ(o.part_size_for(1000 * MiB + 1), 32 * MiB);  // rounded up to whole MiB
  EXPECT_EQ(o.part_size_for(6144 * MiB), 192 * MiB);     // 6 GiB / (2 x 16)
  EXPECT_EQ(o.part_size_for(65536 * MiB), 256 * MiB);    // large reads: never above 256 MiB
  EXPECT_EQ(o.part_size_for(6144 * MiB, RemoteOptions::kLargestUploadPart), 64 * MiB);  // uploads: 64 MiB
  o.connections = 4;
  EXPECT_EQ(o.part_size_for(256 * MiB), 32 * MiB);
  o.part_size = 5 * MiB;  // given: taken as it is
  EXPECT_EQ(o.part_size_for(6144 * MiB), 5 * MiB);
  const Env env{{"HBMIO_REMOTE_PART_SIZE", "4KiB"}, {"HBMIO_REMOTE_CONNECTIONS", nullptr}};
  EXPECT_EQ(RemoteOptions::from_env().part_size, 4096u);
  const Env bad{{"HBMIO_REMOTE_PART_SIZE", "100"}};
  EXPECT_THROW(RemoteOptions::from_env(), Error);
}
