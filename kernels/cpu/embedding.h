// Token embedding lookup: the first op of the forward pass.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"

namespace tessera::cpu {

// out[i, :] = table[ids[i], :] converted to fp32.
//   table: [vocab, hidden], F32 / F16 / BF16 (embed_tokens.weight, HF layout)
//   ids:   [n] int32 token ids
//   out:   [n, hidden] fp32
// Every id is checked before anything is written: an id outside [0, vocab) is an
// INVALID_ARGUMENT naming the id and its index, never an out-of-bounds read.
Status embedding(CpuContext& ctx, const TensorView& table, std::span<const int32_t> ids,
                 std::span<float> out);

}  // namespace tessera::cpu
