#include "daemon/object_store.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace tessera {
namespace {

// A segment prefix unique to this process and test, so parallel runs never collide.
std::string unique_prefix() {
  static std::atomic<int> counter{0};
  return "/tessera-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-obj-";
}

bool exists_in_dev_shm(const std::string& name) {
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

// Runs `body` in a forked child. The child writes body's report (empty = success) to a pipe and
// _exits; the parent waits for the pipe to close, with a timeout, then reaps the child.
std::string run_in_child(const std::function<std::string()>& body,
                         std::chrono::milliseconds timeout) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string report = body();
    if (::write(fds[1], report.data(), report.size()) < 0) ::_exit(3);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string report;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fds[0], POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      ::close(fds[0]);
      return report + " [child timed out]";
    }
    char buf[4096];
    ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    report.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) report += " [child died abnormally]";
  return report;
}

class ObjectStoreTest : public ::testing::Test {
 protected:
  std::string prefix_ = unique_prefix();
  ObjectStore store_{ObjectStoreOptions{prefix_, 1 << 20}};
};

TEST_F(ObjectStoreTest, CreateWriteSealThenAnotherProcessReadsTheBytes) {
  auto segment = store_.create("lease-a", "weights.0", 10000);
  ASSERT_TRUE(segment.has_value()) << segment.status().to_string();
  EXPECT_EQ(*segment, prefix_ + "weights.0");
  {  // the creator fills it through its own mapping
    auto mapping = ShmSegment::open(*segment, /*writable=*/true);
    ASSERT_TRUE(mapping.has_value()) << mapping.status().to_string();
    auto* bytes = static_cast<unsigned char*>(mapping->data());
    for (size_t i = 0; i < 10000; ++i) bytes[i] = static_cast<unsigned char>(i * 13 + 1);
  }
  ASSERT_TRUE(store_.seal("lease-a", "weights.0").is_ok());
  // Another lease cannot take it; the creator hands the segment name to its own processes.
  EXPECT_EQ(store_.get("lease-b", "weights.0").status().code(), Code::kPermissionDenied);
  auto ref = store_.get("lease-a", "weights.0");
  ASSERT_TRUE(ref.has_value()) << ref.status().to_string();
  EXPECT_EQ(ref->segment, *segment);
  EXPECT_EQ(ref->size, 10000u);
  std::string report = run_in_child(
      [&]() -> std::string {
        auto mapping = ShmSegment::open(ref->segment, /*writable=*/false);
        if (!mapping) return mapping.status().to_string();
        if (mapping->size() != ref->size) return "size " + std::to_string(mapping->size());
        auto* bytes = static_cast<const unsigned char*>(mapping->data());
        for (size_t i = 0; i < ref->size; ++i) {
          if (bytes[i] != static_cast<unsigned char>(i * 13 + 1))
            return "byte " + std::to_string(i);
        }
        return "";
      },
      std::chrono::seconds(10));
  EXPECT_EQ(report, "");
  EXPECT_TRUE(store_.release("lease-a", "weights.0").is_ok());
}

TEST_F(ObjectStoreTest, IdsOwnersAndSizesAreValidated) {
  for (const std::string& bad : {std::string(), std::string(65, 'a'), std::string("a/b"),
                                 std::string("a b"), std::string("é")}) {
    Expected<std::string> created = store_.create("lease-a", bad, 10);
    EXPECT_EQ(created.status().code(), Code::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(created.status().message().find("object id"), std::string::npos);
  }
  EXPECT_TRUE(store_.create("lease-a", std::string(64, 'a'), 10).has_value());
  EXPECT_TRUE(store_.create("lease-a", "A-z_0.9", 10).has_value());
  EXPECT_EQ(store_.create("lease-a", "zero", 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(store_.create("", "no-owner", 10).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(store_.stats().objects, 2u);
}

TEST_F(ObjectStoreTest, OptionsAreValidated) {
  EXPECT_TRUE(ObjectStore::validate({prefix_, 100}).is_ok());
  EXPECT_EQ(ObjectStore::validate({"no-slash-", 100}).code(), Code::kInvalidArgument);
  EXPECT_EQ(ObjectStore::validate({"/" + std::string(200, 'p'), 100}).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(ObjectStore::validate({prefix_, 0}).code(), Code::kInvalidArgument);
  ObjectStore bad_prefix("/bad/prefix-", 100);
  EXPECT_EQ(bad_prefix.create("lease-a", "x", 10).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(bad_prefix.stats().used, 0u);
}

TEST_F(ObjectStoreTest, DuplicateIdIsAlreadyExists) {
  ASSERT_TRUE(store_.create("lease-a", "x", 10).has_value());
  Status st = store_.create("lease-b", "x", 10).status();
  EXPECT_EQ(st.code(), Code::kAlreadyExists);
  EXPECT_NE(st.message().find("'x'"), std::string::npos);
  EXPECT_EQ(store_.stats().used, 10u);
}

TEST_F(ObjectStoreTest, SealingRules) {
  ASSERT_TRUE(store_.create("lease-a", "x", 10).has_value());
  Status early = store_.get("lease-a", "x").status();
  EXPECT_EQ(early.code(), Code::kFailedPrecondition);
  EXPECT_NE(early.message().find("not sealed yet"), std::string::npos) << early.message();
  EXPECT_EQ(store_.seal("lease-b", "x").code(), Code::kPermissionDenied);
  EXPECT_EQ(store_.seal("lease-a", "nope").code(), Code::kNotFound);
  EXPECT_TRUE(store_.seal("lease-a", "x").is_ok());
  EXPECT_EQ(store_.seal("lease-a", "x").code(), Code::kFailedPrecondition);
  EXPECT_EQ(store_.get("lease-b", "nope").status().code(), Code::kNotFound);
  EXPECT_TRUE(store_.get("lease-a", "x").has_value());
}

TEST_F(ObjectStoreTest, ReferenceCountsGateDeletion) {
  auto segment = store_.create("lease-a", "x", 100);
  ASSERT_TRUE(segment.has_value());
  ASSERT_TRUE(store_.seal("lease-a", "x").is_ok());
  ASSERT_TRUE(store_.get("lease-a", "x").has_value());
  ASSERT_TRUE(store_.get("lease-a", "x").has_value());
  ASSERT_TRUE(store_.get("lease-a", "x").has_value());
  // No other lease may take, release or delete it.
  EXPECT_EQ(store_.get("lease-b", "x").status().code(), Code::kPermissionDenied);
  EXPECT_EQ(store_.release("lease-b", "x").code(), Code::kPermissionDenied);
  Status theirs = store_.remove("lease-b", "x");
  EXPECT_EQ(theirs.code(), Code::kPermissionDenied);
  EXPECT_NE(theirs.message().find("belongs to another lease"), std::string::npos)
      << theirs.message();
  std::vector<ObjectInfo> objects = store_.list();
  ASSERT_EQ(objects.size(), 1u);
  EXPECT_EQ(objects[0].id, "x");
  EXPECT_EQ(objects[0].segment, *segment);
  EXPECT_EQ(objects[0].bytes, 100u);
  EXPECT_EQ(objects[0].refs, 3u);
  EXPECT_TRUE(objects[0].sealed);
  EXPECT_EQ(objects[0].owner, "lease-a");

  Status busy = store_.remove("lease-a", "x");
  EXPECT_EQ(busy.code(), Code::kFailedPrecondition);
  EXPECT_NE(busy.message().find("3 references"), std::string::npos) << busy.message();
  EXPECT_NE(busy.message().find("lease-a: 3"), std::string::npos) << busy.message();
  EXPECT_TRUE(store_.release("lease-a", "x").is_ok());
  EXPECT_TRUE(store_.release("lease-a", "x").is_ok());
  EXPECT_EQ(store_.list()[0].refs, 1u);
  EXPECT_EQ(store_.remove("lease-a", "x").code(), Code::kFailedPrecondition);
  EXPECT_TRUE(store_.release("lease-a", "x").is_ok());
  EXPECT_EQ(store_.release("lease-a", "x").code(), Code::kFailedPrecondition);
  EXPECT_TRUE(exists_in_dev_shm(*segment));
  EXPECT_TRUE(store_.remove("lease-a", "x").is_ok());
  EXPECT_FALSE(exists_in_dev_shm(*segment));
  EXPECT_EQ(store_.remove("lease-a", "x").code(), Code::kNotFound);
  EXPECT_EQ(store_.release("lease-a", "x").code(), Code::kNotFound);
  EXPECT_EQ(store_.stats().used, 0u);
  EXPECT_EQ(store_.stats().objects, 0u);
}

TEST(ObjectStoreCapacityTest, ExceedingCapacityExplainsWhatToDo) {
  ObjectStore store(unique_prefix(), 1000);
  ASSERT_TRUE(store.create("lease-a", "first", 600).has_value());
  Status full = store.create("lease-a", "second", 500).status();
  EXPECT_EQ(full.code(), Code::kResourceExhausted);
  EXPECT_EQ(full.message(),
            "object store full: 'second' needs 500 bytes but only 400 of 1000 bytes are free; "
            "release or delete objects, or start the daemon with a larger "
            "--object-store-memory");
  EXPECT_TRUE(store.create("lease-a", "fits", 400).has_value());  // exactly full is fine
  ObjectStoreStats stats = store.stats();
  EXPECT_EQ(stats.capacity, 1000u);
  EXPECT_EQ(stats.used, 1000u);
  EXPECT_EQ(stats.objects, 2u);
  EXPECT_EQ(store.create("lease-a", "one-more", 1).status().code(), Code::kResourceExhausted);
  ASSERT_TRUE(store.remove("lease-a", "first").is_ok());
  EXPECT_TRUE(store.create("lease-a", "second", 500).has_value());
  EXPECT_EQ(store.stats().used, 900u);
}

TEST(ObjectStoreCapacityTest, EachLeaseAndOtherSegmentsCountToo) {
  ObjectStore store(ObjectStoreOptions{unique_prefix(), 1000, /*owner_capacity_bytes=*/600, 8});
  EXPECT_EQ(store.stats().owner_capacity, 600u);
  ASSERT_TRUE(store.create("lease-a", "a1", 400).has_value());
  // A ring of lease-a counts against lease-a's share and the node's.
  Status over = store.reserve("lease-a", 300, "ring 'steps'");
  EXPECT_EQ(over.code(), Code::kResourceExhausted);
  EXPECT_NE(over.message().find("ring 'steps' needs 300 bytes but lease-a already holds 400 of "
                                "the 600 bytes one lease may hold"),
            std::string::npos)
      << over.message();
  ASSERT_TRUE(store.reserve("lease-a", 200, "ring 'steps'").is_ok());
  EXPECT_EQ(store.stats().used, 600u);
  EXPECT_EQ(store.stats().objects, 2u);
  // lease-b has its own share, bounded by what the node has left.
  EXPECT_EQ(store.create("lease-b", "b1", 500).status().code(), Code::kResourceExhausted);
  ASSERT_TRUE(store.create("lease-b", "b1", 400).has_value());
  store.unreserve("lease-a", 200);
  EXPECT_EQ(store.stats().used, 800u);
  ASSERT_TRUE(store.reserve("lease-a", 200, "ring 'again'").is_ok());
  // The number of segments is capped as well.
  ObjectStore few(ObjectStoreOptions{unique_prefix(), 1000, 0, 2});
  ASSERT_TRUE(few.create("lease-a", "one", 1).has_value());
  ASSERT_TRUE(few.reserve("lease-a", 1, "ring 'r'").is_ok());
  Status third = few.create("lease-a", "three", 1).status();
  EXPECT_EQ(third.code(), Code::kResourceExhausted);
  EXPECT_NE(third.message().find("shared-memory segments"), std::string::npos) << third.message();
}

TEST_F(ObjectStoreTest, ReleaseAllDropsReferencesAndUnsealedObjects) {
  auto kept = store_.create("lease-a", "sealed-by-a", 10);
  auto dropped = store_.create("lease-a", "unsealed-by-a", 20);
  auto other = store_.create("lease-b", "sealed-by-b", 30);
  auto pending = store_.create("lease-b", "unsealed-by-b", 40);
  ASSERT_TRUE(kept && dropped && other && pending);
  ASSERT_TRUE(store_.seal("lease-a", "sealed-by-a").is_ok());
  ASSERT_TRUE(store_.seal("lease-b", "sealed-by-b").is_ok());
  ASSERT_TRUE(store_.get("lease-b", "sealed-by-b").has_value());
  ASSERT_TRUE(store_.get("lease-a", "sealed-by-a").has_value());
  ASSERT_TRUE(store_.get("lease-a", "sealed-by-a").has_value());

  store_.release_all("lease-a");

  std::vector<ObjectInfo> objects = store_.list();
  ASSERT_EQ(objects.size(), 3u);
  EXPECT_EQ(objects[0].id, "sealed-by-a");  // sealed: stays, without a's references
  EXPECT_EQ(objects[0].refs, 0u);
  EXPECT_EQ(objects[1].id, "sealed-by-b");
  EXPECT_EQ(objects[1].refs, 1u);  // lease-b's, untouched
  EXPECT_EQ(objects[2].id, "unsealed-by-b");
  EXPECT_FALSE(exists_in_dev_shm(*dropped));
  EXPECT_TRUE(exists_in_dev_shm(*kept));
  EXPECT_EQ(store_.stats().used, 80u);
  EXPECT_EQ(store_.release("lease-a", "sealed-by-a").code(), Code::kFailedPrecondition);
  store_.release_all("lease-nobody");  // a lease that held nothing: no effect
  EXPECT_EQ(store_.stats().objects, 3u);
}

TEST_F(ObjectStoreTest, SealWaitersFireExactlyOnce) {
  ASSERT_TRUE(store_.create("lease-a", "x", 10).has_value());
  std::vector<Status> fired;
  auto record = [&](Status st) { fired.push_back(std::move(st)); };
  ObjectStore::SealWaiterId first = store_.on_sealed("x", record);
  ObjectStore::SealWaiterId cancelled = store_.on_sealed("x", record);
  EXPECT_NE(first, 0u);
  EXPECT_NE(first, cancelled);
  EXPECT_TRUE(store_.cancel_seal_waiter(cancelled));
  EXPECT_FALSE(store_.cancel_seal_waiter(cancelled));
  // A waiter may call back into the store: the state is already updated.
  Expected<ObjectRef> from_callback = not_found("not called");
  store_.on_sealed("x", [&](Status st) {
    record(st);
    from_callback = store_.get("lease-a", "x");
  });
  EXPECT_TRUE(fired.empty());
  ASSERT_TRUE(store_.seal("lease-a", "x").is_ok());
  ASSERT_EQ(fired.size(), 2u);
  EXPECT_TRUE(fired[0].is_ok());
  EXPECT_TRUE(fired[1].is_ok());
  EXPECT_TRUE(from_callback.has_value()) << from_callback.status().to_string();
  EXPECT_FALSE(store_.cancel_seal_waiter(first));  // already ran

  // Already sealed: runs at once. Unknown: NOT_FOUND at once.
  EXPECT_EQ(store_.on_sealed("x", record), 0u);
  ASSERT_EQ(fired.size(), 3u);
  EXPECT_TRUE(fired[2].is_ok());
  EXPECT_EQ(store_.on_sealed("nope", record), 0u);
  ASSERT_EQ(fired.size(), 4u);
  EXPECT_EQ(fired[3].code(), Code::kNotFound);
}

TEST_F(ObjectStoreTest, SealWaitersLearnWhenTheObjectGoesAway) {
  ASSERT_TRUE(store_.create("lease-a", "removed", 10).has_value());
  ASSERT_TRUE(store_.create("lease-a", "orphaned", 10).has_value());
  std::vector<Status> removed;
  std::vector<Status> orphaned;
  store_.on_sealed("removed", [&](Status st) { removed.push_back(std::move(st)); });
  store_.on_sealed("orphaned", [&](Status st) { orphaned.push_back(std::move(st)); });
  ASSERT_TRUE(store_.remove("lease-a", "removed").is_ok());
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].code(), Code::kNotFound);
  EXPECT_NE(removed[0].message().find("deleted before it was sealed"), std::string::npos);
  store_.release_all("lease-a");
  ASSERT_EQ(orphaned.size(), 1u);
  EXPECT_EQ(orphaned[0].code(), Code::kNotFound);
  EXPECT_NE(orphaned[0].message().find("lease-a ended"), std::string::npos)
      << orphaned[0].message();
  EXPECT_EQ(removed.size(), 1u);  // nothing fires twice
}

TEST(ObjectStoreLifetimeTest, DestructionUnlinksEverySegmentAndEndsWaits) {
  std::vector<std::string> segments;
  std::vector<Status> fired;
  {
    ObjectStore store(unique_prefix(), 1 << 20);
    for (const char* id : {"a", "b", "c"}) {
      auto segment = store.create("lease-a", id, 4096);
      ASSERT_TRUE(segment.has_value()) << segment.status().to_string();
      segments.push_back(*segment);
    }
    ASSERT_TRUE(store.seal("lease-a", "a").is_ok());
    ASSERT_TRUE(store.get("lease-a", "a").has_value());  // held references do not keep it
    store.on_sealed("b", [&](Status st) { fired.push_back(std::move(st)); });
    for (const std::string& name : segments) EXPECT_TRUE(exists_in_dev_shm(name)) << name;
  }
  for (const std::string& name : segments) EXPECT_FALSE(exists_in_dev_shm(name)) << name;
  ASSERT_EQ(fired.size(), 1u);
  EXPECT_EQ(fired[0].code(), Code::kUnavailable);
}

}  // namespace
}  // namespace tessera
