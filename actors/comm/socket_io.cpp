#include "actors/comm/socket_io.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tessera::comm::net {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int Fd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string errno_text(int err) {
  std::string text = std::strerror(err);
  if (!text.empty() && text[0] >= 'A' && text[0] <= 'Z') text[0] = static_cast<char>(text[0] + 32);
  return text;
}

Expected<HostPort> split_host_port(const std::string& address) {
  auto bad = [&] { return invalid_argument("'" + address + "' is not a host:port address"); };
  HostPort out;
  std::string port_text;
  if (!address.empty() && address[0] == '[') {
    size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return bad();
    }
    out.host = address.substr(1, close - 1);
    port_text = address.substr(close + 2);
  } else {
    size_t colon = address.rfind(':');
    if (colon == std::string::npos || address.find(':') != colon) return bad();
    out.host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
  }
  if (out.host.empty() || port_text.empty() || port_text.size() > 5) return bad();
  uint32_t port = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9') return bad();
    port = port * 10 + static_cast<uint32_t>(c - '0');
  }
  if (port == 0 || port > 65535) return bad();
  out.port = static_cast<uint16_t>(port);
  return out;
}

std::string join_host_port(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

namespace {

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head) ::freeaddrinfo(head);
  }
};

Status resolve(const std::string& host, uint16_t port, bool passive, AddrInfoList* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out->head);
  if (rc != 0) {
    return unavailable("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  return Status::ok();
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  // Round up so a wait never ends just before its deadline and spins.
  return static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
}

}  // namespace

Expected<Fd> listen_tcp(const std::string& host, uint16_t port, int backlog) {
  AddrInfoList list;
  TESSERA_RETURN_IF_ERROR(resolve(host, port, /*passive=*/true, &list));
  std::string last = "no address";
  for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      last = errno_text(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last = errno_text(errno);
      continue;
    }
    return fd;
  }
  return unavailable("cannot listen on " + join_host_port(host, port) + ": " + last);
}

Expected<uint16_t> local_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return internal_error("getsockname: " + errno_text(errno));
  }
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return internal_error("getsockname: not an IP socket");
}

std::string peer_address(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  std::string h = host;
  if (h.find(':') != std::string::npos) h = "[" + h + "]";
  return h + ":" + serv;
}

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = Clock::now();
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(
      Clock::time_point::max() - now - std::chrono::hours(24));
  return now + std::clamp(timeout, std::chrono::milliseconds(0), room);
}

Canceller::Canceller() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

void Canceller::signal() {
  uint64_t one = 1;
  ssize_t n = ::write(fd_.get(), &one, sizeof one);
  (void)n;  // EAGAIN only when the counter is saturated: it is signalled already
}

WaitResult wait_fd(int fd, short events, Clock::time_point deadline, int cancel_fd) {
  for (;;) {
    pollfd fds[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    int ms = remaining_ms(deadline);
    int rc = ::poll(fds, cancel_fd >= 0 ? 2 : 1, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return WaitResult::kReady;  // let the read or write report the error
    }
    if (cancel_fd >= 0 && fds[1].revents != 0) return WaitResult::kCancelled;
    if (fds[0].revents != 0) return WaitResult::kReady;
    if (ms == 0 || Clock::now() >= deadline) return WaitResult::kTimeout;
  }
}

namespace {

Status wait_failure(WaitResult r) {
  return r == WaitResult::kTimeout ? deadline_exceeded("timed out") : unavailable("cancelled");
}

}  // namespace

Expected<Fd> connect_tcp(const std::string& address, Clock::time_point deadline, int cancel_fd) {
  TESSERA_ASSIGN_OR_RETURN(HostPort hp, split_host_port(address));
  AddrInfoList list;
  TESSERA_RETURN_IF_ERROR(resolve(hp.host, hp.port, /*passive=*/false, &list));
  std::string last = "no address";
  for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      last = errno_text(errno);
      continue;
    }
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = errno_text(errno);
        continue;
      }
      WaitResult w = wait_fd(fd.get(), POLLOUT, deadline, cancel_fd);
      if (w != WaitResult::kReady) return wait_failure(w);
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last = errno_text(err);
        continue;
      }
    }
    set_nodelay(fd.get());
    return fd;
  }
  return unavailable(last);
}

Status read_exact(int fd, void* data, size_t bytes, Clock::time_point deadline, int cancel_fd) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = ::recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return unavailable("the connection was closed");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return unavailable(errno_text(errno));
    WaitResult w = wait_fd(fd, POLLIN, deadline, cancel_fd);
    if (w != WaitResult::kReady) return wait_failure(w);
  }
  return Status::ok();
}

Status write_all(int fd, const void* data, size_t bytes, Clock::time_point deadline,
                 int cancel_fd) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return unavailable(errno_text(errno));
    WaitResult w = wait_fd(fd, POLLOUT, deadline, cancel_fd);
    if (w != WaitResult::kReady) return wait_failure(w);
  }
  return Status::ok();
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace tessera::comm::net
