// The cpu backend's collectives (actors/comm/tcp_communicator.h): ranks as threads of this process
// and as forked processes on loopback; results bit for bit equal to a sum in rank order; the
// failures (wrong secret, a rank that never joins, a killed rank, garbage on the wire) named and
// bounded in time.
#include "actors/comm/tcp_communicator.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "actors/comm/socket_io.h"
#include "common/tensor.h"
#include "tests/comm/rank_processes.h"

namespace tessera::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::RankContext;
using testing::RankProcesses;

constexpr const char* kSecret = "secret-of-the-comm-tests-0123456789";
const std::vector<int64_t> kSizes = {1, 7, 4096, 1 << 22};

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// RankInfo of group ranks 0.. = world ranks `members` (all of `addresses` when empty).
std::vector<RankInfo> make_peers(const std::vector<std::string>& addresses,
                                 std::vector<int> members = {}) {
  if (members.empty()) {
    for (size_t r = 0; r < addresses.size(); ++r) members.push_back(static_cast<int>(r));
  }
  std::vector<RankInfo> peers;
  for (size_t i = 0; i < members.size(); ++i) {
    const int w = members[i];
    peers.push_back({.rank = static_cast<int>(i),
                     .actor_id = "a-" + std::to_string(w),
                     .node_id = "n-test",
                     .gpu = -1,
                     .address = addresses[w]});
  }
  return peers;
}

uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Values of very different magnitudes, so that the order of a sum shows in its bits.
float input_value(int rank, int64_t i, uint32_t salt = 0) {
  static const float kScale[9] = {1e-6f, 1e-4f, 1e-2f, 1.f, 1e2f, 1e4f, 3e-3f, 7.f, 0.5f};
  const uint32_t h = mix(mix(static_cast<uint32_t>(i) * 2654435761u + salt) ^
                         (static_cast<uint32_t>(rank) + 1) * 0x9e3779b9u);
  return static_cast<float>(static_cast<int>(h % 20001) - 10000) * kScale[(h >> 24) % 9];
}

std::vector<float> inputs(int rank, int64_t count, uint32_t salt = 0) {
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[i] = input_value(rank, i, salt);
  return v;
}

// ((x0 + x1) + x2) + ... in fp32.
std::vector<float> reference_sum(int n, int64_t count, uint32_t salt = 0) {
  std::vector<float> sum = inputs(0, count, salt);
  for (int r = 1; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) sum[i] += input_value(r, i, salt);
  }
  return sum;
}

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

void run_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

// n endpoints on loopback, one per "process".
struct Endpoints {
  explicit Endpoints(int n, TcpEndpointOptions options = {}) {
    for (int r = 0; r < n; ++r) {
      auto ep = TcpEndpoint::listen("127.0.0.1", options);
      EXPECT_TRUE(ep.has_value()) << ep.status().to_string();
      addresses.push_back((*ep)->address());
      eps.push_back(std::move(*ep));
    }
  }
  std::vector<std::unique_ptr<TcpEndpoint>> eps;
  std::vector<std::string> addresses;
};

struct Joined {
  std::vector<std::unique_ptr<Communicator>> comms;  // by group rank
  std::vector<Status> status;
  bool ok() const {
    return std::all_of(status.begin(), status.end(), [](const Status& s) { return s.is_ok(); });
  }
};

// Every member of `members` (world ranks) joins `group` on its own thread.
Joined join_group(Endpoints& e, const std::string& group, std::vector<int> members = {},
                  std::chrono::milliseconds timeout = 20s, TcpCommOptions options = {}) {
  if (members.empty()) {
    for (size_t r = 0; r < e.eps.size(); ++r) members.push_back(static_cast<int>(r));
  }
  const int n = static_cast<int>(members.size());
  Joined j;
  j.comms.resize(n);
  j.status.resize(n);
  run_threads(n, [&](int r) {
    auto c = e.eps[members[r]]->join(group, r, make_peers(e.addresses, members), kSecret, timeout,
                                     options);
    if (c) {
      j.comms[r] = std::move(*c);
    } else {
      j.status[r] = c.status();
    }
  });
  return j;
}

TEST(DescribePeer, NamesActorGpuNodeAndAddress) {
  EXPECT_EQ(
      describe_peer(
          {.rank = 1, .actor_id = "a-3f2e", .node_id = "n-77ab", .address = "10.0.0.2:41022"}),
      "rank 1 (a-3f2e on node n-77ab, 10.0.0.2:41022)");
  EXPECT_EQ(describe_peer({.rank = 2, .actor_id = "a-1", .node_id = "n-2", .gpu = 3}),
            "rank 2 (a-1, GPU 3 on node n-2)");
  EXPECT_EQ(describe_peer({.rank = 0}), "rank 0");
  EXPECT_EQ(describe_peer({.rank = 4, .address = "h:1"}), "rank 4 (h:1)");
}

TEST(CommJoin, ValidatesItsArgumentsAndAGroupOfOneWorksAlone) {
  Endpoints e(2);
  auto peers = make_peers(e.addresses);
  auto code = [&](const std::string& group, int rank, std::vector<RankInfo> p,
                  const std::string& secret) {
    return e.eps[0]->join(group, rank, std::move(p), secret, 100ms).status().code();
  };
  EXPECT_EQ(code("g", 2, peers, kSecret), Code::kInvalidArgument);
  EXPECT_EQ(code("g", -1, peers, kSecret), Code::kInvalidArgument);
  EXPECT_EQ(code("g", 0, peers, ""), Code::kInvalidArgument);
  EXPECT_EQ(code("", 0, peers, kSecret), Code::kInvalidArgument);
  EXPECT_EQ(code("g\n", 0, peers, kSecret), Code::kInvalidArgument);
  EXPECT_EQ(code(std::string(256, 'g'), 0, peers, kSecret), Code::kInvalidArgument);
  auto no_address = peers;
  no_address[1].address.clear();
  EXPECT_EQ(code("g", 0, no_address, kSecret), Code::kInvalidArgument);

  // A second join of a group id that is being joined on the same endpoint is refused.
  std::thread first([&] { (void)e.eps[0]->join("busy", 0, peers, kSecret, 1s); });
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(code("busy", 0, peers, kSecret), Code::kAlreadyExists);
  first.join();

  auto alone = e.eps[1]->join("alone", 0, make_peers({e.addresses[1]}), kSecret, 100ms);
  ASSERT_TRUE(alone.has_value()) << alone.status().to_string();
  std::vector<float> x = {1.5f, -2.f};
  std::vector<float> out(2);
  EXPECT_TRUE((*alone)->all_reduce_sum(x.data(), 2, DType::kF32, nullptr));
  EXPECT_EQ(x[0], 1.5f);
  EXPECT_TRUE((*alone)->all_gather(x.data(), 2, DType::kF32, out.data(), nullptr));
  EXPECT_EQ(out, x);
  EXPECT_TRUE((*alone)->barrier());
  EXPECT_EQ((*alone)->describe(0), "rank 0 (a-0 on node n-test, " + e.addresses[1] + ")");
}

// ---- ranks as threads ----------------------------------------------------------------------

class AllReduceThreads : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(AllReduceThreads, EqualsTheRankOrderSumOnEveryRank) {
  const int n = std::get<0>(GetParam());
  const int64_t direct_max = std::get<1>(GetParam());
  Endpoints e(n);
  TcpCommOptions options;
  options.direct_all_reduce_max_bytes = direct_max;
  Joined j = join_group(e, "world", {}, 20s, options);
  ASSERT_TRUE(j.ok()) << j.status[0].to_string();
  for (int64_t count : kSizes) {
    const std::vector<float> ref = reference_sum(n, count);
    std::vector<std::vector<float>> data(n);
    std::vector<Status> st(n);
    run_threads(n, [&](int r) {
      data[r] = inputs(r, count);
      st[r] = j.comms[r]->all_reduce_sum(data[r].data(), count, DType::kF32, nullptr);
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
      EXPECT_TRUE(same_bits(data[r].data(), ref.data(), count * 4))
          << "rank " << r << " of " << n << ", " << count << " floats";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, AllReduceThreads,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(int64_t{256} << 10, int64_t{0})));

TEST(CommThreads, HalfPrecisionAccumulatesInFp32AndRoundsOnce) {
  const int n = 3;
  Endpoints e(n);
  for (int64_t direct_max : {int64_t{1} << 20, int64_t{0}}) {
    TcpCommOptions options;
    options.direct_all_reduce_max_bytes = direct_max;
    Joined j = join_group(e, "half-" + std::to_string(direct_max), {}, 20s, options);
    ASSERT_TRUE(j.ok()) << j.status[0].to_string();
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      const int64_t count = 10007;
      auto to_half = [&](float f) {
        return dtype == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f * 1e-5f);
      };
      auto to_float = [&](uint16_t h) {
        return dtype == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
      };
      std::vector<std::vector<uint16_t>> data(n, std::vector<uint16_t>(count));
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < count; ++i) data[r][i] = to_half(input_value(r, i));
      }
      std::vector<uint16_t> ref(count);
      for (int64_t i = 0; i < count; ++i) {
        float acc = to_float(data[0][i]);
        for (int r = 1; r < n; ++r) acc += to_float(data[r][i]);
        ref[i] = dtype == DType::kBF16 ? float_to_bf16(acc) : float_to_f16(acc);
      }
      std::vector<Status> st(n);
      run_threads(n, [&](int r) {
        st[r] = j.comms[r]->all_reduce_sum(data[r].data(), count, dtype, nullptr);
      });
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
        EXPECT_TRUE(same_bits(data[r].data(), ref.data(), count * 2))
            << dtype_name(dtype) << " rank " << r;
      }
    }
  }
}

TEST(CommThreads, AllGatherSendRecvAndBarrier) {
  const int n = 4;
  Endpoints e(n);
  Joined j = join_group(e, "world");
  ASSERT_TRUE(j.ok()) << j.status[0].to_string();
  std::atomic<int> arrived{0};
  std::vector<std::string> errors(n);
  run_threads(n, [&](int r) {
    auto fail = [&](const std::string& what) { errors[r] += what + "; "; };
    Communicator& c = *j.comms[r];
    // all_gather, out of place and in place.
    for (int64_t count : {int64_t{1}, int64_t{1000}, int64_t{1} << 18}) {
      std::vector<float> in = inputs(r, count, 5);
      std::vector<float> out(count * n);
      if (!c.all_gather(in.data(), count, DType::kF32, out.data(), nullptr)) fail("all_gather");
      std::vector<float> in_place(count * n);
      std::copy(in.begin(), in.end(), in_place.begin() + r * count);
      if (!c.all_gather(in_place.data() + r * count, count, DType::kF32, in_place.data(),
                        nullptr)) {
        fail("all_gather in place");
      }
      for (int p = 0; p < n; ++p) {
        std::vector<float> want = inputs(p, count, 5);
        if (!same_bits(out.data() + p * count, want.data(), count * 4)) fail("gathered slot");
        if (!same_bits(in_place.data() + p * count, want.data(), count * 4)) fail("in place");
      }
    }
    // Ping-pong between 0 and 1, and 2 and 3: each round trip adds one, several sizes.
    const int partner = r ^ 1;
    for (int64_t bytes : {int64_t{0}, int64_t{1}, int64_t{4096}, int64_t{8} << 20}) {
      std::vector<uint8_t> buf(bytes, static_cast<uint8_t>(r));
      for (int round = 0; round < 3; ++round) {
        if (r % 2 == 0) {
          if (!c.send(buf.data(), bytes, partner, nullptr)) fail("send");
          if (!c.recv(buf.data(), bytes, partner, nullptr)) fail("recv");
        } else {
          if (!c.recv(buf.data(), bytes, partner, nullptr)) fail("recv");
          for (uint8_t& b : buf) ++b;
          if (!c.send(buf.data(), bytes, partner, nullptr)) fail("send");
        }
      }
      const uint8_t want = static_cast<uint8_t>((r & ~1) + 3);
      if (bytes > 0 && (buf.front() != want || buf.back() != want)) fail("ping-pong value");
    }
    // Barrier: nobody leaves before the last one (who comes late) has arrived.
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * r));
    arrived++;
    if (!c.barrier()) fail("barrier");
    if (arrived.load() != n) fail("left the barrier early");
    // Misuse is refused, not fatal.
    if (c.send(nullptr, 0, r, nullptr).code() != Code::kInvalidArgument) fail("send to self");
    if (c.recv(nullptr, 0, n, nullptr).code() != Code::kInvalidArgument) fail("recv from n");
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// The bytes rank `from` sends rank `to` in round `round` of AllToAllMovesUnevenSegments: some
// pairs send nothing, some several MiB (more than a socket buffer, both ways at once).
int64_t a2a_bytes(int from, int to, int round) {
  const int64_t pick = (from * 7 + to * 3 + round) % 5;
  return pick == 0 ? 0 : pick == 4 ? (int64_t{3} << 20) + from : pick * 1000 + to;
}
uint8_t a2a_byte(int from, int to, int64_t i) {
  return static_cast<uint8_t>(from * 31 + to * 17 + i * 13);
}

// Expert parallelism's dispatch: every rank sends each rank its own segment (this rank's too),
// uneven, empty ones included; what arrives is exactly what was addressed to the receiver, from
// each sender in rank order. Sizes that do not pair up are an error naming the peer.
TEST(CommThreads, AllToAllMovesUnevenSegments) {
  const int n = 4;
  Endpoints e(n);
  Joined j = join_group(e, "world");
  ASSERT_TRUE(j.ok()) << j.status[0].to_string();
  std::vector<std::string> errors(n);
  run_threads(n, [&](int r) {
    auto fail = [&](const std::string& what) { errors[r] += what + "; "; };
    Communicator& c = *j.comms[r];
    for (int round = 0; round < 3; ++round) {
      std::vector<int64_t> send(n), recv(n);
      std::vector<uint8_t> in;
      for (int p = 0; p < n; ++p) {
        send[p] = a2a_bytes(r, p, round);
        recv[p] = a2a_bytes(p, r, round);
        for (int64_t i = 0; i < send[p]; ++i) in.push_back(a2a_byte(r, p, i));
      }
      int64_t total = 0;
      for (int64_t b : recv) total += b;
      std::vector<uint8_t> out(static_cast<size_t>(total), 0xee);
      if (Status st = c.all_to_all(in.data(), send, out.data(), recv, nullptr); !st) {
        fail("all_to_all: " + st.to_string());
        return;
      }
      int64_t at = 0;
      for (int p = 0; p < n; ++p) {
        for (int64_t i = 0; i < recv[p]; ++i) {
          if (out[at + i] != a2a_byte(p, r, i)) {
            fail("byte " + std::to_string(i) + " from rank " + std::to_string(p));
            break;
          }
        }
        at += recv[p];
      }
    }
    // Misuse is refused, not fatal.
    std::vector<int64_t> short_sizes(n - 1, 0), zeros(n, 0);
    if (c.all_to_all(nullptr, short_sizes, nullptr, zeros, nullptr).code() !=
        Code::kInvalidArgument) {
      fail("wrong number of sizes accepted");
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;

  // Rank 1 expects 8 bytes from rank 0, which sends it 4: an error naming rank 0, no overrun.
  Endpoints e2(2);
  Joined j2 = join_group(e2, "pair");
  ASSERT_TRUE(j2.ok()) << j2.status[0].to_string();
  std::vector<Status> got(2);
  run_threads(2, [&](int r) {
    std::vector<int64_t> send = {0, 0}, recv = {0, 0};
    send[1 - r] = 4;
    recv[1 - r] = r == 1 ? 8 : 4;
    std::vector<uint8_t> in(4, 1), out(8, 0);
    got[r] = j2.comms[r]->all_to_all(in.data(), send, out.data(), recv, nullptr);
  });
  EXPECT_EQ(got[1].code(), Code::kFailedPrecondition) << got[1].to_string();
  EXPECT_NE(got[1].message().find("rank 0"), std::string::npos) << got[1].to_string();
}

// Counts what passes through a communicator (to see which path by_size took).
class Counting final : public Communicator {
 public:
  explicit Counting(std::unique_ptr<Communicator> c) : c_(std::move(c)) {}
  int rank() const override { return c_->rank(); }
  int size() const override { return c_->size(); }
  Status all_reduce_sum(void* d, int64_t n, DType t, void* s) override {
    ++calls;
    return c_->all_reduce_sum(d, n, t, s);
  }
  Status all_gather(const void* in, int64_t n, DType t, void* out, void* s) override {
    ++calls;
    return c_->all_gather(in, n, t, out, s);
  }
  Status all_to_all(const void* in, std::span<const int64_t> sb, void* out,
                    std::span<const int64_t> rb, void* s) override {
    ++calls;
    return c_->all_to_all(in, sb, out, rb, s);
  }
  Status send(const void* d, int64_t b, int p, void* s) override {
    ++calls;
    return c_->send(d, b, p, s);
  }
  Status recv(void* d, int64_t b, int p, void* s) override {
    ++calls;
    return c_->recv(d, b, p, s);
  }
  Status barrier() override {
    ++calls;
    return c_->barrier();
  }
  std::string describe(int p) const override { return c_->describe(p); }
  std::atomic<int> calls{0};

 private:
  std::unique_ptr<Communicator> c_;
};

// The custom all-reduce beside NCCL, on the cpu backend's communicators: by size, the same path
// on every rank, the same sums either way; point to point and barriers on the large path.
TEST(CommThreads, BySizePicksThePathBySizeOnEveryRank) {
  const int n = 2;
  Endpoints e(n);
  Joined small = join_group(e, "small");
  Joined large = join_group(e, "large");
  ASSERT_TRUE(small.ok() && large.ok());
  std::vector<Counting*> small_count(n), large_count(n);
  std::vector<std::unique_ptr<Communicator>> comms(n);
  for (int r = 0; r < n; ++r) {
    auto s = std::make_unique<Counting>(std::move(small.comms[r]));
    auto l = std::make_unique<Counting>(std::move(large.comms[r]));
    small_count[r] = s.get();
    large_count[r] = l.get();
    comms[r] = by_size(std::move(s), std::move(l), 4096);
  }
  std::vector<std::string> errors(n);
  run_threads(n, [&](int r) {
    auto fail = [&](const std::string& what) { errors[r] += what + "; "; };
    Communicator& c = *comms[r];
    if (c.rank() != r || c.size() != n) fail("rank/size");
    // 1024 floats = 4096 bytes: small; 1025: large; 2048 halves = 4096 bytes: small.
    int want_small = 0, want_large = 0;
    for (int64_t count : {int64_t{1}, int64_t{1024}, int64_t{1025}, int64_t{1} << 16}) {
      std::vector<float> data = inputs(r, count, 9);
      if (!c.all_reduce_sum(data.data(), count, DType::kF32, nullptr)) fail("all_reduce");
      std::vector<float> want = reference_sum(n, count, 9);
      if (!same_bits(data.data(), want.data(), count * 4)) fail("sum " + std::to_string(count));
      (count * 4 <= 4096 ? want_small : want_large)++;
      if (small_count[r]->calls != want_small || large_count[r]->calls != want_large) {
        fail("path of " + std::to_string(count) + " floats");
      }
    }
    // all_gather: judged by the gathered size (512 floats x 2 ranks = 4096 bytes: small).
    for (int64_t count : {int64_t{512}, int64_t{513}}) {
      std::vector<float> in = inputs(r, count, 3), out(count * n);
      if (!c.all_gather(in.data(), count, DType::kF32, out.data(), nullptr)) fail("all_gather");
      (count * 4 * n <= 4096 ? want_small : want_large)++;
      for (int p = 0; p < n; ++p) {
        std::vector<float> w = inputs(p, count, 3);
        if (!same_bits(out.data() + p * count, w.data(), count * 4)) fail("gathered");
      }
    }
    std::vector<uint8_t> one(8, static_cast<uint8_t>(r));
    if (r == 0 ? !c.send(one.data(), 8, 1, nullptr) : !c.recv(one.data(), 8, 0, nullptr)) {
      fail("send/recv");
    }
    if (!c.barrier()) fail("barrier");
    want_large += 2;
    if (small_count[r]->calls != want_small || large_count[r]->calls != want_large) {
      fail("paths: small " + std::to_string(small_count[r]->calls.load()) + " large " +
           std::to_string(large_count[r]->calls.load()));
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// World of 4, TP groups {0,1} {2,3}, PP pairs {0,2} {1,3}, all over one endpoint per rank.
TEST(CommThreads, SeveralGroupsOverOneEndpoint) {
  Endpoints e(4);
  const std::vector<std::vector<int>> tp = {{0, 1}, {2, 3}};
  const std::vector<std::vector<int>> pp = {{0, 2}, {1, 3}};
  std::vector<std::unique_ptr<Communicator>> world(4), tpc(4), ppc(4);
  std::vector<std::string> errors(4);
  // Sequential joins in the same order on every rank (world is established when TP joins).
  run_threads(4, [&](int w) {
    auto join = [&](const std::string& g, const std::vector<int>& members) {
      const int r =
          static_cast<int>(std::find(members.begin(), members.end(), w) - members.begin());
      auto c = e.eps[w]->join(g, r, make_peers(e.addresses, members), kSecret, 20s);
      if (!c) errors[w] += c.status().to_string() + "; ";
      return c ? std::move(*c) : nullptr;
    };
    world[w] = join("world", {0, 1, 2, 3});
    tpc[w] = join("tp" + std::to_string(w / 2), tp[w / 2]);
    ppc[w] = join("pp" + std::to_string(w % 2), pp[w % 2]);
  });
  for (int w = 0; w < 4; ++w) ASSERT_EQ(errors[w], "") << w;

  run_threads(4, [&](int w) {
    // TP all_reduce within each pair, then the first stage sends the result to the second,
    // then a world all_reduce: interleaved use of three communicators from one thread.
    std::vector<float> x = inputs(w, 1000, 9);
    if (!tpc[w]->all_reduce_sum(x.data(), 1000, DType::kF32, nullptr)) errors[w] += "tp; ";
    std::vector<float> want(1000);
    const int a = tp[w / 2][0], b = tp[w / 2][1];
    for (int i = 0; i < 1000; ++i) want[i] = input_value(a, i, 9) + input_value(b, i, 9);
    if (!same_bits(x.data(), want.data(), 4000)) errors[w] += "tp sum; ";
    std::vector<float> got(1000);
    if (w < 2) {
      if (!ppc[w]->send(x.data(), 4000, 1, nullptr)) errors[w] += "pp send; ";
    } else {
      if (!ppc[w]->recv(got.data(), 4000, 0, nullptr)) errors[w] += "pp recv; ";
      // Stage 1 got its partner's TP sum, which is the {0, 1} pair's.
      for (int i = 0; i < 1000; ++i) want[i] = input_value(0, i, 9) + input_value(1, i, 9);
      if (!same_bits(got.data(), want.data(), 4000)) errors[w] += "pp data; ";
    }
    std::vector<float> y = inputs(w, 77, 3);
    if (!world[w]->all_reduce_sum(y.data(), 77, DType::kF32, nullptr)) errors[w] += "world; ";
    if (!same_bits(y.data(), reference_sum(4, 77, 3).data(), 77 * 4)) errors[w] += "world sum; ";
  });
  for (int w = 0; w < 4; ++w) EXPECT_EQ(errors[w], "") << w;
}

// Each rank joins its groups concurrently from several threads, in any order.
TEST(CommThreads, ConcurrentJoinsOfDifferentGroups) {
  Endpoints e(4);
  std::vector<std::string> errors(4);
  std::vector<std::vector<std::unique_ptr<Communicator>>> comms(4);
  for (auto& c : comms) c.resize(3);
  run_threads(4, [&](int w) {
    const std::vector<std::pair<std::string, std::vector<int>>> groups = {
        {"world", {0, 1, 2, 3}},
        {"tp" + std::to_string(w / 2), w < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}},
        {"pp" + std::to_string(w % 2),
         w % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}}};
    std::vector<std::thread> joins;
    std::mutex mu;
    for (int g = 0; g < 3; ++g) {
      // Odd ranks start with the last group: the orders differ between ranks.
      const int which = w % 2 == 0 ? g : 2 - g;
      joins.emplace_back([&, which] {
        const auto& members = groups[which].second;
        const int r =
            static_cast<int>(std::find(members.begin(), members.end(), w) - members.begin());
        auto c =
            e.eps[w]->join(groups[which].first, r, make_peers(e.addresses, members), kSecret, 20s);
        std::lock_guard lk(mu);
        if (c) {
          comms[w][which] = std::move(*c);
        } else {
          errors[w] += c.status().to_string() + "; ";
        }
      });
    }
    for (auto& t : joins) t.join();
  });
  for (int w = 0; w < 4; ++w) EXPECT_EQ(errors[w], "") << w;
}

TEST(CommThreads, WrongSecretIsRefusedAndNamed) {
  Endpoints e(2);
  std::optional<Status> st[2];
  run_threads(2, [&](int r) {
    auto c = e.eps[r]->join("g", r, make_peers(e.addresses), r == 1 ? "not-the-secret" : kSecret,
                            1500ms);
    st[r] = c.status();
  });
  // The dialing rank finds out at once and names the peer and its address.
  EXPECT_EQ(st[1]->code(), Code::kPermissionDenied) << st[1]->to_string();
  EXPECT_NE(st[1]->message().find("rank 0 (a-0 on node n-test, " + e.addresses[0]),
            std::string::npos)
      << st[1]->message();
  EXPECT_NE(st[1]->message().find("secret"), std::string::npos) << st[1]->message();
  // The other side keeps waiting for a genuine rank 1 and says what happened.
  EXPECT_EQ(st[0]->code(), Code::kDeadlineExceeded) << st[0]->to_string();
  EXPECT_NE(st[0]->message().find("rank 1 (a-1 on node n-test, " + e.addresses[1]),
            std::string::npos)
      << st[0]->message();
}

TEST(CommThreads, ARankThatNeverJoinsFailsTheOthersInTime) {
  // Rank 2 has an endpoint but never joins; then rank 0 never joins and has no endpoint at all.
  Endpoints e(3);
  const auto start = Clock::now();
  std::optional<Status> st[2];
  run_threads(2, [&](int r) {
    auto c = e.eps[r]->join("three", r, make_peers(e.addresses), kSecret, 1000ms);
    st[r] = c.status();
  });
  EXPECT_LT(ms_since(start), 5000);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r]->code(), Code::kDeadlineExceeded) << st[r]->to_string();
    EXPECT_NE(
        st[r]->message().find("rank 2 (a-2 on node n-test, " + e.addresses[2] + ") has not joined"),
        std::string::npos)
        << st[r]->message();
    EXPECT_EQ(st[r]->message().find("rank " + std::to_string(1 - r) + " ("), std::string::npos)
        << st[r]->message();
  }

  // A missing rank 0 whose endpoint is gone: rank 1 cannot even connect.
  const std::string gone = e.addresses[0];
  e.eps[0].reset();
  auto c = e.eps[1]->join("two", 1, make_peers(e.addresses, {0, 1}), kSecret, 800ms);
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(c.status().message().find("rank 0 (a-0 on node n-test, " + gone + ") has not joined"),
            std::string::npos)
      << c.status().message();
}

TEST(CommThreads, GarbageAndPortScansDoNotBreakAJoin) {
  TcpEndpointOptions eo;
  eo.hello_timeout = 300ms;
  Endpoints e(3, eo);
  auto dial = [&](int r) {
    auto fd = net::connect_tcp(e.addresses[r], Clock::now() + 2s, -1);
    EXPECT_TRUE(fd.has_value());
    return fd ? std::move(*fd) : net::Fd();
  };
  auto send_text = [](const net::Fd& fd, const std::string& bytes) {
    (void)net::write_all(fd.get(), bytes.data(), bytes.size(), Clock::now() + 1s, -1);
  };
  // Before any join: a silent connection, random bytes, an immediate close, an HTTP request,
  // a hello with an absurd group length, and impostors of rank 1 and 2 with a bogus proof.
  net::Fd silent = dial(0);
  net::Fd garbage = dial(0);
  send_text(garbage, std::string(4096, '\x7f'));
  dial(0).reset();
  net::Fd http = dial(1);
  send_text(http, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string absurd = std::string("TSCM") + '\x01' + '\0' + '\xff' + '\xff' + std::string(44, 'z');
  net::Fd bad_len = dial(0);
  send_text(bad_len, absurd);
  auto impostor_hello = [](uint32_t from, uint32_t to, const std::string& group,
                           uint16_t version = kWireVersion) {
    std::string h = "TSCM";
    auto u16 = [&](uint16_t v) {
      h += static_cast<char>(v & 0xff);
      h += static_cast<char>(v >> 8);
    };
    auto u32 = [&](uint32_t v) {
      for (int i = 0; i < 4; ++i) h += static_cast<char>((v >> (8 * i)) & 0xff);
    };
    u16(version);
    u16(static_cast<uint16_t>(group.size()));
    u32(from);
    u32(to);
    u32(3);
    h += std::string(32, 'n');
    return h + group;
  };
  net::Fd impostor = dial(0);
  send_text(impostor, impostor_hello(1, 0, "g"));
  net::Fd mute_impostor = dial(1);  // claims rank 2, then never answers the challenge
  send_text(mute_impostor, impostor_hello(2, 1, "g"));

  // A future wire version is told why it is refused.
  net::Fd future = dial(2);
  send_text(future, impostor_hello(1, 2, "g", 99));
  char type = 0;
  ASSERT_TRUE(net::read_exact(future.get(), &type, 1, Clock::now() + 5s, -1));
  EXPECT_EQ(type, 'R');
  char len[2];
  ASSERT_TRUE(net::read_exact(future.get(), len, 2, Clock::now() + 5s, -1));
  std::string reason(static_cast<uint8_t>(len[0]) | (static_cast<uint8_t>(len[1]) << 8), '\0');
  ASSERT_TRUE(net::read_exact(future.get(), reason.data(), reason.size(), Clock::now() + 5s, -1));
  EXPECT_EQ(reason, "collective wire version 99 is not this endpoint's version 1");

  std::thread answer([&] {
    // The impostor answers the challenge with a made-up proof: refused, or simply dropped when
    // the genuine rank 1 completed the join first.
    char type = 0;
    if (!net::read_exact(impostor.get(), &type, 1, Clock::now() + 10s, -1) || type != 'C') return;
    char challenge[64];
    (void)net::read_exact(impostor.get(), challenge, 64, Clock::now() + 10s, -1);
    send_text(impostor, "P" + std::string(32, 'x'));
    type = 0;
    Status st = net::read_exact(impostor.get(), &type, 1, Clock::now() + 10s, -1);
    EXPECT_TRUE(st.is_ok() ? type == 'R' : st.code() == Code::kUnavailable)
        << st.to_string() << " " << type;
  });
  Joined j = join_group(e, "g", {}, 10s);
  answer.join();
  ASSERT_TRUE(j.ok()) << j.status[0].to_string() << " / " << j.status[1].to_string() << " / "
                      << j.status[2].to_string();
  std::vector<Status> st(3);
  std::vector<std::vector<float>> data(3);
  run_threads(3, [&](int r) {
    data[r] = inputs(r, 4096);
    st[r] = j.comms[r]->all_reduce_sum(data[r].data(), 4096, DType::kF32, nullptr);
  });
  const auto ref = reference_sum(3, 4096);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
    EXPECT_TRUE(same_bits(data[r].data(), ref.data(), 4096 * 4));
  }
  // The silent connection was dropped after the hello timeout.
  char c;
  EXPECT_TRUE(net::read_exact(silent.get(), &c, 1, Clock::now() + 5s, -1).code() ==
              Code::kUnavailable);
}

// ---- the data plane against a misbehaving peer ------------------------------------------------

// Rank 0 is a real communicator; "rank 1" is the test holding the other end of a socket pair.
struct RawPeer {
  RawPeer() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
    std::vector<net::Fd> conns(2);
    conns[1] = net::Fd(sv[0]);
    raw = net::Fd(sv[1]);
    TcpCommOptions options;
    options.op_timeout = 2s;
    comm = std::make_unique<TcpCommunicator>("raw", 0, make_peers({"here:1", "there:2"}),
                                             std::move(conns), options);
  }
  void send(const std::string& bytes) {
    ASSERT_TRUE(net::write_all(raw.get(), bytes.data(), bytes.size(), Clock::now() + 1s, -1));
  }
  static std::string header(uint8_t kind, uint8_t dtype, uint64_t seq, uint64_t bytes) {
    std::string h = "TSCF";
    h += static_cast<char>(kind);
    h += static_cast<char>(dtype);
    h += std::string(2, '\0');
    for (uint64_t v : {seq, bytes}) {
      for (int i = 0; i < 8; ++i) h += static_cast<char>((v >> (8 * i)) & 0xff);
    }
    return h;
  }
  net::Fd raw;
  std::unique_ptr<TcpCommunicator> comm;
};

TEST(CommWire, GarbageFrameIsAnErrorNamingThePeer) {
  RawPeer p;
  p.send(std::string(24, 'G'));
  std::vector<float> x(16, 1.f);
  Status st = p.comm->all_reduce_sum(x.data(), 16, DType::kF32, nullptr);
  EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("rank 1 (a-1 on node n-test, there:2) sent a malformed frame"),
            std::string::npos)
      << st.message();
  // Out of step from now on: every later call says so.
  Status again = p.comm->barrier();
  EXPECT_EQ(again.code(), Code::kFailedPrecondition);
  EXPECT_NE(again.message().find("failed earlier"), std::string::npos) << again.message();
}

TEST(CommWire, AbsurdLengthIsAnErrorNotAnAllocation) {
  RawPeer p;
  p.send(RawPeer::header(/*all_reduce*/ 2, /*F32*/ 1, 0, uint64_t{1} << 60));
  std::vector<float> x(16, 1.f);
  Status st = p.comm->all_reduce_sum(x.data(), 16, DType::kF32, nullptr);
  EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("is out of step"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("1152921504606846976 bytes"), std::string::npos) << st.message();
}

TEST(CommWire, SilentPeerTimesOutAndClosedPeerIsNamed) {
  {
    RawPeer p;
    std::vector<float> x(16, 1.f);
    const auto start = Clock::now();
    Status st = p.comm->all_reduce_sum(x.data(), 16, DType::kF32, nullptr);
    EXPECT_EQ(st.code(), Code::kDeadlineExceeded) << st.to_string();
    EXPECT_GE(ms_since(start), 1900);
    EXPECT_LT(ms_since(start), 6000);
    EXPECT_NE(st.message().find("receiving from rank 1 (a-1"), std::string::npos) << st.message();
  }
  {
    RawPeer p;
    // A valid header, half the payload, then the peer dies.
    p.send(RawPeer::header(/*send*/ 1, 0, 0, 1000) + std::string(500, 'x'));
    p.raw.reset();
    std::vector<char> buf(1000);
    Status st = p.comm->recv(buf.data(), 1000, 1, nullptr);
    EXPECT_EQ(st.code(), Code::kUnavailable) << st.to_string();
    EXPECT_NE(st.message().find("rank 1 (a-1 on node n-test, there:2) closed the connection"),
              std::string::npos)
        << st.message();
  }
}

TEST(CommThreads, MismatchedCollectivesAreReportedNotCorrupted) {
  Endpoints e(2);
  Joined j = join_group(e, "g");
  ASSERT_TRUE(j.ok());
  std::vector<Status> st(2);
  run_threads(2, [&](int r) {
    std::vector<float> x(64, 1.f), out(128);
    st[r] = r == 0 ? j.comms[r]->all_reduce_sum(x.data(), 64, DType::kF32, nullptr)
                   : j.comms[r]->all_gather(x.data(), 64, DType::kF32, out.data(), nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), Code::kFailedPrecondition) << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank " + std::to_string(1 - r) + " (a-"), std::string::npos);
  }
}

TEST(CommThreads, ClosedCommunicatorFailsItsPeerAtOnce) {
  Endpoints e(3);
  TcpCommOptions options;
  options.op_timeout = 60s;
  Joined j = join_group(e, "g", {}, 10s, options);
  ASSERT_TRUE(j.ok());
  std::vector<Status> st(3);
  const auto start = Clock::now();
  run_threads(3, [&](int r) {
    if (r == 2) {
      std::this_thread::sleep_for(200ms);
      j.comms[2].reset();  // its process "died": sockets closed
      return;
    }
    std::vector<float> x(1 << 20, 1.f);
    st[r] = j.comms[r]->all_reduce_sum(x.data(), 1 << 20, DType::kF32, nullptr);
  });
  EXPECT_LT(ms_since(start), 5000);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), Code::kUnavailable) << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank 2 (a-2 on node n-test, " + e.addresses[2] + ")"),
              std::string::npos)
        << st[r].message();
  }
}

// ---- ranks as processes -------------------------------------------------------------------

std::string check_everything(RankContext& c) {
  auto joined = c.endpoint->join("world", c.rank, make_peers(c.addresses), kSecret, 30s);
  if (!joined) return "join: " + joined.status().to_string();
  Communicator& comm = **joined;
  const int n = c.size;
  for (int64_t count : kSizes) {
    std::vector<float> x = inputs(c.rank, count);
    Status st = comm.all_reduce_sum(x.data(), count, DType::kF32, nullptr);
    if (!st) return "all_reduce: " + st.to_string();
    if (!same_bits(x.data(), reference_sum(n, count).data(), count * 4)) {
      return "all_reduce of " + std::to_string(count) + " floats differs from the reference";
    }
  }
  std::vector<float> in = inputs(c.rank, 333, 1), out(333 * n);
  if (Status st = comm.all_gather(in.data(), 333, DType::kF32, out.data(), nullptr); !st) {
    return "all_gather: " + st.to_string();
  }
  for (int p = 0; p < n; ++p) {
    if (!same_bits(out.data() + p * 333, inputs(p, 333, 1).data(), 333 * 4)) return "gathered";
  }
  // A ring of sends: rank r sends to r + 1 first (rank 0 receives last).
  std::vector<int32_t> token(1000, c.rank);
  const int next = (c.rank + 1) % n, prev = (c.rank + n - 1) % n;
  if (c.rank == 0) {
    if (!comm.send(token.data(), 4000, next, nullptr)) return "ring send";
    if (!comm.recv(token.data(), 4000, prev, nullptr)) return "ring recv";
  } else {
    if (!comm.recv(token.data(), 4000, prev, nullptr)) return "ring recv";
    for (int32_t& t : token) t += 1;
    if (!comm.send(token.data(), 4000, next, nullptr)) return "ring send";
  }
  if (c.rank == 0 && token[999] != n - 1) return "ring value " + std::to_string(token[999]);
  if (Status st = comm.barrier(); !st) return "barrier: " + st.to_string();
  return "ok";
}

class CommProcesses : public ::testing::TestWithParam<int> {};

TEST_P(CommProcesses, AllCollectives) {
  const int n = GetParam();
  RankProcesses procs(n, check_everything);
  for (int r = 0; r < n; ++r) EXPECT_EQ(procs.next_message(r, 120s), "ok") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommProcesses, ::testing::Values(2, 3, 4));

TEST(CommProcessFaults, KilledRankFailsTheOthersNamingIt) {
  const int n = 4;
  const int64_t count = 1 << 20;
  RankProcesses procs(n, [&](RankContext& c) -> std::string {
    TcpCommOptions options;
    options.op_timeout = 60s;  // a failure in seconds must come from seeing the peer die
    auto joined = c.endpoint->join("world", c.rank, make_peers(c.addresses), kSecret, 30s, options);
    if (!joined) return "join: " + joined.status().to_string();
    std::vector<float> x = inputs(c.rank, count);
    int64_t done = 0;
    for (;; ++done) {
      if (done == 3) c.say("looping");
      Status st = (*joined)->all_reduce_sum(x.data(), count, DType::kF32, nullptr);
      if (!st) {
        std::string report = "failed after " + std::to_string(done) + " ops: " + st.to_string();
        c.keep->push_back(std::move(*joined));  // stay open: only the killed rank closes
        return report;
      }
    }
  });
  for (int r = 0; r < n; ++r) ASSERT_EQ(procs.next_message(r, 60s), "looping") << r;
  std::this_thread::sleep_for(100ms);
  procs.kill(3);
  const auto killed = Clock::now();
  for (int r = 0; r < 3; ++r) {
    const std::string report = procs.next_message(r, 30s);
    std::printf("[ killed   ] rank %d, %lld ms after the kill: %s\n", r,
                static_cast<long long>(ms_since(killed)), report.c_str());
    EXPECT_LT(ms_since(killed), 10000) << report;
    EXPECT_NE(report.find("UNAVAILABLE"), std::string::npos) << report;
    EXPECT_NE(report.find("rank 3 (a-3 on node n-test, " + procs.addresses()[3] + ")"),
              std::string::npos)
        << report;
  }
}

TEST(CommProcessBench, AllReduceLoopback) {
  RankProcesses procs(2, [](RankContext& c) -> std::string {
    auto joined = c.endpoint->join("bench", c.rank, make_peers(c.addresses), kSecret, 30s);
    if (!joined) return "join: " + joined.status().to_string();
    Communicator& comm = **joined;
    std::string report = "ok";
    for (int64_t bytes : {int64_t{16} << 10, int64_t{16} << 20}) {
      const int64_t count = bytes / 4;
      const int iters = bytes < (1 << 20) ? 2000 : 30;
      std::vector<float> x(count, 0.5f);
      for (int i = 0; i < 3; ++i) (void)comm.all_reduce_sum(x.data(), count, DType::kF32, nullptr);
      std::vector<double> us;
      for (int i = 0; i < iters; ++i) {
        if (i % 100 == 0 && !comm.barrier()) return "barrier";
        const auto t0 = Clock::now();
        if (!comm.all_reduce_sum(x.data(), count, DType::kF32, nullptr)) return "all_reduce";
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      std::sort(us.begin(), us.end());
      char line[160];
      std::snprintf(line, sizeof line, " | %lld KiB: median %.1f us, p90 %.1f us (%.2f GB/s)",
                    static_cast<long long>(bytes >> 10), us[us.size() / 2], us[us.size() * 9 / 10],
                    static_cast<double>(bytes) / us[us.size() / 2] / 1e3);
      report += line;
    }
    return report;
  });
  const std::string r0 = procs.next_message(0, 120s);
  const std::string r1 = procs.next_message(1, 120s);
  EXPECT_EQ(r0.substr(0, 2), "ok") << r0;
  EXPECT_EQ(r1.substr(0, 2), "ok") << r1;
  std::printf("[ bench    ] all_reduce fp32, 2 processes on loopback, rank 0%s\n",
              r0.substr(2).c_str());
  RecordProperty("all_reduce_loopback", r0);
}

}  // namespace
}  // namespace tessera::comm
