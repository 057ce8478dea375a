// TcpEndpoint: the listening socket, the accept thread that reads HELLOs, and join(), which runs
// the authenticated handshake of every connection of the mesh (tcp_communicator.h describes the
// wire). The data plane is in tcp_communicator.cpp.
#include "actors/comm/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string_view>
#include <system_error>
#include <thread>

#include "common/sha256.h"

namespace tessera::comm {

namespace {

using net::Clock;
using std::chrono::milliseconds;

constexpr char kHelloMagic[4] = {'T', 'S', 'C', 'M'};
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kHelloFixedBytes = 4 + 2 + 2 + 4 + 4 + 4 + kNonceBytes;  // 52
constexpr size_t kMaxGroupIdBytes = 255;
constexpr size_t kMaxReasonBytes = 1024;
// Incoming handshakes a join runs at once, per rank of the group.
constexpr int kMaxHandshakesPerPeer = 4;
constexpr char kChallenge = 'C';
constexpr char kReject = 'R';
constexpr char kProof = 'P';
constexpr char kAccept = 'A';

void put_u16(std::string& out, uint16_t v) {
  out += static_cast<char>(v & 0xff);
  out += static_cast<char>(v >> 8);
}
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
// Group ids are printable ASCII: they appear in logs, and a peer's HELLO is not trusted yet.
bool printable(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) <= 0x7e;
  });
}

uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t get_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// What a connecting rank says about itself before anyone is authenticated.
struct Hello {
  std::string group;
  uint32_t from = 0;
  uint32_t to = 0;
  uint32_t size = 0;
  std::string nonce;  // kNonceBytes raw bytes
};

std::string encode_hello(const Hello& h) {
  std::string out(kHelloMagic, 4);
  put_u16(out, kWireVersion);
  put_u16(out, static_cast<uint16_t>(h.group.size()));
  put_u32(out, h.from);
  put_u32(out, h.to);
  put_u32(out, h.size);
  out += h.nonce;
  out += h.group;
  return out;
}

// The HMAC each side sends: over length-prefixed fields, so no two field lists hash alike, and
// with a label per direction, so one side's proof is never valid as the other's.
std::string proof(const std::string& secret, const char* label, const Hello& h,
                  const std::string& server_nonce) {
  std::string msg;
  auto field = [&](const std::string& f) {
    put_u32(msg, static_cast<uint32_t>(f.size()));
    msg += f;
  };
  field("tessera-comm-v1");
  field(label);
  field(h.group);
  field(std::to_string(h.size));
  field(std::to_string(h.from));
  field(std::to_string(h.to));
  field(h.nonce);
  field(server_nonce);
  return digest_bytes(hmac_sha256(secret, msg));
}

std::string encode_reject(const std::string& reason) {
  std::string out(1, kReject);
  const std::string r = reason.substr(0, kMaxReasonBytes);
  put_u16(out, static_cast<uint16_t>(r.size()));
  return out + r;
}

// A connection whose HELLO has been read, not yet authenticated.
struct Incoming {
  net::Fd fd;
  std::string from_address;
  Hello hello;
  Clock::time_point since;
};

// One running join(): what the accept thread hands over and what the handshake threads fill.
struct JoinCtx {
  std::string group;
  int rank = 0;
  int size = 0;
  std::string secret;
  std::vector<RankInfo> peers;
  Clock::time_point deadline;
  milliseconds answer_timeout;  // for a dialer to answer this rank's challenge
  net::Canceller cancel;        // signalled when join() has decided

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Incoming> incoming;    // guarded by mu
  std::vector<net::Fd> conns;       // guarded by mu; by rank
  std::vector<std::string> notes;   // guarded by mu; by rank: why it is not connected yet
  std::vector<std::string> strays;  // guarded by mu; failed attempts not tied to a rank
  Status fatal;                     // guarded by mu
  int serving = 0;                  // guarded by mu; incoming handshakes in progress

  std::string describe(int r) const {
    RankInfo p = peers[r];
    p.rank = r;
    return describe_peer(p);
  }
  void note(int r, std::string text) {
    std::lock_guard lk(mu);
    if (r >= 0 && r < size) {
      notes[r] = std::move(text);
    } else if (strays.size() < 8) {
      strays.push_back(std::move(text));
    }
  }
  void set_fatal(Status status) {
    {
      std::lock_guard lk(mu);
      if (fatal.is_ok()) fatal = std::move(status);
    }
    cv.notify_all();
  }
  void connected(int r, net::Fd fd) {
    {
      std::lock_guard lk(mu);
      if (conns[r].valid()) return;  // a duplicate; the first one stays
      conns[r] = std::move(fd);
    }
    cv.notify_all();
  }
  bool cancelled() const {
    return net::wait_fd(cancel.fd(), POLLIN, Clock::now(), -1) == net::WaitResult::kReady;
  }
  // Sleeps `ms` unless cancelled or past the deadline first; false then.
  bool pause(milliseconds ms) const {
    auto until = std::min(deadline, Clock::now() + ms);
    return net::wait_fd(cancel.fd(), POLLIN, until, -1) == net::WaitResult::kTimeout &&
           Clock::now() < deadline;
  }
};

// Starts a thread; false (instead of std::system_error) when the system has none to give.
template <typename F>
bool spawn(std::vector<std::thread>& threads, F&& body) {
  try {
    threads.emplace_back(std::forward<F>(body));
    return true;
  } catch (const std::system_error&) {
    return false;
  }
}

void send_reject(int fd, const std::string& reason) {
  std::string frame = encode_reject(reason);
  (void)net::write_all(fd, frame.data(), frame.size(), Clock::now() + milliseconds(200), -1);
}

// Reads a REJECT's reason after its type byte.
std::string read_reason(int fd, const JoinCtx& ctx) {
  uint8_t len[2];
  if (!net::read_exact(fd, len, 2, ctx.deadline, ctx.cancel.fd())) return "(no reason given)";
  uint16_t n = get_u16(len);
  if (n > kMaxReasonBytes) return "(malformed reason)";
  std::string reason(n, '\0');
  if (!net::read_exact(fd, reason.data(), n, ctx.deadline, ctx.cancel.fd())) {
    return "(no reason given)";
  }
  for (char& c : reason) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  }
  return reason;
}

// This rank dials rank j < rank and proves itself; retries while j's endpoint is not up.
void dial(JoinCtx& ctx, int j) {
  const std::string who = ctx.describe(j);
  const std::string& address = ctx.peers[j].address;
  milliseconds backoff(20);
  auto retry = [&](std::string why) {
    ctx.note(j, std::move(why));
    bool go_on = ctx.pause(backoff);
    backoff = std::min(backoff * 2, milliseconds(500));
    return go_on;
  };
  for (;;) {
    auto conn = net::connect_tcp(address, ctx.deadline, ctx.cancel.fd());
    if (!conn) {
      if (ctx.cancelled() || Clock::now() >= ctx.deadline) {
        if (Clock::now() >= ctx.deadline) ctx.note(j, "could not connect to it in time");
        return;
      }
      if (!retry("cannot connect to it: " + conn.status().message())) return;
      continue;
    }
    const int fd = conn->get();
    Hello hello{ctx.group, static_cast<uint32_t>(ctx.rank), static_cast<uint32_t>(j),
                static_cast<uint32_t>(ctx.size), ""};
    auto nonce = random_bytes(kNonceBytes);
    if (!nonce) return ctx.set_fatal(nonce.status());
    hello.nonce = *nonce;
    std::string frame = encode_hello(hello);
    char type = 0;
    Status st = net::write_all(fd, frame.data(), frame.size(), ctx.deadline, ctx.cancel.fd());
    if (st) st = net::read_exact(fd, &type, 1, ctx.deadline, ctx.cancel.fd());
    if (!st) {
      if (st.code() == Code::kDeadlineExceeded) {
        ctx.note(j,
                 "its endpoint took the connection but did not answer the handshake (it has "
                 "not joined group '" +
                     ctx.group + "')");
        return;
      }
      if (ctx.cancelled()) return;
      if (!retry("its endpoint dropped the handshake: " + st.message())) return;
      continue;
    }
    if (type == kReject) {
      return ctx.set_fatal(
          Status(Code::kPermissionDenied, who + " refused the handshake: " + read_reason(fd, ctx)));
    }
    if (type != kChallenge) {
      return ctx.set_fatal(
          Status(Code::kPermissionDenied, who + " answered with something that is not a Tessera "
                                                "collective handshake"));
    }
    uint8_t challenge[kNonceBytes + kProofBytes];
    st = net::read_exact(fd, challenge, sizeof challenge, ctx.deadline, ctx.cancel.fd());
    if (!st) {
      ctx.note(j, "the handshake broke off: " + st.message());
      if (st.code() == Code::kDeadlineExceeded || ctx.cancelled()) return;
      if (!retry("the handshake broke off: " + st.message())) return;
      continue;
    }
    const std::string server_nonce(reinterpret_cast<char*>(challenge), kNonceBytes);
    const std::string server_proof(reinterpret_cast<char*>(challenge) + kNonceBytes, kProofBytes);
    if (!constant_time_equal(server_proof, proof(ctx.secret, "server", hello, server_nonce))) {
      return ctx.set_fatal(
          Status(Code::kPermissionDenied, who + " did not prove the secret of group '" + ctx.group +
                                              "': the two ranks were given different secrets, or " +
                                              address + " is not rank " + std::to_string(j) +
                                              " of this group"));
    }
    std::string reply(1, kProof);
    reply += proof(ctx.secret, "client", hello, server_nonce);
    st = net::write_all(fd, reply.data(), reply.size(), ctx.deadline, ctx.cancel.fd());
    if (st) st = net::read_exact(fd, &type, 1, ctx.deadline, ctx.cancel.fd());
    if (!st) {
      if (ctx.cancelled()) return;
      if (st.code() == Code::kDeadlineExceeded) {
        ctx.note(j, "it did not confirm the handshake in time");
        return;
      }
      return ctx.set_fatal(
          Status(Code::kPermissionDenied,
                 who + " closed the connection after this rank's proof (" + st.message() + ")"));
    }
    if (type == kAccept) {
      spdlog::debug("group '{}': rank {} connected to {}", ctx.group, ctx.rank, who);
      return ctx.connected(j, std::move(*conn));
    }
    const std::string reason = type == kReject ? read_reason(fd, ctx) : "a malformed reply";
    return ctx.set_fatal(
        Status(Code::kPermissionDenied, who + " refused the handshake: " + reason));
  }
}

// This rank answers a connection that claims to be rank hello.from of the group.
void serve(JoinCtx& ctx, Incoming in) {
  struct Done {
    JoinCtx& ctx;
    ~Done() {
      std::lock_guard lk(ctx.mu);
      --ctx.serving;
    }
  } done{ctx};
  const Hello& h = in.hello;
  const int fd = in.fd.get();
  const std::string claim =
      "a connection from " + in.from_address + " claiming to be rank " + std::to_string(h.from);
  auto refuse = [&](const std::string& reason) {
    spdlog::warn("group '{}': refused {}: {}", ctx.group, claim, reason);
    send_reject(fd, reason);
    ctx.note(h.from < static_cast<uint32_t>(ctx.size) && h.from > static_cast<uint32_t>(ctx.rank)
                 ? static_cast<int>(h.from)
                 : -1,
             claim + " was refused: " + reason);
  };
  if (h.size != static_cast<uint32_t>(ctx.size)) {
    return refuse("group '" + ctx.group + "' has " + std::to_string(ctx.size) +
                  " ranks here, not " + std::to_string(h.size));
  }
  if (h.to != static_cast<uint32_t>(ctx.rank)) {
    return refuse("this endpoint is rank " + std::to_string(ctx.rank) + " of group '" + ctx.group +
                  "', not rank " + std::to_string(h.to));
  }
  if (h.from <= static_cast<uint32_t>(ctx.rank) || h.from >= h.size) {
    return refuse("rank " + std::to_string(h.from) + " does not dial rank " +
                  std::to_string(ctx.rank) + " (higher ranks dial lower ones)");
  }
  const int from = static_cast<int>(h.from);
  auto nonce = random_bytes(kNonceBytes);
  if (!nonce) return ctx.set_fatal(nonce.status());
  std::string challenge(1, kChallenge);
  challenge += *nonce;
  challenge += proof(ctx.secret, "server", h, *nonce);
  Status st = net::write_all(fd, challenge.data(), challenge.size(), ctx.deadline, ctx.cancel.fd());
  uint8_t reply[1 + kProofBytes];
  // A genuine dialer answers at once; one that does not is dropped before the join's deadline,
  // so that silent impostors cannot hold the handshake slots.
  const auto answer_by = std::min(ctx.deadline, net::deadline_after(ctx.answer_timeout));
  if (st) st = net::read_exact(fd, reply, sizeof reply, answer_by, ctx.cancel.fd());
  if (!st) {
    if (!ctx.cancelled()) {
      ctx.note(from, claim + " broke off the handshake after this rank's challenge (" +
                         st.message() + "; did it refuse this rank's proof, a different secret?)");
    }
    return;
  }
  const std::string client_proof(reinterpret_cast<char*>(reply) + 1, kProofBytes);
  if (reply[0] != static_cast<uint8_t>(kProof) ||
      !constant_time_equal(client_proof, proof(ctx.secret, "client", h, *nonce))) {
    return refuse("its proof does not match the secret of group '" + ctx.group + "'");
  }
  const char accept = kAccept;
  st = net::write_all(fd, &accept, 1, ctx.deadline, ctx.cancel.fd());
  if (!st) {
    if (!ctx.cancelled()) ctx.note(from, claim + " went away: " + st.message());
    return;
  }
  spdlog::debug("group '{}': rank {} accepted {}", ctx.group, ctx.rank, ctx.describe(from));
  ctx.connected(from, std::move(in.fd));
}

}  // namespace

struct TcpEndpoint::State {
  TcpEndpointOptions options;
  std::string host;
  uint16_t port = 0;
  net::Fd listener;
  net::Canceller stop;
  std::thread acceptor;

  std::mutex mu;
  std::map<std::string, std::shared_ptr<JoinCtx>> joins;  // guarded by mu; running joins
  std::deque<Incoming> parked;                            // guarded by mu; HELLOs before join

  std::string address() const { return net::join_host_port(host, port); }
  void accept_loop();
  void deliver(Incoming in);
  void expire_parked();
};

void TcpEndpoint::State::deliver(Incoming in) {
  std::lock_guard lk(mu);
  auto it = joins.find(in.hello.group);
  if (it != joins.end()) {
    JoinCtx& ctx = *it->second;
    {
      std::lock_guard ctx_lk(ctx.mu);
      ctx.incoming.push_back(std::move(in));
    }
    ctx.cv.notify_all();
    return;
  }
  spdlog::debug(
      "collective endpoint {}: parked rank {}'s connection from {} for group '{}' "
      "until this rank joins it",
      address(), in.hello.from, in.from_address, in.hello.group);
  parked.push_back(std::move(in));
  if (parked.size() > options.max_parked) {
    spdlog::warn(
        "collective endpoint {}: dropped the oldest parked connection (from {}, group "
        "'{}'): more than {} are waiting for a join",
        address(), parked.front().from_address, parked.front().hello.group, options.max_parked);
    parked.pop_front();
  }
}

void TcpEndpoint::State::expire_parked() {
  std::lock_guard lk(mu);
  const auto now = Clock::now();
  while (!parked.empty() && now - parked.front().since > options.park_timeout) {
    spdlog::warn(
        "collective endpoint {}: dropped the connection from {} (rank {} of group "
        "'{}'): no join of that group here within {} ms",
        address(), parked.front().from_address, parked.front().hello.from,
        parked.front().hello.group, options.park_timeout.count());
    parked.pop_front();
  }
}

void TcpEndpoint::State::accept_loop() {
  // Connections whose HELLO is still arriving.
  struct Pending {
    net::Fd fd;
    std::string from;
    Clock::time_point since;
    std::vector<uint8_t> buf = std::vector<uint8_t>(kHelloFixedBytes);
    size_t got = 0;
  };
  std::deque<Pending> pending;
  Clock::time_point accept_paused_until{};
  std::vector<pollfd> fds;
  auto drop = [&](Pending& p, const std::string& why) {
    spdlog::warn("collective endpoint {}: dropped a connection from {}: {}", address(), p.from,
                 why);
    p.fd.reset();
  };

  for (;;) {
    const auto now = Clock::now();
    auto wake = now + milliseconds(1000);  // parked connections expire at this granularity
    for (const Pending& p : pending) wake = std::min(wake, p.since + options.hello_timeout);
    const bool accepting = now >= accept_paused_until;
    if (!accepting) wake = std::min(wake, accept_paused_until);

    fds.clear();
    fds.push_back({stop.fd(), POLLIN, 0});
    fds.push_back({accepting ? listener.get() : -1, POLLIN, 0});
    for (const Pending& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    const auto ms = std::chrono::duration_cast<milliseconds>(wake - now).count() + 1;
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(ms, 0))) < 0 &&
        errno != EINTR) {
      spdlog::error("collective endpoint {}: poll: {}", address(), net::errno_text(errno));
      accept_paused_until = Clock::now() + milliseconds(100);
      continue;
    }
    if (fds[0].revents != 0) return;

    // Read what arrived of each HELLO.
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (fds[i + 2].revents == 0) continue;
      ssize_t n = ::recv(p.fd.get(), p.buf.data() + p.got, p.buf.size() - p.got, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) {
        drop(p, n == 0 ? "closed before its hello" : net::errno_text(errno));
        continue;
      }
      p.got += static_cast<size_t>(n);
      // Anything else (an HTTP request, a scanner's probe) is dropped at its first bytes.
      if (std::memcmp(p.buf.data(), kHelloMagic, std::min<size_t>(p.got, 4)) != 0) {
        drop(p, "not a Tessera collective hello");
        continue;
      }
      if (p.got == kHelloFixedBytes && p.buf.size() == kHelloFixedBytes) {
        const uint16_t version = get_u16(p.buf.data() + 4);
        if (version != kWireVersion) {
          send_reject(p.fd.get(), "collective wire version " + std::to_string(version) +
                                      " is not this endpoint's version " +
                                      std::to_string(kWireVersion));
          drop(p, "wire version " + std::to_string(version));
          continue;
        }
        const uint16_t group_len = get_u16(p.buf.data() + 6);
        if (group_len == 0 || group_len > kMaxGroupIdBytes) {
          drop(p, "malformed hello (group id of " + std::to_string(group_len) + " bytes)");
          continue;
        }
        p.buf.resize(kHelloFixedBytes + group_len);
      }
      if (p.got == p.buf.size() && p.buf.size() > kHelloFixedBytes) {
        Incoming in;
        const uint8_t* b = p.buf.data();
        in.hello.from = get_u32(b + 8);
        in.hello.to = get_u32(b + 12);
        in.hello.size = get_u32(b + 16);
        in.hello.nonce.assign(reinterpret_cast<const char*>(b) + 20, kNonceBytes);
        in.hello.group.assign(reinterpret_cast<const char*>(b) + kHelloFixedBytes,
                              p.buf.size() - kHelloFixedBytes);
        if (!printable(in.hello.group)) {
          drop(p, "malformed hello (the group id is not printable)");
          continue;
        }
        in.from_address = p.from;
        in.since = Clock::now();
        in.fd = std::move(p.fd);
        deliver(std::move(in));
      }
    }
    // Drop the finished, the closed and the too slow.
    const auto after = Clock::now();
    for (Pending& p : pending) {
      if (p.fd.valid() && after - p.since >= options.hello_timeout) {
        drop(p, "no hello within " + std::to_string(options.hello_timeout.count()) + " ms");
      }
    }
    std::erase_if(pending, [](const Pending& p) { return !p.fd.valid(); });
    expire_parked();

    if (!accepting || fds[1].revents == 0) continue;
    for (;;) {
      int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          // EMFILE, ENFILE, ENOBUFS: leave the backlog for a while instead of spinning.
          spdlog::warn("collective endpoint {}: accept: {}; pausing 100 ms", address(),
                       net::errno_text(errno));
          accept_paused_until = Clock::now() + milliseconds(100);
        }
        break;
      }
      Pending p{net::Fd(fd), net::peer_address(fd), Clock::now()};
      if (pending.size() >= options.max_pending) {
        drop(pending.front(), "too many connections without a hello");
        pending.pop_front();
      }
      pending.push_back(std::move(p));
    }
  }
}

TcpEndpoint::TcpEndpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}

TcpEndpoint::~TcpEndpoint() {
  state_->stop.signal();
  if (state_->acceptor.joinable()) state_->acceptor.join();
}

Expected<std::unique_ptr<TcpEndpoint>> TcpEndpoint::listen(const std::string& host,
                                                           TcpEndpointOptions options) {
  auto state = std::make_unique<State>();
  state->options = options;
  state->host = host;
  TESSERA_ASSIGN_OR_RETURN(state->listener, net::listen_tcp(host, 0, 128));
  TESSERA_ASSIGN_OR_RETURN(state->port, net::local_port(state->listener.get()));
  if (!state->stop.valid()) return resource_exhausted("collective endpoint: no eventfd left");
  State* raw = state.get();
  try {
    state->acceptor = std::thread([raw] { raw->accept_loop(); });
  } catch (const std::system_error& e) {
    return resource_exhausted(std::string("collective endpoint: cannot start a thread: ") +
                              e.what());
  }
  spdlog::debug("collective endpoint listening on {}", state->address());
  return std::unique_ptr<TcpEndpoint>(new TcpEndpoint(std::move(state)));
}

std::string TcpEndpoint::address() const { return state_->address(); }

Expected<std::unique_ptr<Communicator>> TcpEndpoint::join(const std::string& group_id, int rank,
                                                          std::vector<RankInfo> peers,
                                                          const std::string& secret,
                                                          milliseconds timeout,
                                                          TcpCommOptions options) {
  const int size = static_cast<int>(peers.size());
  const std::string what = "joining group '" + group_id + "' as rank " + std::to_string(rank) +
                           " of " + std::to_string(size);
  if (group_id.empty() || group_id.size() > kMaxGroupIdBytes || !printable(group_id)) {
    return invalid_argument("joining a group as rank " + std::to_string(rank) +
                            ": the group id must be 1 to 255 printable ASCII characters");
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return invalid_argument(what + ": the rank is not in the group");
  }
  if (secret.empty()) return invalid_argument(what + ": empty group secret");
  for (int r = 0; r < size; ++r) {
    if (r != rank && peers[r].address.empty()) {
      return invalid_argument(what + ": rank " + std::to_string(r) + " has no address");
    }
  }
  if (options.op_timeout.count() <= 0 || timeout.count() < 0) {
    return invalid_argument(what + ": timeouts must be positive");
  }
  const auto started = Clock::now();
  if (size == 1) {
    std::vector<net::Fd> none(1);
    return std::unique_ptr<Communicator>(
        new TcpCommunicator(group_id, rank, std::move(peers), std::move(none), options));
  }

  auto ctx = std::make_shared<JoinCtx>();
  ctx->group = group_id;
  ctx->rank = rank;
  ctx->size = size;
  ctx->secret = secret;
  ctx->peers = peers;
  ctx->deadline = net::deadline_after(timeout);
  ctx->answer_timeout = state_->options.hello_timeout;
  if (!ctx->cancel.valid()) return resource_exhausted(what + ": no eventfd left");
  ctx->conns.resize(size);
  ctx->notes.assign(size, "");
  {
    std::lock_guard lk(state_->mu);
    if (state_->joins.count(group_id) != 0) {
      return Status(Code::kAlreadyExists,
                    what + ": a join of this group is already running on " + address());
    }
    state_->joins[group_id] = ctx;
    std::lock_guard ctx_lk(ctx->mu);
    for (auto it = state_->parked.begin(); it != state_->parked.end();) {
      if (it->hello.group == group_id) {
        ctx->incoming.push_back(std::move(*it));
        it = state_->parked.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::vector<std::thread> threads;
  const Status no_thread = resource_exhausted("cannot start a handshake thread");
  for (int j = 0; j < rank; ++j) {
    if (!spawn(threads, [ctx, j] { dial(*ctx, j); })) ctx->set_fatal(no_thread);
  }
  auto missing = [&] {
    int n = 0;
    for (int r = 0; r < size; ++r) n += (r != rank && !ctx->conns[r].valid());
    return n;
  };
  {
    std::unique_lock lk(ctx->mu);
    for (;;) {
      while (!ctx->incoming.empty()) {
        auto handshake = [ctx, in = std::move(ctx->incoming.front())]() mutable {
          serve(*ctx, std::move(in));
        };
        ctx->incoming.pop_front();
        if (ctx->serving >= kMaxHandshakesPerPeer * size) {
          // Flooded (by connections that claim to be peers): this one is dropped; a genuine
          // dialer retries.
          spdlog::warn("{}: dropped a connection: {} handshakes already in progress", what,
                       ctx->serving);
          continue;
        }
        // Without a thread the connection is dropped; a genuine peer's join then fails.
        if (!spawn(threads, std::move(handshake))) {
          if (ctx->fatal.is_ok()) ctx->fatal = no_thread;
          continue;
        }
        ++ctx->serving;
      }
      if (!ctx->fatal.is_ok() || missing() == 0) break;
      if (ctx->cv.wait_until(lk, ctx->deadline) == std::cv_status::timeout &&
          ctx->incoming.empty()) {
        break;
      }
    }
  }
  {
    std::lock_guard lk(state_->mu);
    state_->joins.erase(group_id);
  }
  ctx->cancel.signal();
  for (std::thread& t : threads) t.join();

  // Every thread is done: ctx is ours alone.
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - started);
  if (!ctx->fatal.is_ok()) {
    spdlog::warn("{} failed: {}", what, ctx->fatal.message());
    return ctx->fatal.with_context(what);
  }
  if (missing() != 0) {
    std::string list;
    for (int r = 0; r < size; ++r) {
      if (r == rank || ctx->conns[r].valid()) continue;
      std::string why = ctx->notes[r];
      if (why.empty()) {
        why = r > rank ? "it has not connected to this rank" : "no answer from it";
      }
      list += (list.empty() ? "" : "; ") + ctx->describe(r) + " has not joined (" + why + ")";
    }
    for (const std::string& stray : ctx->strays) list += "; " + stray;
    spdlog::warn("{} timed out after {} ms: {}", what, timeout.count(), list);
    return deadline_exceeded(what + " timed out after " + std::to_string(timeout.count()) +
                             " ms: " + list);
  }
  spdlog::info("joined group '{}' as rank {} of {} in {} ms", group_id, rank, size, took.count());
  std::vector<net::Fd> conns = std::move(ctx->conns);
  return std::unique_ptr<Communicator>(
      new TcpCommunicator(group_id, rank, std::move(peers), std::move(conns), options));
}

}  // namespace tessera::comm
