#include "daemon/process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace tessera {
namespace {

std::string temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() / (name + std::to_string(::getpid()));
}

TEST(ProcessTest, SpawnSetsEnvironmentLogAndReadyPipe) {
  std::string log = temp_file("tessera-process-log");
  std::filesystem::remove(log);
  ProcessSpec spec;
  spec.binary = "/bin/sh";
  spec.args = {"-c",
               "echo \"job=$TESSERA_JOB home=${HOME:-unset}\"; echo oops >&2; "
               "read -r key <&4; echo \"key=$key\"; printf 'beat' >&5; "
               "printf 'READY 4242\\n' >&3"};
  spec.env = {{"TESSERA_JOB", "e2e"}, {"PATH", "/usr/bin:/bin"}};
  spec.log_path = log;
  spec.secret = "s3cret-key\n";
  auto p = spawn_process(spec);
  ASSERT_TRUE(p) << p.status().to_string();
  char buf[64] = {0};
  ssize_t n = ::read(p->ready_fd, buf, sizeof(buf) - 1);
  EXPECT_EQ(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0), "READY 4242\n");
  ::close(p->ready_fd);
  n = ::read(p->heartbeat_fd, buf, sizeof(buf));
  EXPECT_EQ(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0), "beat");
  ::close(p->heartbeat_fd);
  int status = 0;
  ASSERT_EQ(::waitpid(p->pid, &status, 0), p->pid);
  EXPECT_EQ(describe_wait_status(status), "exited with code 0");
  std::string content = tail_file(log);
  EXPECT_NE(content.find("job=e2e home=unset"), std::string::npos) << content;
  EXPECT_NE(content.find("oops"), std::string::npos) << content;
  EXPECT_NE(content.find("key=s3cret-key"), std::string::npos) << content;
  std::filesystem::remove(log);
}

TEST(ProcessTest, MissingBinaryFailsSynchronously) {
  ProcessSpec spec;
  spec.binary = "/nonexistent/tessera-actor";
  spec.log_path = temp_file("tessera-process-missing");
  auto p = spawn_process(spec);
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), Code::kNotFound);
  EXPECT_NE(p.status().message().find("/nonexistent/tessera-actor"), std::string::npos);
  std::filesystem::remove(spec.log_path);
}

TEST(ProcessTest, TheActorBinaryIsAlwaysTesseraActorInTheBinDir) {
  std::string dir = temp_file("tessera-bin-dir");
  std::filesystem::create_directories(dir);
  auto missing = resolve_actor_binary(dir);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find(dir + "/tessera-actor"), std::string::npos)
      << missing.status().message();
  std::string actor = dir + "/tessera-actor";
  { std::ofstream(actor) << "data"; }
  std::filesystem::permissions(
      actor, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_EQ(resolve_actor_binary(dir).status().code(), Code::kPermissionDenied);
  std::filesystem::permissions(actor, std::filesystem::perms::owner_all);
  auto found = resolve_actor_binary(dir);
  ASSERT_TRUE(found) << found.status().to_string();
  EXPECT_EQ(*found, actor);
  std::filesystem::remove_all(dir);
}

TEST(ProcessTest, TheChildHoldsNoOtherDescriptorOfTheParent) {
  // Descriptors of the parent without close-on-exec (a socket and a file, on numbers far above
  // the rest) stay out of the child: it lists its own descriptors and sees only 0..5, plus the
  // one `ls` opens to list them.
  int sock = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  std::string file = temp_file("tessera-process-inherit");
  int plain = ::open(file.c_str(), O_WRONLY | O_CREAT, 0600);
  ASSERT_GE(plain, 0);
  const int leaked_socket = ::fcntl(sock, F_DUPFD, 300);
  const int leaked_file = ::fcntl(plain, F_DUPFD, 301);
  ASSERT_GE(leaked_socket, 300);
  ASSERT_GE(leaked_file, 301);
  ::close(sock);
  ::close(plain);
  std::string log = temp_file("tessera-process-fds");
  std::filesystem::remove(log);
  ProcessSpec spec;
  spec.binary = "/bin/sh";
  spec.args = {"-c", "ls /proc/self/fd"};
  spec.env = {{"PATH", "/usr/bin:/bin"}};
  spec.log_path = log;
  auto p = spawn_process(spec);
  ASSERT_TRUE(p) << p.status().to_string();
  int status = 0;
  ASSERT_EQ(::waitpid(p->pid, &status, 0), p->pid);
  ::close(p->ready_fd);
  ::close(p->heartbeat_fd);
  const std::string listed_text = tail_file(log);
  std::istringstream listed(listed_text);
  std::vector<int> fds;
  for (std::string name; listed >> name;) fds.push_back(std::atoi(name.c_str()));
  EXPECT_GE(fds.size(), 6u) << listed_text;
  EXPECT_LE(fds.size(), 7u) << listed_text;
  for (int fd : fds) EXPECT_LT(fd, 100) << "the child holds the parent's descriptor " << fd;
  ::close(leaked_socket);
  ::close(leaked_file);
  std::filesystem::remove(file);
  std::filesystem::remove(log);
}

TEST(ProcessTest, DescribesSignalDeaths) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::pause();
    _exit(0);
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_EQ(describe_wait_status(status), "killed by signal 9 (SIGKILL)");
  EXPECT_EQ(wait_term_signal(status), SIGKILL);
  EXPECT_EQ(wait_exit_code(status), -1);
}

}  // namespace
}  // namespace tessera
