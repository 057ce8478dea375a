// GPU sampler: see sampling.h. One CTA per row for every kernel; the per-row work is
//
//   logprobs_kernel  raw log-sum-exp and the top N raw logits (radix select, then a rank sort)
//   penalty_kernel   repetition / frequency / presence penalties over the row's id lists
//   argmax_kernel    greedy rows (and GpuSampler::argmax)
//   sample_kernel    temperature, min_p, top_k, top_p (radix selects) and the Philox draw
//   finalize_kernel  the sampled token's raw logprob
//
// Ranking. A logit x is ranked by the order-preserving uint32 "key" of its fp32 bits (NaN read as
// -inf, -0 as +0), ties by lower token id. Every filter keeps a prefix of that ranking, written
// as a Cut {key, id}: token v with key k is kept iff k > cut.key or (k == cut.key and v <=
// cut.id). A cut is found by a radix select over the keys (3 passes of 11 / 11 / 10 bits, a
// shared-memory histogram per pass over the whole row): "keep the token at rank r iff the weight
// ranked strictly above it is < theta" with weight 1 and theta = k for top-k (and the top N
// logprobs), and weight exp(x - max) and theta = top_p * total for top-p. The pass finds the
// lowest bin whose weight strictly above is < theta, descends into it, and at the last pass the
// bin is a single key: the tie group there is cut by id (the n-th lowest id of the group, found by
// a block-wide prefix count over ids).
//
// Weights are fixed point (exp(x - max) * 2^s in a uint64, s chosen from the vocabulary size so
// that a row's total never overflows): sums are exact and independent of the order of the
// atomics, so a row's draw is deterministic and independent of the batch.
#include "kernels/cuda/sampling.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace tessera::cuda {

namespace {

using u64 = unsigned long long;
static_assert(sizeof(u64) == 8);

constexpr int kThreads = 1024;  // threads of the per-row kernels (sample, logprobs, argmax)
constexpr int kWarps = kThreads / 32;
static_assert(kThreads % 32 == 0 && kWarps <= 32 && kThreads <= 1024);
constexpr int kSmallThreads = 256;  // penalty and finalize kernels
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kSamplingEps = 1e-5f;         // vLLM's _SAMPLING_EPS: below it, greedy
constexpr uint32_t kNegInfKey = 0x007fffffu;  // float_key(-inf)
constexpr int32_t kPromptBit = 1 << 30;       // counts[] flag: the id is in the prompt
constexpr int kMaxBins = 2048;
static_assert(kThreads <= kMaxBins / 2);  // every radix pass has at least one bin per thread

// Row flags.
constexpr uint32_t kGreedy = 1;
constexpr uint32_t kPenalised = 2;

// Row status written by the kernels.
constexpr int32_t kRowOk = 0;
constexpr int32_t kRowNoFiniteLogit = 1;
constexpr int32_t kRowInternal = 2;

// One row's parameters on the device (uploaded every step).
struct RowParams {
  float temperature;
  float top_p;
  float min_p;
  float repetition;
  float presence;
  float frequency;
  int32_t top_k;       // 0: off (also when >= vocab)
  int32_t logprobs;    // -1: off, else the number of top logprobs, at most vocab
  uint32_t flags;      // kGreedy, kPenalised
  int32_t prompt_len;  // ids uploaded for the repetition penalty (0 when it is off)
  int32_t output_len;  // ids uploaded for the penalties (0 when all are off)
  int32_t pad;
  int64_t ids_off;  // prompt ids at ids[ids_off], output ids right after them
  uint64_t seed;
  uint64_t step;
};

struct RowResult {
  int32_t token;
  int32_t status;
  float logprob;
  int32_t pad;
};

struct TopEntry {
  int32_t id;
  float logprob;
};

// ---- Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") ----------

__host__ __device__ inline void philox4x32_10(uint32_t ctr[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * ctr[2];
    const uint32_t c1 = ctr[1];
    const uint32_t c3 = ctr[3];
    ctr[0] = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    ctr[1] = static_cast<uint32_t>(p1);
    ctr[2] = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    ctr[3] = static_cast<uint32_t>(p0);
  }
}

// 64 random bits for (seed, step): the key is the seed, the counter (step, 0).
__host__ __device__ inline uint64_t philox_bits(uint64_t seed, uint64_t step) {
  uint32_t ctr[4] = {static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u};
  philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<uint64_t>(ctr[0]) << 32) | ctr[1];
}

// ---- keys ------------------------------------------------------------------------------------

// NaN -> -inf, -0 -> +0 (so that equal logits have equal keys).
__device__ __forceinline__ float clean(float x) {
  if (isnan(x)) return -INFINITY;
  return x == 0.0f ? 0.0f : x;
}

// Order-preserving map of a non-NaN float to uint32.
__device__ __forceinline__ uint32_t float_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Larger means ranked higher: larger key, then lower id.
__device__ __forceinline__ u64 rank_word(uint32_t key, int v) {
  return (static_cast<u64>(key) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(v));
}

struct Cut {
  uint32_t key;
  int32_t id;
};
constexpr Cut kNoCut{0u, INT_MAX};

__device__ __forceinline__ bool within(Cut c, uint32_t key, int v) {
  return key > c.key || (key == c.key && v <= c.id);
}

// ---- block primitives (blockDim.x == kThreads) -----------------------------------------------

struct SelectShared {
  unsigned cnt[kMaxBins];
  u64 mass[kMaxBins];
  u64 scratch[kWarps];
  int best;
  unsigned sel_bin;
  unsigned sel_cnt;
  u64 sel_above;
  u64 sel_mass;
  int find_warp;
  u64 find_rem;
  int result;
  unsigned count;
};

__device__ __forceinline__ u64 warp_max(u64 v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ u64 warp_inclusive_scan(u64 v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const u64 n = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// Block-wide max; every thread gets it.
__device__ u64 block_max(u64 v, u64* scratch) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  u64 r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = max(r, scratch[w]);
  __syncthreads();
  return r;
}

// Exclusive prefix sum in thread order; *total gets the block's sum (every thread).
__device__ u64 block_exclusive_scan(u64 v, u64* scratch, u64* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const u64 incl = warp_inclusive_scan(v);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const u64 t = warp_inclusive_scan(lane < kWarps ? scratch[lane] : 0);
    if (lane < kWarps) scratch[lane] = t;
  }
  __syncthreads();
  const u64 base = warp > 0 ? scratch[warp - 1] : 0;
  *total = scratch[kWarps - 1];
  __syncthreads();
  return base + incl - v;
}

// Position (0-based) of the n-th (1-based) set bit of mask; n <= popc(mask).
__device__ __forceinline__ int nth_set_bit(unsigned mask, unsigned n) {
  for (unsigned i = 1; i < n; ++i) mask &= mask - 1;
  return __ffs(static_cast<int>(mask)) - 1;
}

// Each warp owns a contiguous range of ids (a multiple of 32 long), read 32 at a time.
__device__ __forceinline__ int warp_chunk(int vocab) {
  return ((vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
}

// The n-th lowest id (n >= 1) among the ids v in [0, vocab) with pred(v); there are at least n.
template <typename Pred>
__device__ int find_nth(const Pred& pred, int vocab, u64 n, SelectShared& sm) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int chunk = warp_chunk(vocab);
  const int begin = warp * chunk;
  const int end = min(vocab, begin + chunk);
  u64 count = 0;
  for (int base = begin; base < end; base += 32) {
    const int v = base + lane;
    count += __popc(__ballot_sync(kFullMask, v < end && pred(v)));
  }
  if (lane == 0) sm.scratch[warp] = count;
  if (threadIdx.x == 0) sm.result = -1;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 acc = 0;
    int w = 0;
    for (; w < kWarps - 1 && acc + sm.scratch[w] < n; ++w) acc += sm.scratch[w];
    sm.find_warp = w;
    sm.find_rem = n - acc;
  }
  __syncthreads();
  if (warp == sm.find_warp) {
    u64 rem = sm.find_rem;
    for (int base = begin; base < end; base += 32) {
      const int v = base + lane;
      const unsigned mask = __ballot_sync(kFullMask, v < end && pred(v));
      const unsigned c = __popc(mask);
      if (rem <= c) {
        if (lane == 0) sm.result = base + nth_set_bit(mask, static_cast<unsigned>(rem));
        break;
      }
      rem -= c;
    }
  }
  __syncthreads();
  const int r = sm.result;
  __syncthreads();
  return r;
}

// The cut keeping the highest-ranked members of the set {v : fn(v, &key, &w)} while the weight
// ranked strictly above them is < theta (see the top of the file). Counting (kMass = false):
// w = 1, theta = k. Mass (kMass = true): w as fn gives it, theta = ceil(top_p * total weight).
// kNoCut when every member is kept. fn must give the same answer in every pass.
template <bool kMass, typename Fn>
__device__ Cut select_cut(const Fn& fn, int vocab, u64 k, float top_p, SelectShared& sm) {
  const int tid = threadIdx.x;
  uint32_t prefix = 0;  // key bits fixed by the passes so far
  u64 above = 0;        // weight of the members ranked above every key with that prefix
  u64 theta = k;
  for (int pass = 0; pass < 3; ++pass) {
    const int bits = pass < 2 ? 11 : 10;
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nbins = 1 << bits;
    const int hi = shift + bits;  // key bits above this pass's digit must equal the prefix's
    for (int i = tid; i < nbins; i += kThreads) {
      sm.cnt[i] = 0;
      if (kMass) sm.mass[i] = 0;
    }
    if (tid == 0) sm.best = -1;
    __syncthreads();
    for (int v = tid; v < vocab; v += kThreads) {
      uint32_t key = 0;
      u64 w = 0;
      if (!fn(v, key, w)) continue;
      if ((static_cast<u64>(key) >> hi) != (static_cast<u64>(prefix) >> hi)) continue;
      const unsigned bin = (key >> shift) & static_cast<unsigned>(nbins - 1);
      atomicAdd(&sm.cnt[bin], 1u);
      if (kMass && w != 0) atomicAdd(&sm.mass[bin], w);
    }
    __syncthreads();
    // Positions in descending key order: position q is bin nbins - 1 - q; thread t owns
    // positions [t * per, (t + 1) * per).
    const int per = nbins / kThreads;
    const int q0 = tid * per;
    u64 local = 0;
    for (int q = q0; q < q0 + per; ++q) {
      const int b = nbins - 1 - q;
      local += kMass ? sm.mass[b] : static_cast<u64>(sm.cnt[b]);
    }
    u64 total;
    const u64 excl = block_exclusive_scan(local, sm.scratch, &total);
    if (pass == 0) {
      if (kMass)
        theta = static_cast<u64>(ceil(static_cast<double>(top_p) * static_cast<double>(total)));
      if (theta >= total) return kNoCut;  // everything is kept (or the set is empty)
    }
    // The lowest non-empty bin whose weight strictly above is < theta holds the last kept member.
    int cand = -1;
    u64 run = above + excl;
    for (int q = q0; q < q0 + per; ++q) {
      const int b = nbins - 1 - q;
      if (sm.cnt[b] != 0 && run < theta) cand = q;
      run += kMass ? sm.mass[b] : static_cast<u64>(sm.cnt[b]);
    }
    for (int o = 16; o > 0; o >>= 1) cand = max(cand, __shfl_xor_sync(kFullMask, cand, o));
    if ((tid & 31) == 0 && cand >= 0) atomicMax(&sm.best, cand);
    __syncthreads();
    const int best = sm.best;  // >= 0: the highest non-empty bin qualifies (above < theta)
    if (best >= q0 && best < q0 + per) {
      u64 r = above + excl;
      for (int q = q0; q < best; ++q) {
        const int b = nbins - 1 - q;
        r += kMass ? sm.mass[b] : static_cast<u64>(sm.cnt[b]);
      }
      const int b = nbins - 1 - best;
      sm.sel_bin = static_cast<unsigned>(b);
      sm.sel_above = r;
      sm.sel_cnt = sm.cnt[b];
      sm.sel_mass = kMass ? sm.mass[b] : static_cast<u64>(sm.cnt[b]);
    }
    __syncthreads();
    const unsigned bin = sm.sel_bin;
    const u64 g = sm.sel_cnt;
    const u64 m = sm.sel_mass;
    above = sm.sel_above;
    __syncthreads();
    prefix |= bin << shift;
    if (pass < 2) {
      // Every member of the bin is kept: cut below the bin. (For a count, all are kept iff
      // above + g <= theta; for a mass this is certain only for a single member.)
      if (g == 1 || (!kMass && above + g <= theta)) return Cut{prefix, INT_MAX};
      continue;
    }
    // The bin is the tie group of key `prefix`: its members, in id order, each weigh m / g; the
    // j-th (0-based) is kept iff above + j * w < theta.
    u64 need;
    if (!kMass) {
      need = min(g, theta - above);
    } else {
      const u64 w = m / g;
      need = w == 0 ? g : min(g, (theta - above + w - 1) / w);
    }
    if (need >= g) return Cut{prefix, INT_MAX};
    const uint32_t tie_key = prefix;
    const int id = find_nth(
        [&](int v) {
          uint32_t key = 0;
          u64 w = 0;
          return fn(v, key, w) && key == tie_key;
        },
        vocab, need, sm);
    return Cut{prefix, id};
  }
  return kNoCut;  // not reached
}

// Inverse-CDF draw: the lowest id whose inclusive prefix weight (in id order) over
// {v : fn(v, &w)} exceeds floor(r * total / 2^64). -1 if the set weighs nothing.
template <typename Fn>
__device__ int draw(const Fn& fn, int vocab, u64 r, SelectShared& sm) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int chunk = warp_chunk(vocab);
  const int begin = warp * chunk;
  const int end = min(vocab, begin + chunk);
  u64 sum = 0;
  for (int v = begin + lane; v < end; v += 32) {
    u64 w;
    if (fn(v, w)) sum += w;
  }
  sum = warp_sum(sum);
  if (lane == 0) sm.scratch[warp] = sum;
  if (threadIdx.x == 0) sm.result = -1;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 total = 0;
    for (int w = 0; w < kWarps; ++w) total += sm.scratch[w];
    const u64 target = __umul64hi(r, total);  // uniform in [0, total)
    u64 acc = 0;
    int w = 0;
    for (; w < kWarps - 1 && acc + sm.scratch[w] <= target; ++w) acc += sm.scratch[w];
    sm.find_warp = total == 0 ? -1 : w;
    sm.find_rem = target - acc;
  }
  __syncthreads();
  if (warp == sm.find_warp) {
    const u64 rem = sm.find_rem;
    u64 acc = 0;
    for (int base = begin; base < end; base += 32) {
      const int v = base + lane;
      u64 w = 0;
      if (v < end) {
        u64 t;
        if (fn(v, t)) w = t;
      }
      const u64 incl = warp_inclusive_scan(w);
      const unsigned hit = __ballot_sync(kFullMask, acc + incl > rem);
      if (hit != 0) {
        if (lane == 0) sm.result = base + __ffs(static_cast<int>(hit)) - 1;
        break;
      }
      acc += __shfl_sync(kFullMask, incl, 31);
    }
  }
  __syncthreads();
  const int token = sm.result;
  __syncthreads();
  return token;
}

// ---- kernels ---------------------------------------------------------------------------------

// The rank of logit x at id v for the greedy argmax: NaN below -inf, -0 as +0, ties to the lower
// id (the larger word wins).
__device__ __forceinline__ u64 argmax_rank(float x, int v) {
  return rank_word(isnan(x) ? 0u : float_key(x == 0.0f ? 0.0f : x), v);
}

// A greedy argmax_kernel's row result from its best rank word.
__device__ __forceinline__ RowResult argmax_result(u64 best) {
  const int32_t token = static_cast<int32_t>(~static_cast<uint32_t>(best));
  const bool ok = static_cast<uint32_t>(best >> 32) > kNegInfKey;
  return RowResult{token, ok ? kRowOk : kRowNoFiniteLogit, 0.0f, 0};
}

// Greedy argmax per row (NaN below -inf, ties to the lowest id: cpu::greedy_argmax). With params,
// rows without kGreedy are skipped. Writes ids[row] and/or results[row] (status: no logit above
// -inf).
__global__ void __launch_bounds__(kThreads)
    argmax_kernel(const float* __restrict__ logits, int vocab, bool vec,
                  const RowParams* __restrict__ params, RowResult* __restrict__ results,
                  int32_t* __restrict__ ids) {
  __shared__ u64 scratch[kWarps];
  const int row = blockIdx.x;
  if (params != nullptr && !(params[row].flags & kGreedy)) return;
  const float* l = logits + static_cast<size_t>(row) * vocab;
  u64 best = 0;
  auto consider = [&best](float x, int v) { best = max(best, argmax_rank(x, v)); };
  if (vec) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int n4 = vocab / 4;
#pragma unroll 4
    for (int i = threadIdx.x; i < n4; i += kThreads) {
      const float4 f = __ldg(l4 + i);
      consider(f.x, 4 * i);
      consider(f.y, 4 * i + 1);
      consider(f.z, 4 * i + 2);
      consider(f.w, 4 * i + 3);
    }
  } else {
    for (int v = threadIdx.x; v < vocab; v += kThreads) consider(__ldg(l + v), v);
  }
  best = block_max(best, scratch);
  if (threadIdx.x == 0) {
    const RowResult r = argmax_result(best);
    if (ids != nullptr) ids[row] = r.token;
    if (results != nullptr) results[row] = r;
  }
}

// The greedy argmax of a call with few rows (kSplitArgmaxRows): one block a row read 600 KB of
// logits alone (a 152k vocabulary), ~38 rounds of loads on one SM. Grid (slices, rows) of
// kSplitThreads: each block the best rank word of kSplitSlice logits, merged into best[row] by
// atomicMax; the row's last block (done[row]) writes its result and leaves best and done zero
// for the next call. The same ranks as argmax_kernel.
constexpr int kSplitThreads = 256;
constexpr int kSplitSlice = 4096;  // a multiple of 4
constexpr int kSplitArgmaxRows = 16;
__global__ void __launch_bounds__(kSplitThreads)
    argmax_split_kernel(const float* __restrict__ logits, int vocab, bool vec, u64* best,
                        unsigned* done, RowResult* __restrict__ results) {
  __shared__ u64 scratch[kSplitThreads / 32];
  const int row = blockIdx.y;
  const float* l = logits + static_cast<size_t>(row) * vocab;
  const int begin = static_cast<int>(blockIdx.x) * kSplitSlice;
  const int end = min(vocab, begin + kSplitSlice);
  u64 b = 0;
  if (vec) {  // vocab % 4 == 0: the slice is whole float4s
    const float4* l4 = reinterpret_cast<const float4*>(l);
#pragma unroll 4
    for (int i = begin / 4 + static_cast<int>(threadIdx.x); i < end / 4; i += kSplitThreads) {
      const float4 f = __ldg(l4 + i);
      b = max(b, argmax_rank(f.x, 4 * i));
      b = max(b, argmax_rank(f.y, 4 * i + 1));
      b = max(b, argmax_rank(f.z, 4 * i + 2));
      b = max(b, argmax_rank(f.w, 4 * i + 3));
    }
  } else {
    for (int v = begin + static_cast<int>(threadIdx.x); v < end; v += kSplitThreads) {
      b = max(b, argmax_rank(__ldg(l + v), v));
    }
  }
  b = warp_max(b);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = b;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kSplitThreads / 32; ++w) b = max(b, scratch[w]);
  atomicMax(best + row, b);
  __threadfence();  // this block's max is in before its count
  if (atomicAdd(done + row, 1u) == gridDim.x - 1) {
    results[row] = argmax_result(atomicExch(best + row, u64{0}));
    atomicExch(done + row, 0u);
  }
}

// Raw log-sum-exp per row with logprobs >= 0, and the top N raw logprobs sorted by rank.
__global__ void __launch_bounds__(kThreads)
    logprobs_kernel(const float* __restrict__ logits, int vocab,
                    const RowParams* __restrict__ params, double* __restrict__ lse_out,
                    u64* __restrict__ top_scratch, int max_logprobs,
                    TopEntry* __restrict__ top_out) {
  __shared__ SelectShared sm;
  __shared__ float warp_m[kWarps];
  __shared__ float warp_s[kWarps];
  __shared__ double row_lse;
  const int row = blockIdx.x;
  const int n = params[row].logprobs;
  if (n < 0) return;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const float* l = logits + static_cast<size_t>(row) * vocab;

  // Online max / sum of exp.
  float m = -INFINITY;
  float s = 0.0f;
  for (int v = tid; v < vocab; v += kThreads) {
    const float x = clean(l[v]);
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else if (x > -INFINITY) {
      s += expf(x - m);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, o);
    const float s2 = __shfl_xor_sync(kFullMask, s, o);
    const float mm = fmaxf(m, m2);
    const float a = m == -INFINITY ? 0.0f : s * expf(m - mm);
    const float b = m2 == -INFINITY ? 0.0f : s2 * expf(m2 - mm);
    m = mm;
    s = a + b;
  }
  if (lane == 0) {
    warp_m[tid >> 5] = m;
    warp_s[tid >> 5] = s;
  }
  __syncthreads();
  if (tid == 0) {
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_m[w]);
    double sum = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      if (warp_m[w] > -INFINITY) {
        sum += static_cast<double>(warp_s[w]) *
               exp(static_cast<double>(warp_m[w]) - static_cast<double>(mx));
      }
    }
    const double lse = static_cast<double>(mx) + log(sum);
    row_lse = lse;
    lse_out[row] = lse;
  }
  __syncthreads();
  const double lse = row_lse;
  if (n == 0) return;

  auto all = [l](int v, uint32_t& key, u64& w) {
    key = float_key(clean(l[v]));
    w = 1;
    return true;
  };
  const Cut cut = select_cut<false>(all, vocab, static_cast<u64>(n), 1.0f, sm);
  if (tid == 0) sm.count = 0;
  __syncthreads();
  u64* cand = top_scratch + static_cast<size_t>(row) * max_logprobs;
  for (int v = tid; v < vocab; v += kThreads) {
    const uint32_t key = float_key(clean(l[v]));
    if (within(cut, key, v)) {
      const unsigned slot = atomicAdd(&sm.count, 1u);
      if (slot < static_cast<unsigned>(n)) cand[slot] = rank_word(key, v);
    }
  }
  __syncthreads();
  TopEntry* out = top_out + static_cast<size_t>(row) * max_logprobs;
  for (int i = tid; i < n; i += kThreads) {
    const u64 mine = cand[i];
    int rank = 0;
    for (int j = 0; j < n; ++j) rank += cand[j] > mine ? 1 : 0;
    const float x = key_float(static_cast<uint32_t>(mine >> 32));
    const int32_t id = static_cast<int32_t>(~static_cast<uint32_t>(mine));
    out[rank] = TopEntry{id, static_cast<float>(static_cast<double>(x) - lse)};
  }
}

// Penalties in place for rows with kPenalised. counts[row] is all zero on entry and on exit.
// The raw logit of every listed id is saved at the id's position (for the token's logprob).
__global__ void __launch_bounds__(kSmallThreads)
    penalty_kernel(float* __restrict__ logits, int vocab, const RowParams* __restrict__ params,
                   const int32_t* __restrict__ ids, float* __restrict__ saved,
                   int32_t* __restrict__ counts) {
  const int row = blockIdx.x;
  const RowParams p = params[row];
  if (!(p.flags & kPenalised)) return;
  float* l = logits + static_cast<size_t>(row) * vocab;
  int32_t* c = counts + static_cast<size_t>(row) * vocab;
  const int32_t* list = ids + p.ids_off;
  float* raw = saved + p.ids_off;
  const int n = p.prompt_len + p.output_len;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int32_t id = list[j];
    raw[j] = l[id];
    if (j < p.prompt_len) {
      atomicOr(&c[id], kPromptBit);
    } else {
      atomicAdd(&c[id], 1);
    }
  }
  __syncthreads();
  const bool rep = p.repetition != 1.0f;
  const bool additive = p.frequency != 0.0f || p.presence != 0.0f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int32_t id = list[j];
    const int32_t old = atomicExch(&c[id], 0);  // the first thread to see the id applies it
    if (old == 0) continue;
    const int32_t count = old & ~kPromptBit;
    float x = l[id];
    if (isnan(x)) x = -INFINITY;
    if (rep) x = x > 0.0f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
    if (additive && count > 0) {
      // As the CPU (and torch) rounds: x -= f * count (fp32 product); x -= presence.
      x = __fsub_rn(x, __fmul_rn(p.frequency, static_cast<float>(count)));
      x = __fsub_rn(x, p.presence);
    }
    l[id] = x;
  }
}

// Temperature, min_p, top_k, top_p and the draw for rows without kGreedy.
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* __restrict__ logits, int vocab, const RowParams* __restrict__ params,
                  float weight_scale, RowResult* __restrict__ results) {
  __shared__ SelectShared sm;
  const int row = blockIdx.x;
  const RowParams p = params[row];
  if (p.flags & kGreedy) return;
  const int tid = threadIdx.x;
  const float* l = logits + static_cast<size_t>(row) * vocab;
  const float temperature = p.temperature;
  auto tempered = [l, temperature](int v) { return clean(__fdiv_rn(l[v], temperature)); };

  u64 kmax = 0;
  for (int v = tid; v < vocab; v += kThreads) kmax = max(kmax, u64{float_key(tempered(v))});
  kmax = block_max(kmax, sm.scratch);
  const float mx = key_float(static_cast<uint32_t>(kmax));
  if (!(kmax > kNegInfKey && isfinite(mx))) {
    if (tid == 0) results[row] = RowResult{-1, kRowNoFiniteLogit, 0.0f, 0};
    return;
  }

  // min_p: keep p >= min_p * p_max, i.e. exp(x - max) >= min_p (in double, as the CPU). Only
  // values within 1e-9 of the boundary in log space pay for the exp.
  const bool use_min_p = p.min_p > 0.0f;
  const double min_p = p.min_p;
  const double log_min_p = use_min_p ? log(min_p) : 0.0;
  auto survives = [=](float x) {
    if (!(x > -INFINITY)) return false;
    if (!use_min_p) return true;
    const double d = static_cast<double>(x) - static_cast<double>(mx);
    if (d > log_min_p + 1e-9) return true;
    if (d < log_min_p - 1e-9) return false;
    return exp(d) >= min_p;
  };
  auto weight = [=](float x) -> u64 { return __float2ull_rz(expf(x - mx) * weight_scale); };

  Cut ck = kNoCut;
  if (p.top_k > 0) {
    auto fk = [&](int v, uint32_t& key, u64& w) {
      const float x = tempered(v);
      if (!survives(x)) return false;
      key = float_key(x);
      w = 1;
      return true;
    };
    ck = select_cut<false>(fk, vocab, static_cast<u64>(p.top_k), 1.0f, sm);
  }
  Cut cp = kNoCut;
  if (p.top_p < 1.0f) {
    auto fp = [&](int v, uint32_t& key, u64& w) {
      const float x = tempered(v);
      if (!survives(x)) return false;
      key = float_key(x);
      if (!within(ck, key, v)) return false;
      w = weight(x);
      return true;
    };
    cp = select_cut<true>(fp, vocab, 0, p.top_p, sm);
  }
  auto fd = [&](int v, u64& w) {
    const float x = tempered(v);
    if (!survives(x)) return false;
    const uint32_t key = float_key(x);
    if (!within(ck, key, v) || !within(cp, key, v)) return false;
    w = weight(x);
    return true;
  };
  const int token = draw(fd, vocab, philox_bits(p.seed, p.step), sm);
  if (tid == 0) results[row] = RowResult{token, token >= 0 ? kRowOk : kRowInternal, 0.0f, 0};
}

// The sampled token's raw logprob: its logit before the penalties (saved by penalty_kernel when
// it was penalised) minus the row's log-sum-exp.
__global__ void __launch_bounds__(kSmallThreads)
    finalize_kernel(const float* __restrict__ logits, int vocab,
                    const RowParams* __restrict__ params, const int32_t* __restrict__ ids,
                    const float* __restrict__ saved, const double* __restrict__ lse,
                    RowResult* __restrict__ results) {
  __shared__ float raw;
  __shared__ int found;
  const int row = blockIdx.x;
  const RowParams p = params[row];
  if (p.logprobs < 0 || results[row].status != kRowOk) return;
  const int32_t token = results[row].token;
  if (threadIdx.x == 0) found = 0;
  __syncthreads();
  if (p.flags & kPenalised) {
    const int n = p.prompt_len + p.output_len;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      if (ids[p.ids_off + j] == token) {  // every copy saved the same value
        raw = saved[p.ids_off + j];
        found = 1;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float x = clean(found ? raw : logits[static_cast<size_t>(row) * vocab + token]);
    results[row].logprob = static_cast<float>(static_cast<double>(x) - lse[row]);
  }
}

// ---- host helpers ----------------------------------------------------------------------------

struct PinnedFree {
  void operator()(unsigned char* p) const {
    if (p != nullptr) cudaFreeHost(p);
  }
};
using PinnedBytes = std::unique_ptr<unsigned char[], PinnedFree>;

Expected<PinnedBytes> pinned_alloc(size_t bytes, const std::string& what) {
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(
        err, "allocating " + std::to_string(bytes) + " bytes of pinned memory for " + what);
  }
  return PinnedBytes(static_cast<unsigned char*>(p));
}

constexpr size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

int bit_length(uint64_t v) {
  int n = 0;
  while (v != 0) {
    ++n;
    v >>= 1;
  }
  return n;
}

}  // namespace

struct GpuSampler::Impl {
  int max_rows = 0;
  int vocab = 0;
  int max_logprobs = 0;
  cudaStream_t stream = nullptr;
  float weight_scale = 1.0f;  // 2^s: fixed-point weights, vocab * 2^s < 2^62

  size_t id_capacity = 0;    // ids the upload / saved buffers hold
  DeviceBuffer upload;       // RowParams[max_rows], then int32 ids[id_capacity] (at ids_offset)
  DeviceBuffer saved;        // float[id_capacity]: raw logits of the listed ids
  DeviceBuffer counts;       // int32[max_rows * vocab], all zero between calls
  DeviceBuffer results;      // RowResult[max_rows], then TopEntry[max_rows * max_logprobs]
  DeviceBuffer lse;          // double[max_rows]
  DeviceBuffer top_scratch;  // u64[max_rows * max_logprobs]
  // The split argmax's merge state: u64 best[kSplitArgmaxRows], then unsigned done[...]; zero
  // between calls.
  DeviceBuffer split_argmax;
  // Two of each host image, used in turn: two calls may be outstanding (enqueue() twice, then
  // finish() the first), and a copy reads or writes its pinned buffer when it runs, not when it
  // is enqueued.
  PinnedBytes staging[2];                    // host image of `upload`
  PinnedBytes host_results[2];               // host image of `results`
  cudaEvent_t done[2] = {nullptr, nullptr};  // after each slot's copy back
  bool busy[2] = {false, false};             // enqueued, not finished
  int next = 0;                              // the slot of the next enqueue

  ~Impl() {
    for (cudaEvent_t e : done) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }

  size_t ids_offset() const { return align_up(sizeof(RowParams) * max_rows, 256); }
  size_t tops_offset() const { return align_up(sizeof(RowResult) * max_rows, 256); }
  size_t results_bytes() const {
    return tops_offset() + sizeof(TopEntry) * static_cast<size_t>(max_rows) * max_logprobs;
  }

  // Grows the id buffers, after the stream has run everything enqueued (a call outstanding may
  // still read them).
  Status reserve_ids(size_t n) {
    if (n <= id_capacity && upload.get() != nullptr) return Status::ok();
    size_t cap = std::max<size_t>(id_capacity, 4096);
    while (cap < n) cap *= 2;
    const size_t bytes = ids_offset() + cap * sizeof(int32_t);
    if (stream != nullptr) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "growing the sampler buffers");
    }
    upload.reset();
    saved.reset();
    for (PinnedBytes& p : staging) p.reset();
    id_capacity = 0;
    TESSERA_ASSIGN_OR_RETURN(upload, DeviceBuffer::allocate(bytes, "sampler parameters"));
    TESSERA_ASSIGN_OR_RETURN(saved, DeviceBuffer::allocate(cap * sizeof(float), "sampler ids"));
    for (PinnedBytes& p : staging) {
      TESSERA_ASSIGN_OR_RETURN(p, pinned_alloc(bytes, "sampler parameters"));
    }
    id_capacity = cap;
    return Status::ok();
  }

  // What a batch needs: which kernels run, and how many penalty ids it uploads.
  struct BatchShape {
    bool any_logprobs = false;
    bool any_penalties = false;
    bool any_greedy = false;
    bool any_sampled = false;
    size_t n_ids = 0;
  };
  Expected<BatchShape> check_rows(std::span<const SampleRow> rows) const;
  // The rows' parameters and penalty ids into the staging image of `slot`.
  void stage_rows(std::span<const SampleRow> rows, int slot) const;
  // The kernels of a batch that is not all plain greedy, after its upload; the bytes to copy
  // back from `results`.
  Expected<size_t> launch_kernels(float* logits, int n, const BatchShape& shape, bool vec,
                                  int slot);
  // Everything of one call up to its copy back and its event.
  Status enqueue_rows(float* logits, std::span<const SampleRow> rows, const BatchShape& shape,
                      int slot);
};

namespace {

// The penalty lists a row's kernels read: the prompt for the repetition penalty, the output for
// any of the three.
bool uses_prompt(const SamplingParams& sp) { return sp.repetition_penalty != 1.0f; }
bool uses_output(const SamplingParams& sp) {
  return uses_prompt(sp) || sp.frequency_penalty != 0.0f || sp.presence_penalty != 0.0f;
}

}  // namespace

// The rows' params are valid (SampleRow); what is checked here is what this sampler was sized
// for (logprobs) and the ids its kernels index with.
Expected<GpuSampler::Impl::BatchShape> GpuSampler::Impl::check_rows(
    std::span<const SampleRow> rows) const {
  BatchShape shape;
  for (size_t i = 0; i < rows.size(); ++i) {
    const SampleRow& r = rows[i];
    const SamplingParams& sp = r.params;
    if (sp.logprobs > max_logprobs) {
      return invalid_argument("sample: row " + std::to_string(i) + " asks for " +
                              std::to_string(sp.logprobs) + " logprobs, the maximum is " +
                              std::to_string(max_logprobs));
    }
    auto check = [&](std::span<const int32_t> list, const char* what) -> Status {
      for (int32_t id : list) {
        if (id < 0 || id >= vocab) {
          return invalid_argument("sample: row " + std::to_string(i) + ": " + what + " token id " +
                                  std::to_string(id) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
        }
      }
      return Status::ok();
    };
    const bool use_prompt = uses_prompt(sp);
    const bool use_output = uses_output(sp);
    if (use_prompt) {
      TESSERA_RETURN_IF_ERROR(check(r.prompt_ids, "prompt"));
      shape.n_ids += r.prompt_ids.size();
    }
    if (use_output) {
      TESSERA_RETURN_IF_ERROR(check(r.output_ids, "output"));
      shape.n_ids += r.output_ids.size();
    }
    if ((use_prompt && !r.prompt_ids.empty()) || (use_output && !r.output_ids.empty())) {
      shape.any_penalties = true;
    }
    shape.any_logprobs |= sp.logprobs >= 0;
    if (sp.temperature < kSamplingEps) {
      shape.any_greedy = true;
    } else {
      shape.any_sampled = true;
    }
  }
  if (shape.n_ids > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return invalid_argument("sample: too many prompt / output ids in one batch");
  }
  return shape;
}

void GpuSampler::Impl::stage_rows(std::span<const SampleRow> rows, int slot) const {
  auto* h_params = reinterpret_cast<RowParams*>(staging[slot].get());
  auto* h_ids = reinterpret_cast<int32_t*>(staging[slot].get() + ids_offset());
  size_t off = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const SampleRow& r = rows[i];
    const SamplingParams& sp = r.params;
    RowParams rp{};
    rp.temperature = sp.temperature;
    rp.top_p = sp.top_p;
    rp.min_p = sp.min_p;
    rp.repetition = sp.repetition_penalty;
    rp.presence = sp.presence_penalty;
    rp.frequency = sp.frequency_penalty;
    rp.top_k = sp.top_k > 0 && sp.top_k < vocab ? sp.top_k : 0;
    rp.logprobs = sp.logprobs < 0 ? -1 : std::min(sp.logprobs, vocab);
    rp.flags = sp.temperature < kSamplingEps ? kGreedy : 0;
    rp.ids_off = static_cast<int64_t>(off);
    if (uses_prompt(sp)) {
      std::copy(r.prompt_ids.begin(), r.prompt_ids.end(), h_ids + off);
      off += r.prompt_ids.size();
      rp.prompt_len = static_cast<int32_t>(r.prompt_ids.size());
    }
    if (uses_output(sp)) {
      std::copy(r.output_ids.begin(), r.output_ids.end(), h_ids + off);
      off += r.output_ids.size();
      rp.output_len = static_cast<int32_t>(r.output_ids.size());
    }
    if (rp.prompt_len + rp.output_len > 0) rp.flags |= kPenalised;
    rp.seed = r.seed;
    rp.step = r.step;
    h_params[i] = rp;
  }
}

Expected<size_t> GpuSampler::Impl::launch_kernels(float* logits, int n, const BatchShape& shape,
                                                  bool vec, int slot) {
  auto* d_results = results.as<RowResult>();
  auto* d_tops = reinterpret_cast<TopEntry*>(results.as<unsigned char>() + tops_offset());
  auto* d_params = upload.as<RowParams>();
  auto* d_ids = reinterpret_cast<int32_t*>(upload.as<unsigned char>() + ids_offset());
  size_t back_bytes = sizeof(RowResult) * n;
  const size_t up_bytes = shape.n_ids > 0 ? ids_offset() + shape.n_ids * sizeof(int32_t)
                                          : sizeof(RowParams) * static_cast<size_t>(n);
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(upload.get(), staging[slot].get(), up_bytes, cudaMemcpyHostToDevice, stream),
      "uploading sampler parameters");
  if (shape.any_logprobs) {
    logprobs_kernel<<<n, kThreads, 0, stream>>>(logits, vocab, d_params, lse.as<double>(),
                                                top_scratch.as<u64>(), max_logprobs, d_tops);
    TESSERA_RETURN_IF_ERROR(launch_status("logprobs_kernel"));
    back_bytes = tops_offset() + sizeof(TopEntry) * static_cast<size_t>(n) * max_logprobs;
  }
  if (shape.any_penalties) {
    penalty_kernel<<<n, kSmallThreads, 0, stream>>>(logits, vocab, d_params, d_ids,
                                                    saved.as<float>(), counts.as<int32_t>());
    TESSERA_RETURN_IF_ERROR(launch_status("penalty_kernel"));
  }
  if (shape.any_greedy) {
    argmax_kernel<<<n, kThreads, 0, stream>>>(logits, vocab, vec, d_params, d_results, nullptr);
    TESSERA_RETURN_IF_ERROR(launch_status("argmax_kernel"));
  }
  if (shape.any_sampled) {
    sample_kernel<<<n, kThreads, 0, stream>>>(logits, vocab, d_params, weight_scale, d_results);
    TESSERA_RETURN_IF_ERROR(launch_status("sample_kernel"));
  }
  if (shape.any_logprobs) {
    finalize_kernel<<<n, kSmallThreads, 0, stream>>>(
        logits, vocab, d_params, d_ids, saved.as<float>(), lse.as<double>(), d_results);
    TESSERA_RETURN_IF_ERROR(launch_status("finalize_kernel"));
  }
  return back_bytes;
}

Status GpuSampler::Impl::enqueue_rows(float* logits, std::span<const SampleRow> rows,
                                      const BatchShape& shape, int slot) {
  const int n = static_cast<int>(rows.size());
  const bool vec = vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  size_t back_bytes = sizeof(RowResult) * n;
  const bool all_greedy = !shape.any_logprobs && !shape.any_penalties && !shape.any_sampled;
  if (all_greedy && n <= kSplitArgmaxRows) {
    // All greedy, few rows: the split argmax, no upload.
    auto* best = split_argmax.as<u64>();
    auto* done = reinterpret_cast<unsigned*>(best + kSplitArgmaxRows);
    const dim3 grid((vocab + kSplitSlice - 1) / kSplitSlice, n);
    argmax_split_kernel<<<grid, kSplitThreads, 0, stream>>>(logits, vocab, vec, best, done,
                                                            results.as<RowResult>());
    TESSERA_RETURN_IF_ERROR(launch_status("argmax_split_kernel"));
  } else if (all_greedy) {
    // All greedy: one argmax, no upload.
    argmax_kernel<<<n, kThreads, 0, stream>>>(logits, vocab, vec, nullptr, results.as<RowResult>(),
                                              nullptr);
    TESSERA_RETURN_IF_ERROR(launch_status("argmax_kernel"));
  } else {
    TESSERA_RETURN_IF_ERROR(reserve_ids(shape.n_ids));
    stage_rows(rows, slot);
    TESSERA_ASSIGN_OR_RETURN(back_bytes, launch_kernels(logits, n, shape, vec, slot));
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_results[slot].get(), results.get(), back_bytes,
                                               cudaMemcpyDeviceToHost, stream),
                               "copying sampler results");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(done[slot], stream), "sampler event");
  return Status::ok();
}

Expected<std::unique_ptr<GpuSampler>> GpuSampler::create(int max_rows, int64_t vocab,
                                                         int max_logprobs, cudaStream_t stream) {
  if (max_rows < 1 || vocab < 1 || vocab > std::numeric_limits<int32_t>::max() ||
      max_logprobs < 0) {
    return invalid_argument(
        "GpuSampler: need max_rows >= 1, a vocabulary of 1 to 2^31 - 1 "
        "tokens and max_logprobs >= 0, got max_rows " +
        std::to_string(max_rows) + ", vocab " + std::to_string(vocab) + ", max_logprobs " +
        std::to_string(max_logprobs));
  }
  std::unique_ptr<GpuSampler> s(new GpuSampler());
  s->impl_ = std::make_unique<Impl>();
  Impl& m = *s->impl_;
  m.max_rows = max_rows;
  m.vocab = static_cast<int>(vocab);
  m.max_logprobs = max_logprobs;
  m.stream = stream;
  m.weight_scale = std::ldexp(1.0f, 62 - bit_length(static_cast<uint64_t>(vocab)));
  TESSERA_RETURN_IF_ERROR(m.reserve_ids(0));
  const size_t cells = static_cast<size_t>(max_rows) * static_cast<size_t>(vocab);
  TESSERA_ASSIGN_OR_RETURN(m.counts,
                           DeviceBuffer::allocate(cells * sizeof(int32_t), "sampler counts"));
  TESSERA_ASSIGN_OR_RETURN(m.results, DeviceBuffer::allocate(m.results_bytes(), "sampler results"));
  TESSERA_ASSIGN_OR_RETURN(m.lse, DeviceBuffer::allocate(sizeof(double) * max_rows, "sampler lse"));
  const size_t split_bytes = (sizeof(u64) + sizeof(unsigned)) * kSplitArgmaxRows;
  TESSERA_ASSIGN_OR_RETURN(m.split_argmax, DeviceBuffer::allocate(split_bytes, "sampler argmax"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(m.split_argmax.get(), 0, split_bytes, stream),
                               "zeroing the sampler's argmax");
  if (max_logprobs > 0) {
    TESSERA_ASSIGN_OR_RETURN(
        m.top_scratch,
        DeviceBuffer::allocate(sizeof(u64) * static_cast<size_t>(max_rows) * max_logprobs,
                               "sampler top logprobs"));
  }
  for (int slot = 0; slot < 2; ++slot) {
    TESSERA_ASSIGN_OR_RETURN(m.host_results[slot],
                             pinned_alloc(m.results_bytes(), "sampler results"));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&m.done[slot], cudaEventDisableTiming),
                                 "sampler events");
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(m.counts.get(), 0, cells * sizeof(int32_t), stream),
                               "zeroing sampler counts");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "GpuSampler::create");
  return Expected<std::unique_ptr<GpuSampler>>(std::move(s));
}

GpuSampler::~GpuSampler() = default;

Status GpuSampler::argmax(const float* logits, int rows, int32_t* ids, cudaStream_t stream) const {
  if (rows < 0 || (rows > 0 && (logits == nullptr || ids == nullptr))) {
    return invalid_argument("GpuSampler::argmax: need logits and ids for " + std::to_string(rows) +
                            " rows");
  }
  if (rows == 0) return Status::ok();
  const Impl& m = *impl_;
  const bool vec = m.vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  argmax_kernel<<<rows, kThreads, 0, stream>>>(logits, m.vocab, vec, nullptr, nullptr, ids);
  return launch_status("argmax_kernel");
}

Expected<std::vector<SampleResult>> GpuSampler::sample(float* logits,
                                                       std::span<const SampleRow> rows) {
  TESSERA_ASSIGN_OR_RETURN(SampleTicket ticket, enqueue(logits, rows));
  return finish(ticket);
}

__global__ void fill_tokens_kernel(int32_t* ids, const int32_t* pairs, int n, const int32_t* tokens,
                                   int stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) ids[pairs[2 * i]] = tokens[static_cast<int64_t>(pairs[2 * i + 1]) * stride];
}

__global__ void pack_tokens_kernel(const int32_t* tokens, int stride, int n, int32_t* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = tokens[static_cast<int64_t>(i) * stride];
}

Status fill_tokens(int32_t* ids, const int32_t* pairs, int n, const int32_t* tokens, int stride,
                   cudaStream_t stream) {
  if (n < 0 || stride < 1 || (n > 0 && (ids == nullptr || pairs == nullptr || tokens == nullptr))) {
    return invalid_argument("fill_tokens: need ids, pairs and tokens for " + std::to_string(n) +
                            " tokens");
  }
  if (n == 0) return Status::ok();
  fill_tokens_kernel<<<(n + 127) / 128, 128, 0, stream>>>(ids, pairs, n, tokens, stride);
  return launch_status("fill_tokens_kernel");
}

Status pack_tokens(const int32_t* tokens, int stride, int n, int32_t* out, cudaStream_t stream) {
  if (n < 0 || stride < 1 || (n > 0 && (tokens == nullptr || out == nullptr))) {
    return invalid_argument("pack_tokens: need tokens and room for " + std::to_string(n));
  }
  if (n == 0) return Status::ok();
  pack_tokens_kernel<<<(n + 127) / 128, 128, 0, stream>>>(tokens, stride, n, out);
  return launch_status("pack_tokens_kernel");
}

const int32_t* GpuSampler::tokens(int* stride) const {
  static_assert(sizeof(RowResult) % sizeof(int32_t) == 0 && offsetof(RowResult, token) == 0);
  *stride = static_cast<int>(sizeof(RowResult) / sizeof(int32_t));
  return reinterpret_cast<const int32_t*>(impl_->results.get());
}

Expected<SampleTicket> GpuSampler::enqueue(float* logits, std::span<const SampleRow> rows) {
  Impl& m = *impl_;
  if (rows.size() > static_cast<size_t>(m.max_rows)) {
    return invalid_argument("sample: " + std::to_string(rows.size()) +
                            " rows, the sampler was created for at most " +
                            std::to_string(m.max_rows));
  }
  const int n = static_cast<int>(rows.size());
  SampleTicket ticket;
  if (n == 0) return ticket;
  if (logits == nullptr) return invalid_argument("sample: no logits");
  const int slot = m.next;
  if (m.busy[slot]) {
    return failed_precondition("sample: two calls are outstanding already (finish one first)");
  }

  // Everything is checked before anything is enqueued.
  TESSERA_ASSIGN_OR_RETURN(const Impl::BatchShape shape, m.check_rows(rows));
  // Up to the copy back; on a failure the stream is drained before returning, so that the
  // pinned buffers are never rewritten under a copy in flight.
  const Status enqueued = m.enqueue_rows(logits, rows, shape, slot);
  if (!enqueued.is_ok()) {
    cudaStreamSynchronize(m.stream);
    cudaGetLastError();
    return enqueued;
  }
  m.busy[slot] = true;
  m.next = 1 - slot;
  ticket.slot = slot;
  ticket.logprobs.reserve(rows.size());
  for (const SampleRow& r : rows) ticket.logprobs.push_back(r.params.logprobs);
  return ticket;
}

Expected<std::vector<SampleResult>> GpuSampler::finish(const SampleTicket& ticket) {
  if (ticket.slot < 0) return std::vector<SampleResult>{};
  Impl& m = *impl_;
  const int slot = ticket.slot;
  if (!m.busy[slot]) return failed_precondition("sample: this call was finished already");
  m.busy[slot] = false;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(m.done[slot]), "sample");
  const int n = static_cast<int>(ticket.logprobs.size());
  const auto* h_results = reinterpret_cast<const RowResult*>(m.host_results[slot].get());
  const auto* h_tops =
      reinterpret_cast<const TopEntry*>(m.host_results[slot].get() + m.tops_offset());
  std::vector<SampleResult> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const RowResult& r = h_results[i];
    if (r.status == kRowNoFiniteLogit) {
      return failed_precondition("sample: row " + std::to_string(i) +
                                 " has no finite logit to sample from");
    }
    if (r.status != kRowOk || r.token < 0 || r.token >= m.vocab) {
      return internal_error("sample: row " + std::to_string(i) + ": the draw found no token");
    }
    SampleResult& res = out[i];
    res.token = r.token;
    const int lp = ticket.logprobs[i];
    if (lp < 0) {
      res.logprob = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    res.logprob = r.logprob;
    const int top = std::min(lp, m.vocab);
    res.top_logprobs.reserve(static_cast<size_t>(top));
    const TopEntry* t = h_tops + static_cast<size_t>(i) * m.max_logprobs;
    for (int j = 0; j < top; ++j) res.top_logprobs.emplace_back(t[j].id, t[j].logprob);
  }
  return out;
}

}  // namespace tessera::cuda
