// Small POSIX TCP helpers for the cpu backend's collectives (actors/comm/tcp_communicator.h):
// an owning descriptor, "host:port" parsing, listening and connecting sockets, and exact reads
// and writes bounded by a deadline and interruptible through a cancel descriptor.
//
// Internal to actors/comm. Every socket made here is non-blocking and close-on-exec; writes use
// MSG_NOSIGNAL (a closed peer is an error, never SIGPIPE). Nothing here throws or logs.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace tessera::comm::net {

using Clock = std::chrono::steady_clock;

// Owns one file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;  // without brackets ("::1", "10.0.0.2", "node-3")
  uint16_t port = 0;
};

// "10.0.0.2:41022", "node-3:41022", "[::1]:41022". INVALID_ARGUMENT naming `address` otherwise.
Expected<HostPort> split_host_port(const std::string& address);
// The inverse: brackets around an IPv6 host.
std::string join_host_port(const std::string& host, uint16_t port);

// A listening socket on host:port (port 0: the kernel picks one). UNAVAILABLE naming the address
// when it cannot bind.
Expected<Fd> listen_tcp(const std::string& host, uint16_t port, int backlog);
// The port a bound socket got.
Expected<uint16_t> local_port(int fd);
// "10.0.0.7:53122": the other end of a connected socket ("?" when unknown).
std::string peer_address(int fd);

// now + timeout, saturating instead of overflowing (a timeout of milliseconds::max() is "never").
Clock::time_point deadline_after(std::chrono::milliseconds timeout);

// An eventfd that wakes every wait_fd() given it once signal() is called; stays signalled.
class Canceller {
 public:
  Canceller();  // valid() is false when the kernel gave no eventfd (out of descriptors)
  bool valid() const { return fd_.valid(); }
  void signal();
  int fd() const { return fd_.get(); }

 private:
  Fd fd_;
};

enum class WaitResult { kReady, kTimeout, kCancelled };
// Waits until `fd` has one of `events` (POLLIN / POLLOUT; errors and hang-ups count as ready),
// `deadline` passes, or `cancel_fd` (-1: none) becomes readable.
WaitResult wait_fd(int fd, short events, Clock::time_point deadline, int cancel_fd);

// Connects to address ("host:port"), resolving the host, trying each of its addresses.
// UNAVAILABLE with the system's reason ("connection refused") on failure; DEADLINE_EXCEEDED or
// CANCELLED-as-UNAVAILABLE ("cancelled") when the wait ends first. The socket has TCP_NODELAY.
Expected<Fd> connect_tcp(const std::string& address, Clock::time_point deadline, int cancel_fd);

// Reads exactly `bytes` bytes. Failures (UNAVAILABLE "the connection was closed" / "connection
// reset by peer", DEADLINE_EXCEEDED "timed out", UNAVAILABLE "cancelled") carry no peer name:
// callers add it.
Status read_exact(int fd, void* data, size_t bytes, Clock::time_point deadline, int cancel_fd);
// Writes all `bytes` bytes, same failures as read_exact.
Status write_all(int fd, const void* data, size_t bytes, Clock::time_point deadline, int cancel_fd);

// Sets TCP_NODELAY (small collectives are latency-bound).
void set_nodelay(int fd);

// "connection reset by peer" for ECONNRESET etc. (strerror, lower case first letter).
std::string errno_text(int err);

}  // namespace tessera::comm::net
