// The parts of remote access that need no server: URLs resolved the way the AWS tools resolve
// them, and what messages may show of a URL. (Transfers, retries and faults are tested against
// local servers in python/tests/test_remote.py.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "hbmio/error.hpp"
#include "hbmio/remote.hpp"
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
  EXPECT_EQ(remote::without_secrets("https://h.example/a/b.safetensors?X-Amz-Signature=abc&X-Amz-Credential=k"),
            "https://h.example/a/b.safetensors");
  EXPECT_EQ(remote::without_secrets("http://user:pw@h.example:8080/x#frag"), "http://h.example:8080/x");
  EXPECT_EQ(remote::without_secrets("s3://bucket/key"), "s3://bucket/key");
  EXPECT_TRUE(is_remote_url("s3://b/k"));
  EXPECT_TRUE(is_remote_url("https://h/x"));
  EXPECT_FALSE(is_remote_url("/data/s3://x"));
  EXPECT_EQ(remote_sibling("https://h/m/model.safetensors.index.json?sig=1", "model-00001.safetensors"), "https://h/m/model-00001.safetensors");
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
