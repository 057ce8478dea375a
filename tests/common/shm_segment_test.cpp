#include "common/shm_segment.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>
#include "tests/common/fork_child.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>

namespace tessera {
namespace {

using testing::Child;
using testing::unique_name;

bool exists_in_dev_shm(const std::string& name) {
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

TEST(ShmSegmentTest, CreateGivesZeroedMemoryThatOpenSees) {
  std::string name = unique_name("create");
  auto seg = ShmSegment::create(name, 10000);
  ASSERT_TRUE(seg.has_value()) << seg.status().to_string();
  EXPECT_TRUE(seg->valid());
  EXPECT_EQ(seg->size(), 10000u);
  EXPECT_EQ(seg->name(), name);
  EXPECT_TRUE(seg->writable());
  EXPECT_TRUE(seg->owns_name());
  auto* bytes = static_cast<unsigned char*>(seg->data());
  for (size_t i = 0; i < seg->size(); ++i) ASSERT_EQ(bytes[i], 0) << i;
  for (size_t i = 0; i < seg->size(); ++i) bytes[i] = static_cast<unsigned char>(i * 7);

  auto view = ShmSegment::open(name, /*writable=*/false);
  ASSERT_TRUE(view.has_value()) << view.status().to_string();
  EXPECT_EQ(view->size(), 10000u);
  EXPECT_FALSE(view->writable());
  EXPECT_FALSE(view->owns_name());
  EXPECT_EQ(std::memcmp(view->data(), seg->data(), seg->size()), 0);
}

TEST(ShmSegmentTest, AnotherProcessSeesTheBytes) {
  std::string name = unique_name("fork");
  auto seg = ShmSegment::create(name, 3 * 4096 + 5);
  ASSERT_TRUE(seg.has_value()) << seg.status().to_string();
  auto* bytes = static_cast<unsigned char*>(seg->data());
  for (size_t i = 0; i < seg->size(); ++i) bytes[i] = static_cast<unsigned char>(i ^ 0x5a);
  Child child([&]() -> std::string {
    auto view = ShmSegment::open(name, false);
    if (!view) return view.status().to_string();
    view->release_ownership();  // (not owned anyway) the child must never unlink
    if (view->size() != 3 * 4096 + 5) return "wrong size " + std::to_string(view->size());
    auto* b = static_cast<const unsigned char*>(view->data());
    for (size_t i = 0; i < view->size(); ++i) {
      if (b[i] != static_cast<unsigned char>(i ^ 0x5a)) return "mismatch at " + std::to_string(i);
    }
    return "";
  });
  EXPECT_EQ(child.wait(std::chrono::seconds(10)), "");
}

TEST(ShmSegmentTest, ReadOnlyMappingFaultsOnWrite) {
  std::string name = unique_name("ro");
  auto seg = ShmSegment::create(name, 4096);
  ASSERT_TRUE(seg.has_value());
  Child child([&]() -> std::string {
    auto view = ShmSegment::open(name, false);
    if (!view) return view.status().to_string();
    rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);  // the fault is expected: no core file
    ::signal(SIGSEGV, SIG_DFL);          // and must kill (sanitizers trap it otherwise)
    ::signal(SIGBUS, SIG_DFL);
    static_cast<volatile char*>(view->data())[0] = 1;  // must fault
    return "write to a read-only mapping did not fault";
  });
  std::string report = child.wait(std::chrono::seconds(10));
  EXPECT_TRUE(WIFSIGNALED(child.last_status())) << report;
  EXPECT_EQ(static_cast<const char*>(seg->data())[0], 0);
}

TEST(ShmSegmentTest, NamesAreValidated) {
  const std::string too_long = "/" + std::string(ShmSegment::kMaxNameLength, 'a');
  for (const std::string& bad :
       {std::string(), std::string("/"), std::string("noslash"), std::string("/a/b"),
        std::string("/a b"), std::string("/x\n"), std::string("/.."), too_long}) {
    Status st = ShmSegment::validate_name(bad);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(st.message().find("segment name"), std::string::npos) << st.message();
    EXPECT_EQ(ShmSegment::create(bad, 4096).status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(ShmSegment::open(bad, false).status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(ShmSegment::unlink(bad).code(), Code::kInvalidArgument) << bad;
  }
  EXPECT_NE(ShmSegment::validate_name("/a/b").message().find("position 2"), std::string::npos);
  EXPECT_NE(ShmSegment::validate_name(too_long).message().find("limit is 255"), std::string::npos);
  for (const char* good : {"/a", "/tessera-s1a2b3c-obj-weights.0", "/A_b.c-9"}) {
    EXPECT_TRUE(ShmSegment::validate_name(good).is_ok()) << good;
  }
  EXPECT_TRUE(
      ShmSegment::validate_name("/" + std::string(ShmSegment::kMaxNameLength - 1, 'a')).is_ok());
}

TEST(ShmSegmentTest, ZeroBytesIsInvalid) {
  std::string name = unique_name("zero");
  EXPECT_EQ(ShmSegment::create(name, 0).status().code(), Code::kInvalidArgument);
  EXPECT_FALSE(exists_in_dev_shm(name));
}

TEST(ShmSegmentTest, CreatingAnExistingNameFailsAndLeavesItAlone) {
  std::string name = unique_name("dup");
  auto first = ShmSegment::create(name, 4096);
  ASSERT_TRUE(first.has_value());
  static_cast<char*>(first->data())[0] = 'x';
  auto second = ShmSegment::create(name, 8192);
  EXPECT_EQ(second.status().code(), Code::kAlreadyExists);
  EXPECT_NE(second.status().message().find(name), std::string::npos);
  auto view = ShmSegment::open(name, false);
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->size(), 4096u);
  EXPECT_EQ(static_cast<const char*>(view->data())[0], 'x');
}

TEST(ShmSegmentTest, MissingSegmentIsNotFound) {
  std::string name = unique_name("missing");
  Status open = ShmSegment::open(name, true).status();
  EXPECT_EQ(open.code(), Code::kNotFound);
  EXPECT_NE(open.message().find(name), std::string::npos);
  EXPECT_EQ(ShmSegment::unlink(name).code(), Code::kNotFound);
}

TEST(ShmSegmentTest, OnlyTheOwnerUnlinksOnDestruction) {
  std::string name = unique_name("owner");
  {
    auto seg = ShmSegment::create(name, 4096);
    ASSERT_TRUE(seg.has_value());
    EXPECT_TRUE(exists_in_dev_shm(name));
    {
      auto view = ShmSegment::open(name, true);
      ASSERT_TRUE(view.has_value());
    }
    EXPECT_TRUE(exists_in_dev_shm(name));  // an opener never unlinks
  }
  EXPECT_FALSE(exists_in_dev_shm(name));
}

TEST(ShmSegmentTest, ReleasedOwnershipKeepsTheName) {
  std::string name = unique_name("release");
  {
    auto seg = ShmSegment::create(name, 4096);
    ASSERT_TRUE(seg.has_value());
    seg->release_ownership();
    EXPECT_FALSE(seg->owns_name());
  }
  EXPECT_TRUE(exists_in_dev_shm(name));
  EXPECT_TRUE(ShmSegment::unlink(name).is_ok());
  EXPECT_FALSE(exists_in_dev_shm(name));
}

TEST(ShmSegmentTest, MovesTransferTheMappingAndOwnership) {
  std::string name = unique_name("move");
  auto created = ShmSegment::create(name, 4096);
  ASSERT_TRUE(created.has_value());
  void* data = created->data();
  ShmSegment a(std::move(*created));
  EXPECT_FALSE(created->valid());
  EXPECT_TRUE(created->name().empty());
  EXPECT_EQ(a.data(), data);
  ShmSegment b;
  EXPECT_FALSE(b.valid());
  b = std::move(a);
  EXPECT_FALSE(a.valid());
  EXPECT_FALSE(a.owns_name());
  EXPECT_EQ(b.data(), data);
  EXPECT_TRUE(b.owns_name());
  { ShmSegment gone(std::move(a)); }  // destroying moved-from objects touches nothing
  EXPECT_TRUE(exists_in_dev_shm(name));
  b = ShmSegment();  // move-assigning over an owner releases it
  EXPECT_FALSE(exists_in_dev_shm(name));
}

TEST(ShmSegmentTest, MoreThanDevShmHoldsIsResourceExhausted) {
  struct statvfs fs {};
  ASSERT_EQ(::statvfs("/dev/shm", &fs), 0);
  if (fs.f_blocks == 0) GTEST_SKIP() << "/dev/shm has no size limit";
  // Larger than the whole file system: tmpfs refuses at once, nothing gets allocated.
  size_t bytes = static_cast<size_t>(fs.f_blocks) * fs.f_frsize + (size_t{1} << 30);
  std::string name = unique_name("huge");
  auto seg = ShmSegment::create(name, bytes);
  EXPECT_EQ(seg.status().code(), Code::kResourceExhausted) << seg.status().to_string();
  EXPECT_NE(seg.status().message().find(name), std::string::npos);
  EXPECT_FALSE(exists_in_dev_shm(name));  // nothing left behind
}

}  // namespace
}  // namespace tessera
