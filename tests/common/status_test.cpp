#include "common/status.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

Expected<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("value must be positive, got " + std::to_string(v));
  return v;
}

Status use_parse(int v, int* out) {
  TESSERA_ASSIGN_OR_RETURN(int x, parse_positive(v));
  *out = x;
  return Status::ok();
}

TEST(StatusTest, OkAndErrorsFormat) {
  EXPECT_TRUE(Status::ok().is_ok());
  Status st = unavailable("cannot reach head at 10.0.0.1:6380");
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), Code::kUnavailable);
  EXPECT_EQ(st.to_string(), "UNAVAILABLE: cannot reach head at 10.0.0.1:6380");
  EXPECT_EQ(st.with_context("tessera status").message(),
            "tessera status: cannot reach head at 10.0.0.1:6380");
}

TEST(StatusTest, ExpectedCarriesValueOrStatus) {
  int out = 0;
  EXPECT_TRUE(use_parse(7, &out).is_ok());
  EXPECT_EQ(out, 7);
  Status st = use_parse(-1, &out);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("got -1"), std::string::npos);
}

TEST(StatusTest, ExpectedFromOkStatusIsAnError) {
  Expected<int> e{Status::ok()};
  EXPECT_FALSE(e.has_value());
  EXPECT_EQ(e.status().code(), Code::kInternal);
}

}  // namespace
}  // namespace tessera
