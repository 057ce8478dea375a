// The per-lane arithmetic of the q/k head norm and the rotary embedding, shared by
// rope_and_cache_kernel (elementwise.cu) and the decode attention that applies them itself
// (attention.cu, AttentionRope): the same expressions in one place, so both give the same bits.
// A warp holds one head: lane l its P rotation pairs (i, i + half), i = l P + p (0 where it holds
// none).
#pragma once

#include <cstdint>

#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda::rope {

// Qwen3's q_norm / k_norm, as rms_norm over the head's hd elements (every lane of the warp calls
// it: the sum of squares is a warp sum). nw1 / nw2: the weights of the lane's pairs; unit_offset:
// Gemma 3's (1 + w) * (h * inv) in fp32, rounded once.
template <typename T, int P>
__device__ __forceinline__ void head_norm(float (&f1)[P], float (&f2)[P], const float (&nw1)[P],
                                          const float (&nw2)[P], int64_t hd, float eps,
                                          bool unit_offset) {
  float ss = 0.0f;
#pragma unroll
  for (int p = 0; p < P; ++p) ss += f1[p] * f1[p] + f2[p] * f2[p];
  const float inv = rsqrtf(dev::warp_sum(ss) * (1.0f / static_cast<float>(hd)) + eps);
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (unit_offset) {
      f1[p] = dev::round_to<T>((1.0f + nw1[p]) * (f1[p] * inv));
      f2[p] = dev::round_to<T>((1.0f + nw2[p]) * (f2[p] * inv));
    } else {
      f1[p] = dev::round_to<T>(nw1[p] * dev::round_to<T>(f1[p] * inv));
      f2[p] = dev::round_to<T>(nw2[p] * dev::round_to<T>(f2[p] * inv));
    }
  }
}

// x * cos + rotate_half(x) * sin in the dtype: cos / sin rounded, each product and the sum
// rounded (lo: element i, hi: element i + half).
template <typename T, int P>
__device__ __forceinline__ void rotate(const float (&f1)[P], const float (&f2)[P],
                                       const float (&cs)[P], const float (&sn)[P], float (&lo)[P],
                                       float (&hi)[P]) {
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const float c = dev::round_to<T>(cs[p]);
    const float s = dev::round_to<T>(sn[p]);
    lo[p] = dev::round_to<T>(f1[p] * c) + dev::round_to<T>(-f2[p] * s);
    hi[p] = dev::round_to<T>(f2[p] * c) + dev::round_to<T>(f1[p] * s);
  }
}

}  // namespace tessera::cuda::rope
