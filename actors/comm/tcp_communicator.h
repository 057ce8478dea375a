// The cpu backend's collectives: a full mesh of authenticated TCP connections between the ranks
// of a group, on host memory.
//
// Each actor process makes one TcpEndpoint (a listening socket) and publishes its address; the
// driver hands every rank the list of peers (RankInfo, with their endpoint addresses), a group
// id and a per-group secret; every rank then calls join() and gets a Communicator. One endpoint
// serves any number of groups (world, tensor-parallel, pipeline pairs), joined one after another
// or concurrently.
//
// Wire (version kWireVersion), all integers little-endian:
//   handshake, on a connection from rank i to rank j < i (each pair connects once: the higher
//   rank dials):
//     i -> j  HELLO     "TSCM" u16 version, u16 group length, u32 from, u32 to, u32 size,
//                       32-byte nonce Ni, group id
//     j -> i  CHALLENGE 'C', 32-byte nonce Nj, HMAC-SHA-256(secret, "server" | fields | Ni | Nj)
//          or REJECT    'R', u16 length, reason (wrong version, rank, size; bad proof)
//     i -> j  PROOF     'P', HMAC-SHA-256(secret, "client" | fields | Ni | Nj)
//     j -> i  ACCEPT    'A'  or REJECT
//   where fields = group id, size, from, to, length-prefixed. The secret never crosses the wire;
//   each side proves it with fresh nonces, so a recorded handshake cannot be replayed.
//   data: frames of a 24-byte header ("TSCF", u8 kind, u8 dtype, u16 0, u64 sequence number
//   per direction, u64 payload bytes) and the payload. A receiver checks every header against
//   what it expects (kind, dtype, sequence, length): ranks that call different collectives or
//   sizes get an error naming the peer instead of corrupted tensors.
//
// Security: the handshake authenticates both ends; the data after it is neither encrypted nor
// integrity-protected (as with NCCL): run groups on a trusted network.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "actors/comm/communicator.h"
#include "actors/comm/socket_io.h"
#include "common/status.h"

namespace tessera::comm {

inline constexpr uint16_t kWireVersion = 1;

// How a communicator made by TcpEndpoint::join behaves. Every rank of a group must use the same
// values for direct_all_reduce_max_bytes (a mismatch is detected and reported, not silent).
struct TcpCommOptions {
  // Bound on every blocking operation (all_reduce, all_gather, send, recv, barrier): past it the
  // operation fails with DEADLINE_EXCEEDED naming the peers it still waited for.
  std::chrono::milliseconds op_timeout = std::chrono::minutes(10);
  // all_reduce of at most this many bytes, or in a group of two: every rank sends its whole
  // buffer to every other and sums all of them (one round trip). Larger: reduce-scatter (rank r
  // sums slice r of every rank's buffer) then all-gather of the sums (two round trips, each rank
  // moves 2(n-1)/n of the buffer instead of n-1). Both sum in rank order: same bits.
  int64_t direct_all_reduce_max_bytes = 256 << 10;
};

// Limits of an endpoint against connections that are not (yet) a group member.
struct TcpEndpointOptions {
  // A connection must send its whole HELLO within this time or is dropped (port scanners,
  // stuck clients).
  std::chrono::milliseconds hello_timeout = std::chrono::seconds(10);
  // A HELLO for a group no join() on this endpoint is running for is kept this long, waiting
  // for the matching join() (a faster peer may dial before this rank joins).
  std::chrono::milliseconds park_timeout = std::chrono::minutes(10);
  // At most this many connections waiting for their HELLO, and this many parked; beyond that
  // the oldest is dropped.
  size_t max_pending = 256;
  size_t max_parked = 256;
};

// A connected, authenticated group: host memory, `stream` ignored.
//
// Threading: one caller thread at a time per communicator (the calls are not synchronized);
// different communicators, even of one endpoint, are independent and may be used from one
// thread or from several. Every rank must issue the same sequence of collectives (and matching
// sends and receives per pair) with the same counts and dtypes.
//
// Failures: a peer that closes or resets its connection fails the operation at once
// (UNAVAILABLE naming it); a peer that is alive but silent fails it after op_timeout
// (DEADLINE_EXCEEDED naming the peers still awaited); a frame that does not match (garbage, a
// different collective, size or dtype) fails it (FAILED_PRECONDITION naming the peer). After
// any such failure the connections are out of step: every later call returns that first error.
// Nothing throws.
//
// send() returns when its bytes are in the kernel's socket buffer or on the wire; a large send
// to a peer that is not receiving blocks (up to op_timeout), so two ranks must not both send
// large messages to each other before receiving.
class TcpCommunicator final : public Communicator {
 public:
  // Used by TcpEndpoint::join: conns[r] is the authenticated connection to rank r (invalid for
  // this rank), peers[r] describes rank r.
  TcpCommunicator(std::string group_id, int rank, std::vector<RankInfo> peers,
                  std::vector<net::Fd> conns, TcpCommOptions options);
  ~TcpCommunicator() override;
  TcpCommunicator(const TcpCommunicator&) = delete;
  TcpCommunicator& operator=(const TcpCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(peers_.size()); }
  // F32, BF16 and F16; fp32 accumulation in rank order, one rounding to the dtype at the end.
  // count == 0 returns at once on every rank.
  Status all_reduce_sum(void* data, int64_t count, DType dtype, void* stream) override;
  // `in` may alias its own slot of `out`.
  Status all_gather(const void* in, int64_t count, DType dtype, void* out, void* stream) override;
  // Every segment is a frame (an empty one too), so sizes that do not pair up are reported.
  Status all_to_all(const void* in, std::span<const int64_t> send_bytes, void* out,
                    std::span<const int64_t> recv_bytes, void* stream) override;
  Status send(const void* data, int64_t bytes, int peer, void* stream) override;
  Status recv(void* data, int64_t bytes, int peer, void* stream) override;
  Status barrier() override;
  std::string describe(int peer) const override;

  const std::string& group_id() const { return group_id_; }

 private:
  struct Transfer;
  // Runs sends and receives with any set of peers at once until all are done (or one fails).
  Status exchange(std::vector<Transfer>& transfers, const char* op);
  // OK when a received header is the frame `t` expects; FAILED_PRECONDITION naming the peer.
  Status check_header(const Transfer& t, const char* op) const;
  Status check_usable() const;
  Status fail(Status status);
  Status all_reduce_direct(char* data, int64_t count, DType dtype);
  Status all_reduce_two_phase(char* data, int64_t count, DType dtype);

  std::string group_id_;
  int rank_;
  std::vector<RankInfo> peers_;
  std::vector<net::Fd> conns_;
  TcpCommOptions options_;
  std::vector<uint64_t> send_seq_;  // next frame number, per peer
  std::vector<uint64_t> recv_seq_;
  std::vector<char> scratch_;  // received buffers of all_reduce
  std::vector<float> accum_;   // fp32 sums of all_reduce
  Status failed_;              // the first failure; OK while usable
};

// One per actor process: the listening socket of its collective groups.
//
// A background thread accepts connections, reads their HELLO (bounded by hello_timeout; garbage
// is dropped at once) and hands each to the join() running for its group, or parks it until that
// join() starts. join() is thread-safe: groups may be joined concurrently from several threads,
// or one after another from one thread; in the latter case every rank must join its groups in
// the same order (as with NCCL communicators), or a rank waits for a peer that is itself waiting
// in another group's join, until the timeout. Communicators outlive their endpoint; the endpoint
// must not be destroyed while a join() on it runs.
class TcpEndpoint {
 public:
  // Listens on host:0 (the kernel picks the port). `host` is what address() reports, so give
  // the address peers reach this node at ("10.0.0.2"), not a wildcard.
  static Expected<std::unique_ptr<TcpEndpoint>> listen(const std::string& host,
                                                       TcpEndpointOptions options = {});
  ~TcpEndpoint();
  TcpEndpoint(const TcpEndpoint&) = delete;
  TcpEndpoint& operator=(const TcpEndpoint&) = delete;

  // "host:port".
  std::string address() const;

  // Joins group `group_id` as `rank` of peers.size() ranks (peers[i] is group rank i, with its
  // endpoint address). Every member uses the same group id and secret. Connects the full mesh,
  // authenticating every connection both ways. Fails:
  //  - INVALID_ARGUMENT: rank out of range, an empty secret, a group id that is not 1 to 255
  //    printable ASCII characters, a peer without an address; ALREADY_EXISTS: a join of this
  //    group id is running on this endpoint;
  //  - DEADLINE_EXCEEDED after `timeout`, naming each rank still missing and its address;
  //  - PERMISSION_DENIED at once when a peer refuses the handshake or fails to prove the secret
  //    (wrong secret, or that address is in another group), naming the peer and its address.
  // A connection that claims to be a peer but fails authentication is dropped; the join goes on
  // waiting for the real peer (and the timeout error mentions the failed attempt).
  Expected<std::unique_ptr<Communicator>> join(const std::string& group_id, int rank,
                                               std::vector<RankInfo> peers,
                                               const std::string& secret,
                                               std::chrono::milliseconds timeout,
                                               TcpCommOptions options = {});

 private:
  struct State;
  explicit TcpEndpoint(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace tessera::comm
