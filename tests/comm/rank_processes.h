// Test support for the collectives: the ranks of a group as forked processes, each with its own
// TcpEndpoint on loopback.
//
// The parent forks every rank before any thread exists in it (construct RankProcesses while the
// test process has no threads of its own). Each child makes its endpoint, sends its address up a
// pipe, reads every rank's address, runs the body and sends its messages up the pipe; it then
// keeps its communicators open until the parent releases it, so that no rank's exit is mistaken
// for a failure by the others.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/comm/tcp_communicator.h"

namespace tessera::comm::testing {

// What a rank's body gets.
struct RankContext {
  int rank = 0;
  int size = 0;
  TcpEndpoint* endpoint = nullptr;
  std::vector<std::string> addresses;                // every rank's endpoint, by rank
  std::vector<std::unique_ptr<Communicator>>* keep;  // open until the parent releases the child
  std::function<void(const std::string&)> say;       // a message to the parent
};

// Returns the child's final message ("ok ..." by convention, anything else is a failure).
using RankBody = std::function<std::string(RankContext&)>;

class RankProcesses {
 public:
  RankProcesses(int n, const RankBody& body) {
    for (int r = 0; r < n; ++r) {
      int up[2];
      int down[2];
      if (::pipe(up) != 0 || ::pipe(down) != 0) std::abort();
      pid_t pid = ::fork();
      if (pid == 0) {
        ::close(up[0]);
        ::close(down[1]);
        for (const Proc& p : procs_) {  // earlier siblings' pipe ends
          ::close(p.up);
          ::close(p.down);
        }
        child(r, n, up[1], down[0], body);
      }
      ::close(up[1]);
      ::close(down[0]);
      procs_.push_back({pid, up[0], down[1]});
    }
    std::string all;
    for (int r = 0; r < n; ++r) {
      std::string address = next_message(r, std::chrono::seconds(30));
      addresses_.push_back(address);
      all += address + "\n";
    }
    for (Proc& p : procs_) write_frame(p.down, all);
  }

  ~RankProcesses() { release(std::chrono::seconds(10)); }

  const std::vector<std::string>& addresses() const { return addresses_; }
  pid_t pid(int r) const { return procs_[r].pid; }

  // The next message of rank r, or "[no message: ...]" when it died or timed out.
  std::string next_message(int r, std::chrono::milliseconds timeout) {
    std::string out;
    uint8_t len[4];
    if (!read_exact(procs_[r].up, len, 4, timeout)) return "[no message: rank exited or timed out]";
    uint32_t n = static_cast<uint32_t>(len[0]) | (static_cast<uint32_t>(len[1]) << 8) |
                 (static_cast<uint32_t>(len[2]) << 16) | (static_cast<uint32_t>(len[3]) << 24);
    out.resize(n);
    if (!read_exact(procs_[r].up, out.data(), n, timeout)) return "[no message: truncated]";
    return out;
  }

  void kill(int r, int sig = SIGKILL) { ::kill(procs_[r].pid, sig); }

  // Lets every child exit; reaps them (SIGKILL after `timeout`). Idempotent.
  void release(std::chrono::milliseconds timeout) {
    for (Proc& p : procs_) {
      if (p.down >= 0) ::close(p.down);
      p.down = -1;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (Proc& p : procs_) {
      if (p.pid <= 0) continue;
      for (;;) {
        int status = 0;
        pid_t got = ::waitpid(p.pid, &status, WNOHANG);
        if (got == p.pid || got < 0) break;
        if (std::chrono::steady_clock::now() > deadline) {
          ::kill(p.pid, SIGKILL);
          ::waitpid(p.pid, &status, 0);
          break;
        }
        ::usleep(5000);
      }
      p.pid = -1;
      if (p.up >= 0) ::close(p.up);
      p.up = -1;
    }
  }

 private:
  struct Proc {
    pid_t pid;
    int up;    // child -> parent messages
    int down;  // parent -> child: the addresses, then EOF = release
  };

  static bool read_exact(int fd, void* data, size_t n, std::chrono::milliseconds timeout) {
    auto* p = static_cast<char*>(data);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (n > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd pfd{fd, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return false;
      ssize_t got = ::read(fd, p, n);
      if (got <= 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }

  static void write_frame(int fd, const std::string& text) {
    std::string frame(4, '\0');
    for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    frame += text;
    const char* p = frame.data();
    size_t n = frame.size();
    while (n > 0) {
      ssize_t w = ::write(fd, p, n);
      if (w <= 0) return;
      p += w;
      n -= static_cast<size_t>(w);
    }
  }

  [[noreturn]] static void child(int rank, int n, int up, int down, const RankBody& body) {
    std::vector<std::unique_ptr<Communicator>> keep;
    {
      auto endpoint = TcpEndpoint::listen("127.0.0.1");
      if (!endpoint) {
        write_frame(up, "!" + endpoint.status().to_string());
        ::_exit(2);
      }
      write_frame(up, (*endpoint)->address());
      RankContext ctx;
      ctx.rank = rank;
      ctx.size = n;
      ctx.endpoint = endpoint->get();
      ctx.keep = &keep;
      ctx.say = [up](const std::string& m) { write_frame(up, m); };
      std::string all;
      uint8_t len[4];
      if (!read_exact(down, len, 4, std::chrono::seconds(60))) ::_exit(2);
      uint32_t bytes = static_cast<uint32_t>(len[0]) | (static_cast<uint32_t>(len[1]) << 8) |
                       (static_cast<uint32_t>(len[2]) << 16) |
                       (static_cast<uint32_t>(len[3]) << 24);
      all.resize(bytes);
      if (!read_exact(down, all.data(), bytes, std::chrono::seconds(60))) ::_exit(2);
      size_t start = 0;
      for (size_t nl = all.find('\n'); nl != std::string::npos; nl = all.find('\n', start)) {
        ctx.addresses.push_back(all.substr(start, nl - start));
        start = nl + 1;
      }
      write_frame(up, body(ctx));
      // Wait for the release (EOF), with the communicators still open.
      char c;
      while (::read(down, &c, 1) > 0) {
      }
      keep.clear();
    }
    ::_exit(0);
  }

  std::vector<Proc> procs_;
  std::vector<std::string> addresses_;
};

}  // namespace tessera::comm::testing
