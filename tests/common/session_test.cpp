// The session folders: a private temp root, daemon records that know their process, and the
// clean-up of what dead processes left behind (and nothing else).
#include "common/session.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/shm_segment.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir() {
  char tmpl[] = "/tmp/tessera-session-test-XXXXXX";
  return ::mkdtemp(tmpl);
}

// A pid that is certainly not running: a child that has exited and been reaped.
int dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) _exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

void write_owner(const std::string& dir, int pid, uint64_t start) {
  fs::create_directories(dir);
  std::ofstream(dir + "/owner") << pid << " " << start << "\n";
}

TEST(SessionTest, RootIsCreatedPrivateAndForeignOrOpenRootsAreRefused) {
  std::string base = fresh_dir();
  auto root = open_root(base + "/root");
  ASSERT_TRUE(root) << root.status().to_string();
  struct stat st {};
  ASSERT_EQ(::stat(root->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  // Writable by others: refused, with the fix.
  ::chmod(root->c_str(), 0777);
  auto open = open_root(*root);
  ASSERT_FALSE(open);
  EXPECT_EQ(open.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(open.status().message().find("chmod 700"), std::string::npos)
      << open.status().message();
  // A symlink planted where the root should be: refused.
  fs::create_directory_symlink(*root, base + "/link");
  auto link = open_root(base + "/link");
  ASSERT_FALSE(link);
  EXPECT_NE(link.status().message().find("symlink"), std::string::npos) << link.status().message();
  fs::remove_all(base);
}

TEST(SessionTest, RecordsNameTheirProcessAndStaleOnesDisappear) {
  std::string root = fresh_dir();
  auto session = create_session_dir(root);
  ASSERT_TRUE(session) << session.status().to_string();
  EXPECT_TRUE(fs::is_directory(*session + "/logs"));
  EXPECT_TRUE(fs::is_symlink(root + "/session_latest"));
  DaemonRecord mine;
  mine.pid = ::getpid();
  mine.start_time = process_start_time(mine.pid);
  mine.address = "127.0.0.1:6380";
  mine.role = "head";
  mine.node_id = "n-live";
  mine.session_dir = *session;
  ASSERT_TRUE(write_daemon_record(mine).is_ok());
  // A record whose pid was reused by another process (same pid, other start time) is stale.
  fs::create_directories(root + "/session_reused/logs");
  DaemonRecord reused = mine;
  reused.start_time = mine.start_time + 12345;
  reused.node_id = "n-reused";
  reused.session_dir = root + "/session_reused";
  ASSERT_TRUE(write_daemon_record(reused).is_ok());
  auto records = read_daemon_records(root);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].node_id, "n-live");
  EXPECT_EQ(records[0].start_time, mine.start_time);
  EXPECT_FALSE(fs::exists(reused.session_dir + "/daemon.json"));
  EXPECT_TRUE(same_process(::getpid(), mine.start_time));
  EXPECT_FALSE(same_process(::getpid(), mine.start_time + 1));
  EXPECT_FALSE(pid_running(dead_pid()));
  EXPECT_NE(process_command_line(::getpid()).find("common_test"), std::string::npos);
  fs::remove_all(root);
}

TEST(SessionTest, CleanupRemovesOnlyWhatDeadProcessesLeft) {
  std::string root = fresh_dir();
  const int self = ::getpid();
  const uint64_t self_start = process_start_time(self);
  const int gone = dead_pid();
  const std::string tag = std::to_string(self) + "x" + std::to_string(::time(nullptr));
  // Segments: a dead daemon's, a live one's (ours), and one whose pid now belongs to us but
  // started at another time (a reused pid).
  std::string dead_seg = "/tessera-" + std::to_string(gone) + "-777-obj-" + tag;
  std::string live_seg = shm_prefix_for_this_process() + "obj-" + tag;
  std::string reused_seg =
      "/tessera-" + std::to_string(self) + "-" + std::to_string(self_start + 1) + "-ring-" + tag;
  for (const auto& name : {dead_seg, live_seg, reused_seg}) {
    auto seg = ShmSegment::create(name, 8192);
    ASSERT_TRUE(seg) << seg.status().to_string();
    seg->release_ownership();
  }
  // Sessions: two dead (the newer stays, for its logs) and a live one.
  write_owner(root + "/session_old", gone, 1);
  write_owner(root + "/session_newer", gone, 2);
  fs::last_write_time(root + "/session_old",
                      fs::file_time_type::clock::now() - std::chrono::hours(2));
  write_owner(root + "/session_live", self, self_start);
  // Local-node folders: one whose driver died, one whose driver runs.
  write_owner(root + "/local-dead", gone, 3);
  write_owner(root + "/local-live", self, self_start);

  CleanupReport report = cleanup_stale(root);
  EXPECT_FALSE(fs::exists("/dev/shm" + dead_seg));
  EXPECT_FALSE(fs::exists("/dev/shm" + reused_seg));
  EXPECT_TRUE(fs::exists("/dev/shm" + live_seg));
  EXPECT_GE(report.segments, 2u);
  EXPECT_FALSE(fs::exists(root + "/session_old"));
  EXPECT_TRUE(fs::exists(root + "/session_newer"));
  EXPECT_TRUE(fs::exists(root + "/session_live"));
  EXPECT_EQ(report.sessions, 1u);
  EXPECT_FALSE(fs::exists(root + "/local-dead"));
  EXPECT_TRUE(fs::exists(root + "/local-live"));
  EXPECT_EQ(report.local_dirs, 1u);
  ASSERT_FALSE(report.lines.empty());
  EXPECT_NE(report.lines[0].find("shared-memory segment"), std::string::npos) << report.lines[0];
  ASSERT_TRUE(ShmSegment::unlink(live_seg).is_ok());
  fs::remove_all(root);
}

TEST(SessionTest, SecretFilesArePrivate) {
  std::string root = fresh_dir();
  std::string path = cluster_token_path(root);
  ASSERT_TRUE(write_secret_file(path, "0123456789abcdef0123").is_ok());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(is_loopback_host("127.0.0.1"));
  EXPECT_TRUE(is_loopback_host("::1"));
  EXPECT_FALSE(is_loopback_host("10.0.0.1"));
  EXPECT_FALSE(is_loopback_host("0.0.0.0"));
  fs::remove_all(root);
}

}  // namespace
}  // namespace tessera
