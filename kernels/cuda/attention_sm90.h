// The Hopper (sm_90a) prefill attention kernel, private to kernels/cuda: paged_attention
// (attention.cu) checks the arguments and picks it (AttentionArgs::kernel); this launches it.
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"

namespace tessera::cuda::attn {

// Launches the kernel for checked `args` that hopper_prefill_applies, with `params` built from
// them. Graph-capturable.
Status hopper_prefill(const Params& params, const AttentionArgs& args, cudaStream_t stream);

}  // namespace tessera::cuda::attn
