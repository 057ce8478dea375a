// Multi-process tests of the custom all-reduce (kernels/cuda/custom_all_reduce.h). Every test forks
// its ranks BEFORE any CUDA call in this process (CUDA does not survive a fork: the parent never
// touches CUDA at all); each child makes its own context on GPU rank % device_count (ranks may
// share one GPU), and the children exchange IPC handles, barriers and results through pipes with
// the parent, which relays them in lockstep.
//
// Oracle: the CPU sums the ranks' inputs (as stored in the dtype) in fp32 in rank order 0..n-1 and
// rounds once to the dtype; every rank's output must equal it BIT FOR BIT, for both algorithms, and
// the ranks must agree (hashes exchanged). Inputs are deterministic pseudo-random values of mixed
// magnitudes (2^-10 .. 2^10), so a different summation order or an extra rounding shows.
//
// Tests: correctness (2 and 4 ranks; counts 1, 3, 1024, 4096, 65536, 1<<20; bf16/fp16/fp32; auto,
// one-shot and two-shot; in place; misaligned pointers), the same inside a CUDA graph (captured
// once, replayed 100 times with new inputs, eager calls interleaved), a peer that never calls
// (the others time out, report it and do not hang), argument validation, and a timing report
// (not asserted) at 8 KiB .. 8 MiB inside CUDA graphs.
//
// These tests need a GPU (scripts/gpu-check); without one every test fails. Ranks sharing one
// GPU are time-sliced, not concurrent: correct but slow, and their timings mean nothing.
#include "kernels/cuda/custom_all_reduce.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"

namespace tessera::cuda {
namespace {

using Clock = std::chrono::steady_clock;

// ---- pipes ----

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes; with a deadline (parent) polls, without one (child) blocks.
// "ok", "eof" or "timeout".
std::string read_all(int fd, void* data, size_t n, const Clock::time_point* deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (deadline != nullptr) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now());
      if (left.count() <= 0) return "timeout";
      pollfd pfd{fd, POLLIN, 0};
      const int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) continue;
    }
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return "eof";
    p += got;
    n -= static_cast<size_t>(got);
  }
  return "ok";
}

enum MsgKind : uint32_t { kExchange = 1, kDone = 2 };
struct MsgHeader {
  uint32_t kind;
  uint32_t unused;
  uint64_t len;
};

void put_string(std::string& out, const std::string& s) {
  const uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  out += s;
}

// Splits a sequence of put_string records.
std::vector<std::string> split_strings(const std::string& in) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + sizeof(uint64_t) <= in.size()) {
    uint64_t n;
    std::memcpy(&n, in.data() + at, sizeof(n));
    at += sizeof(n);
    out.push_back(in.substr(at, n));
    at += n;
  }
  return out;
}

// ---- one rank (a child process) ----

class Rank {
 public:
  Rank(int rank, int world, int to_parent, int from_parent)
      : rank_(rank), world_(world), to_parent_(to_parent), from_parent_(from_parent) {}

  int rank() const { return rank_; }
  int world() const { return world_; }

  // Every rank's `mine`, in rank order; every rank must call it the same number of times.
  std::vector<std::string> exchange(const std::string& mine) {
    send(kExchange, mine);
    uint64_t len = 0;
    if (read_all(from_parent_, &len, sizeof(len), nullptr) != "ok") {
      throw std::runtime_error("lost the parent during an exchange");
    }
    std::string body(len, '\0');
    if (len > 0 && read_all(from_parent_, body.data(), len, nullptr) != "ok") {
      throw std::runtime_error("lost the parent during an exchange");
    }
    std::vector<std::string> all = split_strings(body);
    if (all.size() != static_cast<size_t>(world_)) throw std::runtime_error("bad exchange reply");
    return all;
  }
  void barrier() { exchange(std::string()); }

  void fail(const std::string& what) {
    std::fprintf(stderr, "[rank %d] FAIL: %s\n", rank_, what.c_str());
    report_ += 'F';
    put_string(report_, what);
    ++failures_;
  }
  // A line the parent prints (rank 0's timing table, device placement, ...).
  void info(const std::string& what) {
    report_ += 'I';
    put_string(report_, what);
  }
  int failures() const { return failures_; }
  void finish() { send(kDone, report_); }

 private:
  void send(MsgKind kind, const std::string& payload) {
    MsgHeader h{kind, 0, payload.size()};
    if (!write_all(to_parent_, &h, sizeof(h)) ||
        !write_all(to_parent_, payload.data(), payload.size())) {
      _exit(3);  // the parent is gone
    }
  }

  int rank_;
  int world_;
  int to_parent_;
  int from_parent_;
  std::string report_;
  int failures_ = 0;
};

using RankBody = std::function<void(Rank&)>;

// The children of one run_ranks call: their pids and this process's ends of their pipes.
struct Children {
  std::vector<pid_t> pids;
  std::vector<int> to_child, from_child;
};

// In the child of rank `r`, just forked from `parent`: keeps its own pipe ends only, runs `body`,
// reports and exits (0 without failures, 1 with).
[[noreturn]] void run_child(int r, int world, pid_t parent,
                            const std::vector<std::array<int, 2>>& down,
                            const std::vector<std::array<int, 2>>& up, const RankBody& body) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) _exit(4);
  for (int q = 0; q < world; ++q) {
    const auto& d = down[static_cast<size_t>(q)];
    const auto& u = up[static_cast<size_t>(q)];
    ::close(d[1]);
    ::close(u[0]);
    if (q != r) {
      ::close(d[0]);
      ::close(u[1]);
    }
  }
  Rank ctx(r, world, up[static_cast<size_t>(r)][1], down[static_cast<size_t>(r)][0]);
  try {
    body(ctx);
  } catch (const std::exception& e) {
    ctx.fail(std::string("exception: ") + e.what());
  }
  ctx.finish();
  std::fflush(stderr);
  _exit(ctx.failures() == 0 ? 0 : 1);
}

// Makes a pipe each way per rank and forks `world` children running `body`. Leaves their pids
// and this process's pipe ends in `children`; false after a gtest failure (the children forked
// by then are killed).
bool fork_ranks(int world, const RankBody& body, Children& children) {
  std::vector<std::array<int, 2>> down(static_cast<size_t>(world)), up(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    if (::pipe(down[static_cast<size_t>(r)].data()) != 0 ||
        ::pipe(up[static_cast<size_t>(r)].data()) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      return false;
    }
  }
  const pid_t parent = ::getpid();
  std::vector<pid_t>& pids = children.pids;
  pids.assign(static_cast<size_t>(world), -1);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
      return false;
    }
    if (pid == 0) run_child(r, world, parent, down, up, body);
    pids[static_cast<size_t>(r)] = pid;
  }
  children.to_child.resize(static_cast<size_t>(world));
  children.from_child.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    ::close(down[static_cast<size_t>(r)][0]);
    ::close(up[static_cast<size_t>(r)][1]);
    children.to_child[static_cast<size_t>(r)] = down[static_cast<size_t>(r)][1];
    children.from_child[static_cast<size_t>(r)] = up[static_cast<size_t>(r)][0];
  }
  return true;
}

// One message (header and payload) from every rank in turn, each within `step_timeout_s`.
// "" or why the round failed.
std::string read_round(int world, const Children& children, int step_timeout_s, int round,
                       std::vector<MsgHeader>& headers, std::vector<std::string>& payloads) {
  for (int r = 0; r < world; ++r) {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(step_timeout_s);
    MsgHeader& h = headers[static_cast<size_t>(r)];
    const int from = children.from_child[static_cast<size_t>(r)];
    std::string st = read_all(from, &h, sizeof(h), &deadline);
    if (st == "ok") {
      payloads[static_cast<size_t>(r)].resize(h.len);
      if (h.len > 0) {
        st = read_all(from, payloads[static_cast<size_t>(r)].data(), h.len, &deadline);
      }
    }
    if (st == "timeout") {
      return "rank " + std::to_string(r) + " sent nothing for " + std::to_string(step_timeout_s) +
             " s in round " + std::to_string(round) + " (hung?)";
    }
    if (st != "ok") {
      return "rank " + std::to_string(r) + " exited without reporting in round " +
             std::to_string(round) + " (crashed?)";
    }
  }
  return "";
}

// Rank `r`'s final report, every rank done: its 'F' records are gtest failures, the rest info
// lines appended to `infos`.
void take_report(int r, int world, const std::string& rep, std::vector<std::string>& infos) {
  size_t at = 0;
  while (at + 1 + sizeof(uint64_t) <= rep.size()) {
    const char kind = rep[at];
    uint64_t n;
    std::memcpy(&n, rep.data() + at + 1, sizeof(n));
    const std::string text = rep.substr(at + 1 + sizeof(n), n);
    at += 1 + sizeof(n) + n;
    if (kind == 'F') {
      ADD_FAILURE() << "[rank " << r << " of " << world << "] " << text;
    } else {
      infos.push_back(text);
    }
  }
}

// Rank `r`'s report when it finished while others wait in an exchange (probably failed early):
// every record is a gtest failure.
void fail_early_report(int r, int world, const std::string& rep) {
  size_t at = 0;
  while (at + 1 + sizeof(uint64_t) <= rep.size()) {
    uint64_t n;
    std::memcpy(&n, rep.data() + at + 1, sizeof(n));
    ADD_FAILURE() << "[rank " << r << " of " << world << "] " << rep.substr(at + 1 + sizeof(n), n);
    at += 1 + sizeof(n) + n;
  }
}

// Relays the children's exchanges round by round, in lockstep, until every one is done (their
// info lines into `infos`). "" then, or why it stopped (a rank hung, crashed, went away or
// fell out of step).
std::string relay_rounds(int world, const Children& children, int step_timeout_s,
                         std::vector<std::string>& infos) {
  std::string abort_reason;
  int round = 0;
  while (abort_reason.empty()) {
    std::vector<MsgHeader> headers(static_cast<size_t>(world));
    std::vector<std::string> payloads(static_cast<size_t>(world));
    abort_reason = read_round(world, children, step_timeout_s, round, headers, payloads);
    if (!abort_reason.empty()) break;
    int done = 0;
    for (const MsgHeader& h : headers) done += h.kind == kDone ? 1 : 0;
    if (done == world) {
      for (int r = 0; r < world; ++r) {
        take_report(r, world, payloads[static_cast<size_t>(r)], infos);
      }
      break;
    }
    if (done != 0) {
      // Someone finished (probably failed early) while others wait in an exchange: report what
      // the finished ones said, then stop everyone.
      for (int r = 0; r < world; ++r) {
        if (headers[static_cast<size_t>(r)].kind != kDone) continue;
        fail_early_report(r, world, payloads[static_cast<size_t>(r)]);
      }
      abort_reason = "ranks out of step in round " + std::to_string(round) + ": " +
                     std::to_string(done) + " of " + std::to_string(world) + " finished";
      break;
    }
    std::string reply;
    for (const std::string& p : payloads) put_string(reply, p);
    const uint64_t len = reply.size();
    for (int r = 0; r < world; ++r) {
      if (!write_all(children.to_child[static_cast<size_t>(r)], &len, sizeof(len)) ||
          !write_all(children.to_child[static_cast<size_t>(r)], reply.data(), reply.size())) {
        abort_reason =
            "rank " + std::to_string(r) + " went away during round " + std::to_string(round);
        break;
      }
    }
    ++round;
  }
  return abort_reason;
}

// Waits (60 s at most, then SIGKILL) for every child to exit; an unexpected exit is a gtest
// failure unless the run was already aborted for `abort_reason`.
void reap(int world, const std::vector<pid_t>& pids, const std::string& abort_reason) {
  const Clock::time_point reap_deadline = Clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = pids[static_cast<size_t>(r)];
    int status = 0;
    pid_t got = 0;
    while ((got = ::waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < reap_deadline) {
      ::usleep(10000);
    }
    if (got == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "rank " << r << " did not exit after reporting; killed";
      continue;
    }
    // A rank that reported failures exits with 1: those failures are already listed.
    const bool reported = WIFEXITED(status) && WEXITSTATUS(status) == 1;
    if (abort_reason.empty() && !reported && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      ADD_FAILURE() << "rank " << r << " exited with "
                    << (WIFEXITED(status) ? "status " + std::to_string(WEXITSTATUS(status))
                                          : "signal " + std::to_string(WTERMSIG(status)));
    }
  }
}

// Forks `world` children running `body`, relays their exchanges and reports their failures as
// gtest failures. A child that exits early, falls out of step or stays silent for `step_timeout_s`
// fails the test and every child is killed (SIGKILL). Returns the info lines of every rank.
std::vector<std::string> run_ranks(int world, const RankBody& body, int step_timeout_s = 300) {
  ::signal(SIGPIPE, SIG_IGN);
  std::fflush(stdout);
  std::fflush(stderr);
  Children children;
  if (!fork_ranks(world, body, children)) return {};
  std::vector<std::string> infos;
  const std::string abort_reason = relay_rounds(world, children, step_timeout_s, infos);
  if (!abort_reason.empty()) {
    ADD_FAILURE() << abort_reason << "; killing all ranks";
    for (pid_t p : children.pids) ::kill(p, SIGKILL);
  }
  for (int r = 0; r < world; ++r) {
    ::close(children.to_child[static_cast<size_t>(r)]);
    ::close(children.from_child[static_cast<size_t>(r)]);
  }
  reap(world, children.pids, abort_reason);
  return infos;
}

// Number of CUDA devices, asked in a throwaway child (this process must stay CUDA-free).
int probe_device_count() {
  int count = 0;
  const std::vector<std::string> infos = run_ranks(1, [](Rank& ctx) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    if (ctx.rank() == 0) ctx.info(std::to_string(n));
  });
  if (!infos.empty()) count = std::atoi(infos[0].c_str());
  return count;
}

// ---- CUDA helpers (children only) ----

void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(err));
}

void check_ok(const Status& st, const std::string& what) {
  if (!st.is_ok()) throw std::runtime_error(what + ": " + st.to_string());
}

// Copies in the rank's own (non-blocking) stream: a plain cudaMemcpy runs on the legacy stream,
// which a non-blocking stream does not wait for, and may return before its DMA has landed.
void upload(void* dst, const std::vector<uint8_t>& host, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(dst, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
             "upload");
  check_cuda(cudaStreamSynchronize(stream), "upload");
}

void download(std::vector<uint8_t>& host, const void* src, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(host.data(), src, host.size(), cudaMemcpyDeviceToHost, stream),
             "download");
  check_cuda(cudaStreamSynchronize(stream), "download");
}

DeviceBuffer alloc(size_t bytes) {
  Expected<DeviceBuffer> b = DeviceBuffer::allocate(bytes, "test buffer");
  if (!b.has_value()) throw std::runtime_error(b.status().to_string());
  return std::move(b).value();
}

// One rank's communicator: picks GPU rank % device_count, creates, exchanges handles, opens.
struct RankComm {
  std::unique_ptr<CustomAllReduce> car;
  cudaStream_t stream = nullptr;
  int device = -1;
  int device_count = 0;
  bool shared_gpu = false;  // some GPU hosts more than one rank

  RankComm(Rank& ctx, const CustomAllReduceOptions& options) {
    check_cuda(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount");
    if (device_count < 1) throw std::runtime_error("no CUDA device");
    device = ctx.rank() % device_count;
    shared_gpu = ctx.world() > device_count;
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    Expected<std::unique_ptr<CustomAllReduce>> made =
        CustomAllReduce::create(ctx.rank(), ctx.world(), options);
    check_ok(made.status(), "CustomAllReduce::create");
    car = std::move(made).value();
    const std::vector<std::string> handles = ctx.exchange(car->handle());
    check_ok(car->open_peers(handles), "open_peers");
    ctx.info("rank " + std::to_string(ctx.rank()) + " of " + std::to_string(ctx.world()) +
             ": GPU " + std::to_string(device) + " (" + car->pci_bus_id() + "), pid " +
             std::to_string(::getpid()));
  }
  // Every rank must be done with the peers' memory before anyone frees its own.
  void teardown(Rank& ctx) {
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    ctx.barrier();
    car.reset();
    cudaStreamDestroy(stream);
  }
};

// ---- inputs and the CPU oracle ----

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank `rank`'s element i of the input named by `seed`: nonzero, magnitude 2^-10 .. 2^10.
float test_value(uint64_t seed, int rank, int64_t i) {
  const uint64_t h = splitmix64(seed * 0x100000001b3ull ^ (static_cast<uint64_t>(rank) << 56) ^
                                static_cast<uint64_t>(i));
  const double u = (static_cast<double>((h >> 40) & 0xffffffu) - 8388608.0 + 0.5) / 8388608.0;
  const int e = static_cast<int>((h >> 8) % 21) - 10;
  return static_cast<float>(std::ldexp(u, e));
}

uint32_t encode(DType d, float v) {
  switch (d) {
    case DType::kF32: {
      uint32_t b;
      std::memcpy(&b, &v, sizeof(b));
      return b;
    }
    case DType::kF16:
      return float_to_f16(v);
    case DType::kBF16:
      return float_to_bf16(v);
    case DType::kI32:
    case DType::kF8E4M3:
      break;  // not all-reduced
  }
  return 0;
}

float decode(DType d, uint32_t bits) {
  switch (d) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, &bits, sizeof(v));
      return v;
    }
    case DType::kF16:
      return f16_to_float(static_cast<uint16_t>(bits));
    case DType::kBF16:
      return bf16_to_float(static_cast<uint16_t>(bits));
    case DType::kI32:
    case DType::kF8E4M3:
      break;  // not all-reduced
  }
  return 0.0f;
}

void put_elem(std::vector<uint8_t>& buf, DType d, int64_t i, uint32_t bits) {
  const size_t es = dtype_size(d);
  if (es == 4) {
    std::memcpy(buf.data() + static_cast<size_t>(i) * es, &bits, 4);
  } else {
    const uint16_t h = static_cast<uint16_t>(bits);
    std::memcpy(buf.data() + static_cast<size_t>(i) * es, &h, 2);
  }
}

uint32_t get_elem(const std::vector<uint8_t>& buf, DType d, int64_t i) {
  const size_t es = dtype_size(d);
  if (es == 4) {
    uint32_t b;
    std::memcpy(&b, buf.data() + static_cast<size_t>(i) * es, 4);
    return b;
  }
  uint16_t h;
  std::memcpy(&h, buf.data() + static_cast<size_t>(i) * es, 2);
  return h;
}

std::vector<uint8_t> make_input(DType d, uint64_t seed, int rank, int64_t count) {
  std::vector<uint8_t> buf(static_cast<size_t>(count) * dtype_size(d));
  for (int64_t i = 0; i < count; ++i) put_elem(buf, d, i, encode(d, test_value(seed, rank, i)));
  return buf;
}

// acc = x_0; acc += x_1; ...; acc += x_{world-1} in fp32 (x_r as stored in d), rounded once to d.
std::vector<uint8_t> reference(DType d, uint64_t seed, int world, int64_t count) {
  std::vector<uint8_t> buf(static_cast<size_t>(count) * dtype_size(d));
  for (int64_t i = 0; i < count; ++i) {
    float acc = decode(d, encode(d, test_value(seed, 0, i)));
    for (int r = 1; r < world; ++r) acc += decode(d, encode(d, test_value(seed, r, i)));
    put_elem(buf, d, i, encode(d, acc));
  }
  return buf;
}

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// got[0, count) == want bit for bit; reports the first mismatches.
bool expect_bits(Rank& ctx, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                 DType d, int64_t count, const std::string& what) {
  int64_t bad = 0;
  std::ostringstream first;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t g = get_elem(got, d, i);
    const uint32_t w = get_elem(want, d, i);
    if (g == w) continue;
    if (bad < 3) {
      first << " [" << i << "] got 0x" << std::hex << g << " (" << decode(d, g) << ") want 0x" << w
            << " (" << decode(d, w) << ")" << std::dec;
    }
    ++bad;
  }
  if (bad == 0) return true;
  ctx.fail(what + ": " + std::to_string(bad) + " of " + std::to_string(count) +
           " elements differ from the rank-order fp32 reference;" + first.str());
  return false;
}

// ---- one all-reduce case, checked ----

struct Case {
  DType dtype = DType::kBF16;
  int64_t count = 0;
  AllReduceAlgo algo = AllReduceAlgo::kAuto;
  bool in_place = false;
  int64_t offset_elems = 0;  // in and out start this many elements past a 256-byte boundary
};

std::string describe(const Case& c, int world) {
  std::string s = std::string(dtype_name(c.dtype)) + " count " + std::to_string(c.count) + " " +
                  algo_name(c.algo) + " world " + std::to_string(world);
  if (c.in_place) s += " in place";
  if (c.offset_elems != 0) s += " offset " + std::to_string(c.offset_elems);
  return s;
}

constexpr uint8_t kGuard = 0xa5;
constexpr size_t kGuardBytes = 64;

// Runs one eager all-reduce of case `c` with inputs `seed` through buffers in_buf / out_buf
// (capacity: the largest case + 2 * kGuardBytes + 256). Returns the output hash ("" on failure).
std::string run_case(Rank& ctx, RankComm& s, const Case& c, uint64_t seed, DeviceBuffer& in_buf,
                     DeviceBuffer& out_buf) {
  const std::string what = describe(c, ctx.world());
  const size_t es = dtype_size(c.dtype);
  const size_t bytes = static_cast<size_t>(c.count) * es;
  const size_t off = static_cast<size_t>(c.offset_elems) * es;
  char* out = static_cast<char*>(out_buf.get()) + off;
  char* in = c.in_place ? out : static_cast<char*>(in_buf.get()) + off;

  const std::vector<uint8_t> input = make_input(c.dtype, seed, ctx.rank(), c.count);
  check_cuda(cudaMemsetAsync(out_buf.get(), kGuard, off + bytes + kGuardBytes, s.stream),
             "memset out");
  upload(in, input, s.stream);
  const Status st = s.car->all_reduce(in, out, c.count, c.dtype, s.stream, c.algo);
  if (!st.is_ok()) {
    ctx.fail(what + ": all_reduce returned " + st.to_string());
    return "";
  }
  check_cuda(cudaStreamSynchronize(s.stream), what + ": cudaStreamSynchronize");
  const Status health = s.car->health();
  if (!health.is_ok()) {
    ctx.fail(what + ": health() after the call: " + health.to_string());
    return "";
  }
  std::vector<uint8_t> got(bytes + kGuardBytes);
  download(got, out, s.stream);
  bool ok =
      expect_bits(ctx, got, reference(c.dtype, seed, ctx.world(), c.count), c.dtype, c.count, what);
  for (size_t i = bytes; i < got.size(); ++i) {
    if (got[i] != kGuard) {
      ctx.fail(what + ": byte " + std::to_string(i - bytes) + " past the end of out was written");
      ok = false;
      break;
    }
  }
  return ok ? std::to_string(fnv1a(got.data(), bytes)) : "";
}

// Every rank's hashes must be identical.
void expect_ranks_agree(Rank& ctx, const std::string& hashes, const std::string& what) {
  const std::vector<std::string> all = ctx.exchange(hashes);
  for (int r = 0; r < ctx.world(); ++r) {
    if (all[static_cast<size_t>(r)] != hashes) {
      ctx.fail(what + ": rank " + std::to_string(r) + "'s outputs differ from rank " +
               std::to_string(ctx.rank()) + "'s");
    }
  }
}

constexpr DType kDTypes[] = {DType::kBF16, DType::kF16, DType::kF32};
constexpr int64_t kCounts[] = {1, 3, 1024, 4096, 65536, 1 << 20};
constexpr AllReduceAlgo kAlgos[] = {AllReduceAlgo::kAuto, AllReduceAlgo::kOneShot,
                                    AllReduceAlgo::kTwoShot};

void correctness_body(Rank& ctx) {
  CustomAllReduceOptions opt;
  opt.max_bytes = 4 << 20;  // 1<<20 fp32
  opt.timeout_ms = 60000;   // generous: time-sliced ranks on one GPU are slow, not dead
  RankComm s(ctx, opt);
  const size_t cap = static_cast<size_t>(opt.max_bytes) + 2 * kGuardBytes + 256;
  DeviceBuffer in_buf = alloc(cap);
  DeviceBuffer out_buf = alloc(cap);

  std::vector<Case> cases;
  for (DType d : kDTypes) {
    for (int64_t n : kCounts) {
      for (AllReduceAlgo a : kAlgos) cases.push_back({d, n, a, false, 0});
    }
  }
  for (AllReduceAlgo a : {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
    cases.push_back({DType::kBF16, 4096 + 3, a, true, 0});  // in place
    cases.push_back({DType::kF32, 1000, a, true, 0});
    cases.push_back({DType::kBF16, 1000, a, false, 1});  // not 16-byte aligned
    cases.push_back({DType::kF16, 65536 + 5, a, false, 3});
    cases.push_back({DType::kF32, 777, a, false, 1});
  }
  std::string hashes;
  uint64_t seed = 1;
  for (const Case& c : cases) hashes += run_case(ctx, s, c, seed++, in_buf, out_buf) + ",";
  expect_ranks_agree(ctx, hashes, "eager cases");
  s.teardown(ctx);
}

TEST(CustomAllReduce, TwoRanksMatchRankOrderReferenceBitForBit) { run_ranks(2, correctness_body); }

TEST(CustomAllReduce, FourRanksMatchRankOrderReferenceBitForBit) { run_ranks(4, correctness_body); }

// ---- CUDA graph: capture once, replay 100 times with new inputs ----

void graph_body(Rank& ctx) {
  CustomAllReduceOptions opt;
  opt.max_bytes = 1 << 20;
  opt.timeout_ms = 60000;
  RankComm s(ctx, opt);
  struct Slot {
    Case c;
    DeviceBuffer in, out;
  };
  std::vector<Slot> slots;
  slots.push_back({{DType::kBF16, 4096, AllReduceAlgo::kAuto, false, 0}, {}, {}});  // 8 KiB
  slots.push_back({{DType::kF32, 1 << 18, AllReduceAlgo::kTwoShot, false, 0}, {}, {}});
  slots.push_back({{DType::kF16, 3, AllReduceAlgo::kAuto, true, 0}, {}, {}});  // in place
  slots.push_back({{DType::kBF16, 20000, AllReduceAlgo::kOneShot, false, 0}, {}, {}});
  for (Slot& sl : slots) {
    const size_t bytes = static_cast<size_t>(sl.c.count) * dtype_size(sl.c.dtype);
    sl.in = alloc(bytes);
    sl.out = alloc(bytes);
  }
  auto out_ptr = [](Slot& sl) { return sl.out.get(); };
  auto in_ptr = [](Slot& sl) { return sl.c.in_place ? sl.out.get() : sl.in.get(); };

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (Slot& sl : slots) {
    const Status st =
        s.car->all_reduce(in_ptr(sl), out_ptr(sl), sl.c.count, sl.c.dtype, s.stream, sl.c.algo);
    if (!st.is_ok()) ctx.fail("all_reduce during capture: " + st.to_string());
  }
  check_cuda(cudaStreamEndCapture(s.stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");

  DeviceBuffer eager_in = alloc(4096 * 2 + kGuardBytes * 2 + 256);
  DeviceBuffer eager_out = alloc(4096 * 2 + kGuardBytes * 2 + 256);
  std::string hashes;
  constexpr int kReplays = 100;
  for (int it = 0; it < kReplays && ctx.failures() < 5; ++it) {
    std::vector<uint64_t> seeds;
    for (size_t k = 0; k < slots.size(); ++k) {
      Slot& sl = slots[k];
      seeds.push_back(100000 + static_cast<uint64_t>(it) * 16 + k);
      const std::vector<uint8_t> input =
          make_input(sl.c.dtype, seeds.back(), ctx.rank(), sl.c.count);
      upload(in_ptr(sl), input, s.stream);
    }
    check_cuda(cudaGraphLaunch(exec, s.stream), "cudaGraphLaunch");
    check_cuda(cudaStreamSynchronize(s.stream), "replay " + std::to_string(it));
    const Status health = s.car->health();
    if (!health.is_ok()) {
      ctx.fail("replay " + std::to_string(it) + ": " + health.to_string());
      break;
    }
    for (size_t k = 0; k < slots.size(); ++k) {
      Slot& sl = slots[k];
      const size_t bytes = static_cast<size_t>(sl.c.count) * dtype_size(sl.c.dtype);
      std::vector<uint8_t> got(bytes);
      download(got, out_ptr(sl), s.stream);
      expect_bits(ctx, got, reference(sl.c.dtype, seeds[k], ctx.world(), sl.c.count), sl.c.dtype,
                  sl.c.count,
                  "graph replay " + std::to_string(it) + ", " + describe(sl.c, ctx.world()));
      hashes += std::to_string(fnv1a(got.data(), bytes)) + ",";
    }
    // Eager calls between replays share the epoch sequence with the graph's kernels.
    if (it % 10 == 9) {
      const Case c{DType::kBF16, 4096,
                   it % 20 == 9 ? AllReduceAlgo::kTwoShot : AllReduceAlgo::kOneShot, false, 0};
      hashes += run_case(ctx, s, c, 900000 + static_cast<uint64_t>(it), eager_in, eager_out) + ",";
    }
  }
  expect_ranks_agree(ctx, hashes, "graph replays");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  s.teardown(ctx);
}

TEST(CustomAllReduce, TwoRanksCudaGraphReplays) { run_ranks(2, graph_body); }

// ---- the all-reduce fused with the residual add and RMSNorm ----

// all_reduce_add_rms_norm against all_reduce followed by cuda::add_rms_norm (whose bits the
// elementwise tests hold to the CPU reference), bit for bit: out, residual, and `in` left as it
// was; every rank the same bits; rows past the grid (64 > 48 blocks) and the norm's vector
// shapes 1, 2, 4 and 8 (hidden 8 .. 32768); out aliasing in; the fused and plain calls mixed in
// one sequence (each is one call of the protocol); inside a CUDA graph too. Then the refusals.
void fused_norm_body(Rank& ctx) {
  CustomAllReduceOptions opt;
  opt.max_bytes = 1 << 20;
  opt.timeout_ms = 60000;
  RankComm s(ctx, opt);
  struct Shape {
    int64_t rows, hidden;
  };
  constexpr Shape kShapes[] = {{1, 4096}, {1, 2048},  {3, 8},     {5, 5120}, {64, 4096},
                               {2, 8192}, {1, 16384}, {1, 32768}, {49, 1024}};
  constexpr float kEps = 1e-6f;
  const size_t cap = static_cast<size_t>(opt.max_bytes);
  DeviceBuffer in = alloc(cap), sum = alloc(cap), res_want = alloc(cap), res_got = alloc(cap),
               out_want = alloc(cap), out_got = alloc(cap), weight = alloc(32768 * 2);
  std::string hashes;
  uint64_t seed = 500;
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (const Shape& sh : kShapes) {
      for (int mode = 0; mode < 3; ++mode) {  // 0 eager, 1 out aliasing in, 2 in a CUDA graph
        const int64_t n = sh.rows * sh.hidden;
        const size_t bytes = static_cast<size_t>(n) * dtype_size(d);
        const std::string what = std::string(dtype_name(d)) + " " + std::to_string(sh.rows) +
                                 " x " + std::to_string(sh.hidden) +
                                 (mode == 1   ? " out = in"
                                  : mode == 2 ? " graph"
                                              : "");
        ++seed;
        const std::vector<uint8_t> x = make_input(d, seed, ctx.rank(), n);
        const std::vector<uint8_t> residual = make_input(d, seed + 7777, 0, n);  // every rank's
        std::vector<uint8_t> w = make_input(d, seed + 9999, 0, sh.hidden);
        upload(weight.get(), w, s.stream);
        // The oracle: all_reduce, then add_rms_norm.
        upload(in.get(), x, s.stream);
        upload(res_want.get(), residual, s.stream);
        check_ok(s.car->all_reduce(in.get(), sum.get(), n, d, s.stream), what + ": all_reduce");
        check_ok(add_rms_norm(d, sum.get(), res_want.get(), weight.get(), sh.rows, sh.hidden, kEps,
                              out_want.get(), s.stream),
                 what + ": add_rms_norm");
        // The fused call.
        upload(res_got.get(), residual, s.stream);
        void* out = mode == 1 ? in.get() : out_got.get();
        const auto fused = [&] {
          return s.car->all_reduce_add_rms_norm(in.get(), res_got.get(), weight.get(), sh.rows,
                                                sh.hidden, kEps, out, d, s.stream);
        };
        if (mode == 2) {
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          check_cuda(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), "capture");
          const Status st = fused();
          check_cuda(cudaStreamEndCapture(s.stream, &graph), "end capture");
          check_ok(st, what + ": all_reduce_add_rms_norm (captured)");
          check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
          check_cuda(cudaGraphLaunch(exec, s.stream), "launch");
          check_cuda(cudaStreamSynchronize(s.stream), "graph");
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
        } else {
          check_ok(fused(), what + ": all_reduce_add_rms_norm");
        }
        check_cuda(cudaStreamSynchronize(s.stream), what + ": cudaStreamSynchronize");
        check_ok(s.car->health(), what + ": health");
        std::vector<uint8_t> want(bytes), got(bytes), rw(bytes), rg(bytes), x_after(bytes);
        download(want, out_want.get(), s.stream);
        download(got, out, s.stream);
        download(rw, res_want.get(), s.stream);
        download(rg, res_got.get(), s.stream);
        bool ok = expect_bits(ctx, got, want, d, n, what + ": out");
        ok = expect_bits(ctx, rg, rw, d, n, what + ": residual") && ok;
        if (mode != 1) {
          download(x_after, in.get(), s.stream);
          if (x_after != x) {
            ctx.fail(what + ": in was changed");
            ok = false;
          }
        }
        hashes += ok ? std::to_string(fnv1a(got.data(), bytes) ^ fnv1a(rg.data(), bytes)) : "";
        hashes += ",";
      }
    }
  }
  expect_ranks_agree(ctx, hashes, "fused cases");
  // Refusals (host-side: nothing is launched, so every rank makes them alike).
  auto refuses = [&](const Status& st, const std::string& what) {
    if (st.code() != Code::kInvalidArgument) {
      ctx.fail(what + ": expected INVALID_ARGUMENT, got " + st.to_string());
    }
  };
  void* p = in.get();
  void* r = res_got.get();
  void* o = out_got.get();
  const void* wt = weight.get();
  refuses(s.car->all_reduce_add_rms_norm(p, r, wt, 1, 12, kEps, o, DType::kBF16, s.stream),
          "hidden not a multiple of 8");
  refuses(s.car->all_reduce_add_rms_norm(p, r, wt, 1, 65536, kEps, o, DType::kBF16, s.stream),
          "hidden past 32768");
  refuses(s.car->all_reduce_add_rms_norm(p, r, wt, 1, 4096, kEps, o, DType::kF32, s.stream),
          "fp32");
  refuses(s.car->all_reduce_add_rms_norm(p, r, wt, 129, 4096, kEps, o, DType::kBF16, s.stream),
          "past max_bytes");
  refuses(s.car->all_reduce_add_rms_norm(p, p, wt, 1, 4096, kEps, o, DType::kBF16, s.stream),
          "residual aliasing in");
  refuses(s.car->all_reduce_add_rms_norm(static_cast<char*>(p) + 2, r, wt, 1, 4096, kEps, o,
                                         DType::kBF16, s.stream),
          "misaligned in");
  if (s.car->fuses_add_rms_norm(4096, DType::kF32) ||
      !s.car->fuses_add_rms_norm(4096, DType::kBF16)) {
    ctx.fail("fuses_add_rms_norm disagrees with the refusals");
  }
  s.teardown(ctx);
}

TEST(CustomAllReduce, TwoRanksFusedAddRmsNormGivesAllReduceThenAddRmsNormBits) {
  run_ranks(2, fused_norm_body);
}

TEST(CustomAllReduce, FourRanksFusedAddRmsNormGivesAllReduceThenAddRmsNormBits) {
  run_ranks(4, fused_norm_body);
}

TEST(CustomAllReduce, FourRanksCudaGraphReplays) { run_ranks(4, graph_body); }

// ---- a peer that never calls: the others time out, report it, and do not hang ----

constexpr int64_t kSilentTimeoutMs = 1000;

void silent_peer_body(Rank& ctx) {
  CustomAllReduceOptions opt;
  opt.max_bytes = 1 << 20;
  opt.timeout_ms = kSilentTimeoutMs;
  RankComm s(ctx, opt);
  DeviceBuffer buf = alloc(8192);
  check_cuda(cudaMemset(buf.get(), 0, 8192), "memset");
  check_cuda(cudaDeviceSynchronize(), "sync");
  ctx.barrier();
  if (ctx.rank() != 2) {  // rank 2 stays alive and never calls all_reduce
    // A graph captured before the failure, replayed after it.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    check_cuda(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), "capture");
    check_ok(s.car->all_reduce(buf.get(), buf.get(), 4096, DType::kBF16, s.stream), "capture");
    check_cuda(cudaStreamEndCapture(s.stream, &graph), "end capture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

    const Clock::time_point t0 = Clock::now();
    const Status st = s.car->all_reduce(buf.get(), buf.get(), 4096, DType::kBF16, s.stream);
    if (!st.is_ok()) ctx.fail("the first all_reduce should enqueue fine: " + st.to_string());
    check_cuda(cudaStreamSynchronize(s.stream), "cudaStreamSynchronize after the timeout");
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const Status health = s.car->health();
    if (health.code() != Code::kDeadlineExceeded) {
      ctx.fail("health() should be DEADLINE_EXCEEDED, got " + health.to_string());
    } else if (health.message().find("rank 2 (") == std::string::npos) {
      ctx.fail("the timeout should name rank 2: " + health.message());
    }
    if (secs < 0.9 * kSilentTimeoutMs / 1000.0 || secs > 30.0) {
      ctx.fail("the kernel ended after " + std::to_string(secs) + " s; expected about " +
               std::to_string(kSilentTimeoutMs / 1000.0) + " s");
    }
    ctx.info("rank " + std::to_string(ctx.rank()) + " returned after " + std::to_string(secs) +
             " s: " + health.to_string());

    // Sticky: the next call is refused without launching, and a replay returns at once.
    const Clock::time_point t1 = Clock::now();
    const Status again = s.car->all_reduce(buf.get(), buf.get(), 4096, DType::kBF16, s.stream);
    if (again.code() != Code::kDeadlineExceeded) {
      ctx.fail("all_reduce after a timeout should return DEADLINE_EXCEEDED, got " +
               again.to_string());
    }
    check_cuda(cudaGraphLaunch(exec, s.stream), "replay after the timeout");
    check_cuda(cudaStreamSynchronize(s.stream), "replay after the timeout");
    const double after = std::chrono::duration<double>(Clock::now() - t1).count();
    if (after > 0.5) {
      ctx.fail("after a timeout, all_reduce and graph replays should return at once; took " +
               std::to_string(after) + " s");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  s.teardown(ctx);
}

TEST(CustomAllReduce, SilentPeerMakesOthersTimeOutAndReport) {
  run_ranks(3, silent_peer_body, 120);
}

// ---- argument validation ----

TEST(CustomAllReduce, RejectsBadArguments) {
  run_ranks(2, [](Rank& ctx) {
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    auto expect_code = [&](const Status& st, Code code, const std::string& what) {
      if (st.code() != code) {
        ctx.fail(what + ": expected " + std::string(code_name(code)) + ", got " + st.to_string());
      }
    };
    expect_code(CustomAllReduce::create(0, 1, {}).status(), Code::kInvalidArgument, "world 1");
    expect_code(CustomAllReduce::create(0, 9, {}).status(), Code::kInvalidArgument, "world 9");
    expect_code(CustomAllReduce::create(2, 2, {}).status(), Code::kInvalidArgument, "rank 2 of 2");
    CustomAllReduceOptions bad;
    bad.max_bytes = 0;
    expect_code(CustomAllReduce::create(0, 2, bad).status(), Code::kInvalidArgument, "max_bytes 0");
    bad = {};
    bad.timeout_ms = 0;
    expect_code(CustomAllReduce::create(0, 2, bad).status(), Code::kInvalidArgument, "timeout 0");

    CustomAllReduceOptions opt;
    opt.max_bytes = 64 << 10;
    Expected<std::unique_ptr<CustomAllReduce>> made = CustomAllReduce::create(ctx.rank(), 2, opt);
    check_ok(made.status(), "create");
    std::unique_ptr<CustomAllReduce> car = std::move(made).value();
    DeviceBuffer buf = alloc(1 << 20);
    expect_code(car->all_reduce(buf.get(), buf.get(), 16, DType::kBF16, nullptr),
                Code::kFailedPrecondition, "all_reduce before open_peers");
    expect_code(car->open_peers({car->handle()}), Code::kInvalidArgument, "one handle for two");
    expect_code(car->open_peers({"garbage", "garbage"}), Code::kInvalidArgument, "garbage");
    const std::vector<std::string> handles = ctx.exchange(car->handle());
    expect_code(car->open_peers({handles[1], handles[0]}), Code::kInvalidArgument, "swapped");
    std::vector<std::string> own_twice = {car->handle(), car->handle()};
    expect_code(car->open_peers(own_twice), Code::kInvalidArgument, "own handle for the peer");
    check_ok(car->open_peers(handles), "open_peers");
    expect_code(car->open_peers(handles), Code::kFailedPrecondition, "open_peers twice");
    char* p = static_cast<char*>(buf.get());
    expect_code(car->all_reduce(p, p, (64 << 10) / 2 + 1, DType::kBF16, nullptr),
                Code::kInvalidArgument, "over max_bytes");
    expect_code(car->all_reduce(p, p, -1, DType::kBF16, nullptr), Code::kInvalidArgument,
                "negative count");
    expect_code(car->all_reduce(p + 1, p + 1, 4, DType::kBF16, nullptr), Code::kInvalidArgument,
                "misaligned element");
    expect_code(car->all_reduce(p, p + 2, 16, DType::kBF16, nullptr), Code::kInvalidArgument,
                "partial overlap");
    expect_code(car->all_reduce(nullptr, p, 16, DType::kBF16, nullptr), Code::kInvalidArgument,
                "null in");
    expect_code(car->all_reduce(p, p, 0, DType::kBF16, nullptr), Code::kOk, "count 0");
    if (car->choose(8192) != AllReduceAlgo::kOneShot) ctx.fail("8 KiB should be one-shot");
    if (car->choose(8 << 20) != AllReduceAlgo::kTwoShot) ctx.fail("8 MiB should be two-shot");
    ctx.barrier();
  });
}

// ---- timing report (not asserted, but for NCCL's bits) ----

// NCCL's communicator over the ranks (one GPU each): rank 0's unique id through the parent.
struct NcclComm {
  ncclComm_t comm = nullptr;
  explicit NcclComm(Rank& ctx) {
    ncclUniqueId id;
    std::string mine;
    if (ctx.rank() == 0) {
      if (ncclGetUniqueId(&id) != ncclSuccess) throw std::runtime_error("ncclGetUniqueId");
      mine.assign(reinterpret_cast<const char*>(&id), sizeof(id));
    }
    const std::string root = ctx.exchange(mine)[0];
    if (root.size() != sizeof(id)) throw std::runtime_error("bad NCCL id");
    std::memcpy(&id, root.data(), sizeof(id));
    const ncclResult_t r = ncclCommInitRank(&comm, ctx.world(), id, ctx.rank());
    if (r != ncclSuccess) {
      throw std::runtime_error(std::string("ncclCommInitRank: ") + ncclGetErrorString(r));
    }
  }
  ~NcclComm() {
    if (comm != nullptr) ncclCommDestroy(comm);
  }
};

void timing_body(Rank& ctx) {
  CustomAllReduceOptions opt;
  opt.max_bytes = 8 << 20;
  opt.timeout_ms = 60000;
  RankComm s(ctx, opt);
  constexpr int64_t kSizes[] = {8 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20};
  constexpr int64_t kHidden = 4096;  // the fused rows' width (Llama-3-8B's)
  constexpr int kCallsPerGraph = 20;
  const int replays = s.shared_gpu ? 3 : 25;
  // NCCL refuses two ranks on one GPU: its columns need a GPU per rank.
  std::unique_ptr<NcclComm> nccl;
  if (!s.shared_gpu) nccl = std::make_unique<NcclComm>(ctx);
  DeviceBuffer in = alloc(8 << 20);
  DeviceBuffer out = alloc(8 << 20);
  DeviceBuffer out2 = alloc(8 << 20);
  DeviceBuffer residual = alloc(8 << 20);
  DeviceBuffer weight = alloc(kHidden * 2);
  // bf16 ~ 0.0115 everywhere (rank-dependent below for NCCL's bits); the residual stays finite
  // however many adds the replays make
  check_cuda(cudaMemsetAsync(in.get(), 0x3c, 8 << 20, s.stream), "memset");
  check_cuda(cudaMemsetAsync(residual.get(), 0, 8 << 20, s.stream), "memset");
  check_cuda(cudaMemsetAsync(weight.get(), 0x3f, kHidden * 2, s.stream), "memset");
  check_cuda(cudaStreamSynchronize(s.stream), "memset");
  cudaEvent_t t0, t1;
  check_cuda(cudaEventCreate(&t0), "cudaEventCreate");
  check_cuda(cudaEventCreate(&t1), "cudaEventCreate");
  // us per call of `call` (max over ranks), kCallsPerGraph of them captured in one graph.
  const auto time_graph = [&](const std::function<Status()>& call, const std::string& what) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    check_cuda(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), "capture");
    for (int i = 0; i < kCallsPerGraph; ++i) check_ok(call(), what);
    check_cuda(cudaStreamEndCapture(s.stream, &graph), "end capture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int w = 0; w < 2; ++w) check_cuda(cudaGraphLaunch(exec, s.stream), "warm-up");
    check_cuda(cudaStreamSynchronize(s.stream), "warm-up");
    ctx.barrier();
    check_cuda(cudaEventRecord(t0, s.stream), "record");
    for (int r = 0; r < replays; ++r) check_cuda(cudaGraphLaunch(exec, s.stream), "launch");
    check_cuda(cudaEventRecord(t1, s.stream), "record");
    check_cuda(cudaEventSynchronize(t1), "sync");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
    check_ok(s.car->health(), "health");
    double mine = 1000.0 * ms / (replays * kCallsPerGraph);
    for (const std::string& v : ctx.exchange(std::to_string(mine))) {
      mine = std::max(mine, std::atof(v.c_str()));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return mine;
  };
  const auto nccl_sum = [&](void* o, int64_t count) -> Status {
    const ncclResult_t r = ncclAllReduce(in.get(), o, static_cast<size_t>(count), ncclBfloat16,
                                         ncclSum, nccl->comm, s.stream);
    return r == ncclSuccess ? Status::ok() : internal_error(ncclGetErrorString(r));
  };

  std::ostringstream table;
  table << "custom all-reduce, bf16, " << ctx.world() << " ranks on "
        << (s.shared_gpu ? "SHARED GPUs (time-sliced: these figures are meaningless; no NCCL)"
                         : "distinct GPUs")
        << ", inside a CUDA graph of " << kCallsPerGraph << " back-to-back calls, us per call "
        << "(max over ranks); '+ norm': then add_rms_norm of rows of " << kHidden
        << " (two kernels), 'fused': all_reduce_add_rms_norm (one):\n";
  char line[256];
  std::snprintf(line, sizeof(line), "  %10s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "bytes",
                "one-shot", "two-shot", "auto", "auto algo", "+ norm", "fused", "NCCL", "NCCL/auto",
                "busbw");
  table << line;
  for (int64_t bytes : kSizes) {
    const int64_t count = bytes / 2, rows = count / kHidden;
    double us[3] = {0, 0, 0};
    for (int k = 0; k < 3; ++k) {
      us[k] = time_graph(
          [&] {
            return s.car->all_reduce(in.get(), out.get(), count, DType::kBF16, s.stream, kAlgos[k]);
          },
          "all_reduce");
    }
    const double plus_norm = time_graph(
        [&] {
          Status st = s.car->all_reduce(in.get(), out.get(), count, DType::kBF16, s.stream);
          if (!st.is_ok()) return st;
          return add_rms_norm(DType::kBF16, out.get(), residual.get(), weight.get(), rows, kHidden,
                              1e-6f, out2.get(), s.stream);
        },
        "all_reduce + add_rms_norm");
    const double fused = time_graph(
        [&] {
          return s.car->all_reduce_add_rms_norm(in.get(), residual.get(), weight.get(), rows,
                                                kHidden, 1e-6f, out2.get(), DType::kBF16, s.stream);
        },
        "all_reduce_add_rms_norm");
    double nccl_us = 0;
    if (nccl) nccl_us = time_graph([&] { return nccl_sum(out.get(), count); }, "ncclAllReduce");
    // us[k] is kAlgos[k]: auto, one-shot, two-shot. Bus bandwidth as nccl-tests counts it.
    const double busbw =
        static_cast<double>(bytes) / (us[0] * 1e-6) * 2.0 * (ctx.world() - 1) / ctx.world() / 1e9;
    char nccl_text[2][16] = {"-", "-"};
    if (nccl) {
      std::snprintf(nccl_text[0], sizeof(nccl_text[0]), "%.2f", nccl_us);
      std::snprintf(nccl_text[1], sizeof(nccl_text[1]), "%.2f", nccl_us / us[0]);
    }
    std::snprintf(
        line, sizeof(line), "  %10lld %9.2f %9.2f %9.2f %9s %9.2f %9.2f %9s %9s %5.1f GB/s\n",
        static_cast<long long>(bytes), us[1], us[2], us[0], algo_name(s.car->choose(bytes)),
        plus_norm, fused, nccl_text[0], nccl_text[1], busbw);
    table << line;
  }
  table << "  target: <= 5 us at 8 KiB fused";
  // NCCL's bits against the custom all-reduce's on rank-dependent inputs: at 2 ranks both are
  // one fp32 add rounded once (a + b = b + a), so they must agree exactly; at more ranks NCCL's
  // order is its ring's, so the table shows how many elements differ.
  if (nccl) {
    for (int64_t bytes : kSizes) {
      const int64_t count = bytes / 2;
      upload(in.get(),
             make_input(DType::kBF16, 4242 + static_cast<uint64_t>(bytes), ctx.rank(), count),
             s.stream);
      check_ok(s.car->all_reduce(in.get(), out.get(), count, DType::kBF16, s.stream), "all_reduce");
      check_ok(nccl_sum(out2.get(), count), "ncclAllReduce");
      std::vector<uint8_t> a(static_cast<size_t>(bytes)), b(static_cast<size_t>(bytes));
      download(a, out.get(), s.stream);
      download(b, out2.get(), s.stream);
      int64_t differ = 0;
      for (int64_t i = 0; i < count; ++i)
        differ += get_elem(a, DType::kBF16, i) != get_elem(b, DType::kBF16, i);
      table << "\n  NCCL vs custom at " << bytes << " bytes: " << differ << " of " << count
            << " elements differ";
      if (ctx.world() == 2 && differ != 0) {
        ctx.fail("NCCL and the custom all-reduce differ at 2 ranks (" + std::to_string(differ) +
                 " of " + std::to_string(count) + " elements at " + std::to_string(bytes) +
                 " bytes): both should round one fp32 add");
      }
    }
  }
  if (ctx.rank() == 0) ctx.info(table.str());
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  nccl.reset();
  s.teardown(ctx);
}

TEST(CustomAllReduce, TimingReport) {
  const int devices = probe_device_count();
  ASSERT_GT(devices, 0) << "no usable CUDA device: the CUDA kernel tests only run on a GPU "
                           "machine (scripts/gpu-check)";
  std::vector<int> worlds = {2};
  for (int w : {4, 8}) {
    if (w <= devices) worlds.push_back(w);
  }
  for (int w : worlds) {
    for (const std::string& line : run_ranks(w, timing_body)) std::cout << line << "\n";
  }
}

}  // namespace
}  // namespace tessera::cuda
