// The data plane of TcpCommunicator: framed transfers over the mesh, progressed together by one
// poll loop so that every rank can send to and receive from every other at once without
// deadlock. TcpEndpoint (the handshake) is in tcp_endpoint.cpp.
#include "actors/comm/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "common/tensor.h"

namespace tessera::comm {

namespace {

constexpr char kFrameMagic[4] = {'T', 'S', 'C', 'F'};
constexpr size_t kHeaderBytes = 24;

enum class FrameKind : uint8_t {
  kSend = 1,
  kAllReduce = 2,      // direct: a rank's whole buffer
  kReduceScatter = 3,  // two-phase, first: the slice the receiver sums
  kGatherSums = 4,     // two-phase, second: the sender's summed slice
  kAllGather = 5,
  kBarrier = 6,
  kAllToAll = 7,
};

const char* kind_name(uint8_t kind) {
  switch (static_cast<FrameKind>(kind)) {
    case FrameKind::kSend:
      return "send";
    case FrameKind::kAllReduce:
      return "all_reduce";
    case FrameKind::kReduceScatter:
      return "all_reduce (reduce-scatter)";
    case FrameKind::kGatherSums:
      return "all_reduce (gather)";
    case FrameKind::kAllGather:
      return "all_gather";
    case FrameKind::kBarrier:
      return "barrier";
    case FrameKind::kAllToAll:
      return "all_to_all";
  }
  return "unknown frame";
}

// 0: no dtype (send, barrier); otherwise DType + 1.
uint8_t dtype_code(DType dtype) { return static_cast<uint8_t>(static_cast<uint8_t>(dtype) + 1); }

std::string dtype_text(uint8_t code) {
  if (code == 0) return "";
  if (code > 3) return " of dtype #" + std::to_string(code);
  return std::string(" ") + dtype_name(static_cast<DType>(code - 1));
}

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Elements of one block of the rank-order sum: small enough to stay in L1, long enough to
// vectorize.
constexpr int64_t kSumBlock = 1024;

float load(const char* base, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, base + i * 4, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, base + i * 2, 2);
      return bf16_to_float(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, base + i * 2, 2);
      return f16_to_float(h);
    }
    case DType::kI32:
    case DType::kF8E4M3:
      break;  // never reduced: the collectives carry activations
  }
  return 0.f;
}

void store(char* base, int64_t i, DType dtype, float f) {
  if (dtype == DType::kF32) {
    std::memcpy(base + i * 4, &f, 4);
    return;
  }
  uint16_t h = dtype == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
  std::memcpy(base + i * 2, &h, 2);
}

// out[i] = (((src[0][i] + src[1][i]) + src[2][i]) + ...) in fp32, rounded once to `dtype`.
// `out` may be one of the sources (each block is read whole before it is written).
void sum_in_rank_order(const std::vector<const char*>& srcs, int64_t count, DType dtype,
                       char* out) {
  float acc[kSumBlock];
  const size_t es = dtype_size(dtype);
  for (int64_t begin = 0; begin < count; begin += kSumBlock) {
    const int64_t n = std::min(kSumBlock, count - begin);
    const int64_t off = begin * static_cast<int64_t>(es);
    if (dtype == DType::kF32) {
      std::memcpy(acc, srcs[0] + off, static_cast<size_t>(n) * 4);
      for (size_t r = 1; r < srcs.size(); ++r) {
        float other[kSumBlock];
        std::memcpy(other, srcs[r] + off, static_cast<size_t>(n) * 4);
        for (int64_t i = 0; i < n; ++i) acc[i] += other[i];
      }
      std::memcpy(out + off, acc, static_cast<size_t>(n) * 4);
      continue;
    }
    for (int64_t i = 0; i < n; ++i) acc[i] = load(srcs[0] + off, i, dtype);
    for (size_t r = 1; r < srcs.size(); ++r) {
      for (int64_t i = 0; i < n; ++i) acc[i] += load(srcs[r] + off, i, dtype);
    }
    for (int64_t i = 0; i < n; ++i) store(out + off, i, dtype, acc[i]);
  }
}

// Element range [begin, begin + length) of rank r's slice when `count` is split over n ranks.
int64_t slice_begin(int64_t count, int n, int r) {
  const int64_t base = count / n;
  const int64_t rem = count % n;
  return r * base + std::min<int64_t>(r, rem);
}
int64_t slice_length(int64_t count, int n, int r) {
  return slice_begin(count, n, r + 1) - slice_begin(count, n, r);
}

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

}  // namespace

// One frame to send to, or receive from, one peer.
struct TcpCommunicator::Transfer {
  int peer = 0;
  bool is_send = false;
  FrameKind kind = FrameKind::kSend;
  uint8_t dtype = 0;
  char* data = nullptr;  // payload source (send) or destination (receive)
  uint64_t bytes = 0;
  // Progress.
  uint64_t seq = 0;
  uint8_t header[kHeaderBytes] = {};
  uint64_t done = 0;  // header + payload bytes moved so far
  bool ready = true;  // worth trying without waiting for poll
  bool finished() const { return done == kHeaderBytes + bytes; }
};

TcpCommunicator::TcpCommunicator(std::string group_id, int rank, std::vector<RankInfo> peers,
                                 std::vector<net::Fd> conns, TcpCommOptions options)
    : group_id_(std::move(group_id)),
      rank_(rank),
      peers_(std::move(peers)),
      conns_(std::move(conns)),
      options_(options),
      send_seq_(peers_.size(), 0),
      recv_seq_(peers_.size(), 0) {
  TESSERA_CHECK(rank_ >= 0 && rank_ < static_cast<int>(peers_.size()));
  TESSERA_CHECK(conns_.size() == peers_.size());
  for (int r = 0; r < size(); ++r) {
    TESSERA_CHECK(r == rank_ || conns_[r].valid(), "missing connection");
    if (conns_[r].valid()) net::set_nodelay(conns_[r].get());
  }
}

TcpCommunicator::~TcpCommunicator() = default;

std::string TcpCommunicator::describe(int peer) const {
  if (peer < 0 || peer >= size()) return "rank " + std::to_string(peer) + " (not in the group)";
  RankInfo info = peers_[peer];
  info.rank = peer;
  return describe_peer(info);
}

Status TcpCommunicator::check_usable() const {
  if (failed_.is_ok()) return Status::ok();
  return Status(failed_.code(), "this communicator failed earlier: " + failed_.message());
}

Status TcpCommunicator::fail(Status status) {
  failed_ = status.with_context("group '" + group_id_ + "' (rank " + std::to_string(rank_) +
                                " of " + std::to_string(size()) + ")");
  return failed_;
}

Status TcpCommunicator::check_header(const Transfer& t, const char* op) const {
  if (std::memcmp(t.header, kFrameMagic, 4) != 0) {
    return failed_precondition(describe(t.peer) + " sent a malformed frame during " + op +
                               " (not a Tessera collective frame header)");
  }
  const uint8_t kind = t.header[4];
  const uint8_t dtype = t.header[5];
  const uint64_t seq = get_u64(t.header + 8);
  const uint64_t bytes = get_u64(t.header + 16);
  if (kind == static_cast<uint8_t>(t.kind) && dtype == t.dtype && seq == t.seq &&
      bytes == t.bytes) {
    return Status::ok();
  }
  return failed_precondition(
      describe(t.peer) + " is out of step during " + op + ": it sent " + kind_name(kind) + " #" +
      std::to_string(seq) + " of " + std::to_string(bytes) + " bytes" + dtype_text(dtype) +
      " where this rank expects " + kind_name(static_cast<uint8_t>(t.kind)) + " #" +
      std::to_string(t.seq) + " of " + std::to_string(t.bytes) + " bytes" + dtype_text(t.dtype) +
      " (every rank must call the same collectives with the same sizes)");
}

Status TcpCommunicator::exchange(std::vector<Transfer>& transfers, const char* op) {
  const auto deadline = net::deadline_after(options_.op_timeout);
  for (Transfer& t : transfers) {
    if (t.is_send) {
      t.seq = send_seq_[t.peer]++;
      std::memcpy(t.header, kFrameMagic, 4);
      t.header[4] = static_cast<uint8_t>(t.kind);
      t.header[5] = t.dtype;
      put_u64(t.header + 8, t.seq);
      put_u64(t.header + 16, t.bytes);
    } else {
      t.seq = recv_seq_[t.peer]++;
    }
  }

  // Moves as many bytes as the socket takes or has now (OK: maybe not finished yet).
  auto progress = [&](Transfer& t) -> Status {
    const int fd = conns_[t.peer].get();
    while (!t.finished()) {
      ssize_t n;
      if (t.is_send) {
        iovec iov[2];
        int iovcnt = 0;
        if (t.done < kHeaderBytes) {
          iov[iovcnt++] = {t.header + t.done, kHeaderBytes - t.done};
          if (t.bytes > 0) iov[iovcnt++] = {t.data, t.bytes};
        } else {
          iov[iovcnt++] = {t.data + (t.done - kHeaderBytes), t.bytes - (t.done - kHeaderBytes)};
        }
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = static_cast<size_t>(iovcnt);
        n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      } else if (t.done < kHeaderBytes) {
        n = ::recv(fd, t.header + t.done, kHeaderBytes - t.done, MSG_DONTWAIT);
      } else {
        n = ::recv(fd, t.data + (t.done - kHeaderBytes), t.bytes - (t.done - kHeaderBytes),
                   MSG_DONTWAIT);
      }
      if (n > 0) {
        const bool header_was_partial = t.done < kHeaderBytes;
        t.done += static_cast<uint64_t>(n);
        if (!t.is_send && header_was_partial && t.done == kHeaderBytes) {
          TESSERA_RETURN_IF_ERROR(check_header(t, op));
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        t.ready = false;
        return Status::ok();
      }
      if (n == 0 || errno == EPIPE) {
        return unavailable(describe(t.peer) + " closed the connection during " + op);
      }
      return unavailable(describe(t.peer) + ": " + net::errno_text(errno) + " during " + op);
    }
    return Status::ok();
  };

  std::vector<pollfd> fds;
  std::vector<size_t> owner;                      // fds[i] waits for transfers[owner[i]]
  std::vector<bool> named(conns_.size(), false);  // one error per peer
  for (;;) {
    // Try every transfer that may move; collect every peer that failed in this round, so that
    // the error names them all (a killed rank, not just the first socket looked at).
    Status failure;  // the first failure's code, every failure's message
    bool all_done = true;
    for (Transfer& t : transfers) {
      if (!t.finished() && t.ready && !named[t.peer]) {
        Status st = progress(t);
        if (!st.is_ok()) {
          failure = failure.is_ok()
                        ? st
                        : Status(failure.code(), failure.message() + "; " + st.message());
          named[t.peer] = true;
        }
      }
      all_done = all_done && t.finished();
    }
    if (!failure.is_ok()) return fail(failure);
    if (all_done) return Status::ok();

    fds.clear();
    owner.clear();
    for (size_t i = 0; i < transfers.size(); ++i) {
      const Transfer& t = transfers[i];
      if (t.finished()) continue;
      fds.push_back({conns_[t.peer].get(), static_cast<short>(t.is_send ? POLLOUT : POLLIN), 0});
      owner.push_back(i);
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - net::Clock::now());
    if (left.count() <= 0) {
      std::string waiting;
      for (const Transfer& t : transfers) {
        if (t.finished()) continue;
        const uint64_t moved = t.done > kHeaderBytes ? t.done - kHeaderBytes : 0;
        waiting += std::string(waiting.empty() ? "" : "; ") +
                   (t.is_send ? "sending to " : "receiving from ") + describe(t.peer) + " (" +
                   std::to_string(moved) + " of " + std::to_string(t.bytes) + " bytes)";
      }
      return fail(deadline_exceeded(std::string(op) + " timed out after " +
                                    ms_text(options_.op_timeout) + ", still " + waiting));
    }
    const int ms = static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
    const int rc = ::poll(fds.data(), fds.size(), ms);
    if (rc < 0 && errno != EINTR) {
      return fail(internal_error(std::string("poll during ") + op + ": " + net::errno_text(errno)));
    }
    for (size_t i = 0; rc > 0 && i < fds.size(); ++i) {
      if (fds[i].revents != 0) transfers[owner[i]].ready = true;  // errors surface in progress
    }
  }
}

Status TcpCommunicator::all_reduce_sum(void* data, int64_t count, DType dtype, void*) {
  TESSERA_RETURN_IF_ERROR(check_usable());
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  if (count < 0 || count > std::numeric_limits<int64_t>::max() / es / size()) {
    return invalid_argument("all_reduce_sum: bad element count " + std::to_string(count));
  }
  if (count == 0 || size() == 1) return Status::ok();
  if (data == nullptr) return invalid_argument("all_reduce_sum: null buffer");
  if (size() == 2 || count * es <= options_.direct_all_reduce_max_bytes) {
    return all_reduce_direct(static_cast<char*>(data), count, dtype);
  }
  return all_reduce_two_phase(static_cast<char*>(data), count, dtype);
}

Status TcpCommunicator::all_reduce_direct(char* data, int64_t count, DType dtype) {
  const uint64_t bytes = static_cast<uint64_t>(count) * dtype_size(dtype);
  // Peer p's buffer lands in slot p (p < rank) or p - 1 (p > rank) of scratch_.
  scratch_.resize(bytes * static_cast<size_t>(size() - 1));
  auto slot = [&](int p) {
    return scratch_.data() + bytes * static_cast<size_t>(p < rank_ ? p : p - 1);
  };
  std::vector<Transfer> transfers;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    transfers.push_back({.peer = p,
                         .is_send = true,
                         .kind = FrameKind::kAllReduce,
                         .dtype = dtype_code(dtype),
                         .data = data,
                         .bytes = bytes});
    transfers.push_back({.peer = p,
                         .is_send = false,
                         .kind = FrameKind::kAllReduce,
                         .dtype = dtype_code(dtype),
                         .data = slot(p),
                         .bytes = bytes});
  }
  TESSERA_RETURN_IF_ERROR(exchange(transfers, "all_reduce"));
  std::vector<const char*> srcs;
  for (int r = 0; r < size(); ++r) srcs.push_back(r == rank_ ? data : slot(r));
  sum_in_rank_order(srcs, count, dtype, data);
  return Status::ok();
}

Status TcpCommunicator::all_reduce_two_phase(char* data, int64_t count, DType dtype) {
  const int n = size();
  const uint64_t es = dtype_size(dtype);
  auto begin = [&](int r) { return data + static_cast<uint64_t>(slice_begin(count, n, r)) * es; };
  auto length = [&](int r) { return static_cast<uint64_t>(slice_length(count, n, r)) * es; };
  const uint64_t mine = length(rank_);
  scratch_.resize(mine * static_cast<size_t>(n - 1));
  auto slot = [&](int p) {
    return scratch_.data() + mine * static_cast<size_t>(p < rank_ ? p : p - 1);
  };

  // Phase 1: every rank gets every rank's copy of its own slice.
  std::vector<Transfer> transfers;
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    transfers.push_back({.peer = p,
                         .is_send = true,
                         .kind = FrameKind::kReduceScatter,
                         .dtype = dtype_code(dtype),
                         .data = begin(p),
                         .bytes = length(p)});
    transfers.push_back({.peer = p,
                         .is_send = false,
                         .kind = FrameKind::kReduceScatter,
                         .dtype = dtype_code(dtype),
                         .data = slot(p),
                         .bytes = mine});
  }
  TESSERA_RETURN_IF_ERROR(exchange(transfers, "all_reduce"));
  std::vector<const char*> srcs;
  for (int r = 0; r < n; ++r) srcs.push_back(r == rank_ ? begin(rank_) : slot(r));
  sum_in_rank_order(srcs, slice_length(count, n, rank_), dtype, begin(rank_));

  // Phase 2: every rank gets every summed slice.
  transfers.clear();
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    transfers.push_back({.peer = p,
                         .is_send = true,
                         .kind = FrameKind::kGatherSums,
                         .dtype = dtype_code(dtype),
                         .data = begin(rank_),
                         .bytes = mine});
    transfers.push_back({.peer = p,
                         .is_send = false,
                         .kind = FrameKind::kGatherSums,
                         .dtype = dtype_code(dtype),
                         .data = begin(p),
                         .bytes = length(p)});
  }
  return exchange(transfers, "all_reduce");
}

Status TcpCommunicator::all_gather(const void* in, int64_t count, DType dtype, void* out, void*) {
  TESSERA_RETURN_IF_ERROR(check_usable());
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  if (count < 0 || count > std::numeric_limits<int64_t>::max() / es / size()) {
    return invalid_argument("all_gather: bad element count " + std::to_string(count));
  }
  if (count == 0) return Status::ok();
  if (in == nullptr || out == nullptr) return invalid_argument("all_gather: null buffer");
  const uint64_t bytes = static_cast<uint64_t>(count * es);
  char* dst = static_cast<char*>(out);
  std::vector<Transfer> transfers;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    transfers.push_back({.peer = p,
                         .is_send = true,
                         .kind = FrameKind::kAllGather,
                         .dtype = dtype_code(dtype),
                         .data = const_cast<char*>(static_cast<const char*>(in)),
                         .bytes = bytes});
    transfers.push_back({.peer = p,
                         .is_send = false,
                         .kind = FrameKind::kAllGather,
                         .dtype = dtype_code(dtype),
                         .data = dst + bytes * p,
                         .bytes = bytes});
  }
  TESSERA_RETURN_IF_ERROR(exchange(transfers, "all_gather"));
  char* own = dst + bytes * static_cast<uint64_t>(rank_);
  if (own != in) std::memmove(own, in, bytes);
  return Status::ok();
}

Status TcpCommunicator::all_to_all(const void* in, std::span<const int64_t> send_bytes, void* out,
                                   std::span<const int64_t> recv_bytes, void*) {
  TESSERA_RETURN_IF_ERROR(check_usable());
  TESSERA_RETURN_IF_ERROR(check_all_to_all(size(), in, send_bytes, out, recv_bytes));
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<Transfer> transfers;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) {
      if (send_bytes[p] != recv_bytes[p]) {
        return invalid_argument("all_to_all: this rank sends itself " +
                                std::to_string(send_bytes[p]) + " bytes but expects " +
                                std::to_string(recv_bytes[p]));
      }
      if (send_bytes[p] > 0) std::memcpy(dst, src, static_cast<size_t>(send_bytes[p]));
    } else {
      transfers.push_back({.peer = p,
                           .is_send = true,
                           .kind = FrameKind::kAllToAll,
                           .dtype = 0,
                           .data = const_cast<char*>(src),
                           .bytes = static_cast<uint64_t>(send_bytes[p])});
      transfers.push_back({.peer = p,
                           .is_send = false,
                           .kind = FrameKind::kAllToAll,
                           .dtype = 0,
                           .data = dst,
                           .bytes = static_cast<uint64_t>(recv_bytes[p])});
    }
    src += send_bytes[p];
    dst += recv_bytes[p];
  }
  return exchange(transfers, "all_to_all");
}

Status TcpCommunicator::send(const void* data, int64_t bytes, int peer, void*) {
  TESSERA_RETURN_IF_ERROR(check_usable());
  if (peer < 0 || peer >= size() || peer == rank_) {
    return invalid_argument("send: rank " + std::to_string(peer) + " is not another rank of a " +
                            std::to_string(size()) + "-rank group");
  }
  if (bytes < 0 || (bytes > 0 && data == nullptr)) {
    return invalid_argument("send: bad buffer (" + std::to_string(bytes) + " bytes)");
  }
  std::vector<Transfer> transfers;
  transfers.push_back({.peer = peer,
                       .is_send = true,
                       .kind = FrameKind::kSend,
                       .dtype = 0,
                       .data = const_cast<char*>(static_cast<const char*>(data)),
                       .bytes = static_cast<uint64_t>(bytes)});
  return exchange(transfers, "send");
}

Status TcpCommunicator::recv(void* data, int64_t bytes, int peer, void*) {
  TESSERA_RETURN_IF_ERROR(check_usable());
  if (peer < 0 || peer >= size() || peer == rank_) {
    return invalid_argument("recv: rank " + std::to_string(peer) + " is not another rank of a " +
                            std::to_string(size()) + "-rank group");
  }
  if (bytes < 0 || (bytes > 0 && data == nullptr)) {
    return invalid_argument("recv: bad buffer (" + std::to_string(bytes) + " bytes)");
  }
  std::vector<Transfer> transfers;
  transfers.push_back({.peer = peer,
                       .is_send = false,
                       .kind = FrameKind::kSend,
                       .dtype = 0,
                       .data = static_cast<char*>(data),
                       .bytes = static_cast<uint64_t>(bytes)});
  return exchange(transfers, "recv");
}

Status TcpCommunicator::barrier() {
  TESSERA_RETURN_IF_ERROR(check_usable());
  std::vector<Transfer> transfers;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    transfers.push_back({.peer = p, .is_send = true, .kind = FrameKind::kBarrier});
    transfers.push_back({.peer = p, .is_send = false, .kind = FrameKind::kBarrier});
  }
  return exchange(transfers, "barrier");
}

}  // namespace tessera::comm
