// The cluster token's size rule, wherever a token is read: a file, the environment, the checks.
#include "protocol/auth.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace tessera::auth {
namespace {

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-auth-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& content) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    ::chmod(path.c_str(), 0600);
    return path;
  }
  std::string dir_;
};

TEST(SecretRuleTest, SixteenToTenTwentyFourPrintableCharacters) {
  EXPECT_FALSE(check_secret(std::string(15, 'a'), "test"));
  EXPECT_TRUE(check_secret(std::string(kMinSecretLength, 'a'), "test"));
  EXPECT_TRUE(check_secret(std::string(kMaxSecretLength, 'a'), "test"));
  auto long_one = check_secret(std::string(kMaxSecretLength + 1, 'a'), "$TESSERA_CLUSTER_TOKEN");
  ASSERT_FALSE(long_one);
  EXPECT_EQ(long_one.status().code(), Code::kInvalidArgument);
  EXPECT_NE(long_one.status().message().find(
                "the cluster token from $TESSERA_CLUSTER_TOKEN has 1025 characters; a token has "
                "16 to 1024"),
            std::string::npos)
      << long_one.status().message();
  // White space around it does not count; inside it is refused.
  auto padded = check_secret("  " + std::string(20, 'b') + "\n", "test");
  ASSERT_TRUE(padded);
  EXPECT_EQ(*padded, std::string(20, 'b'));
  EXPECT_FALSE(check_secret(std::string(10, 'c') + " " + std::string(10, 'c'), "test"));
  EXPECT_TRUE(make_secret() && check_secret(*make_secret(), "make_secret()"));
}

TEST_F(TokenFileTest, AFileIsReadWholeOrRefusedNeverCut) {
  const std::string token(64, 't');
  auto ok = read_token_file(write("ok", token + "\n"));
  ASSERT_TRUE(ok) << ok.status().to_string();
  EXPECT_EQ(*ok, token);
  // 10 MB whose first 4 KiB look like a token: refused, naming the file and the rule.
  std::string huge(10 << 20, 'x');
  const std::string big = write("big", huge);
  auto refused = read_token_file(big);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.status().code(), Code::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("the cluster token file " + big +
                                            " has 10485760 "
                                            "bytes; a token has 16 to 1024 characters"),
            std::string::npos)
      << refused.status().message();
  // Just over the rule, with no white space to trim: refused, not cut to 1024.
  auto over = read_token_file(write("over", std::string(kMaxSecretLength + 1, 'y')));
  ASSERT_FALSE(over);
  EXPECT_NE(over.status().message().find("has 1025 characters"), std::string::npos)
      << over.status().message();
  // The environment follows the same rule.
  ::setenv(kTokenEnv, std::string(100 << 10, 'e').c_str(), 1);
  auto env = resolve_cluster_token("", "");
  ::unsetenv(kTokenEnv);
  ASSERT_FALSE(env);
  EXPECT_NE(env.status().message().find("$TESSERA_CLUSTER_TOKEN has 102400 characters"),
            std::string::npos)
      << env.status().message();
}

}  // namespace
}  // namespace tessera::auth
