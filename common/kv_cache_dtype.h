// What the KV cache stores (vLLM's --kv-cache-dtype): the model's own dtype, or FP8 E4M3 with
// a scale of 1 (vLLM's default without calibrated scales), which halves a bf16 cache: twice the
// tokens in the same memory and half the bytes decode attention reads. Values are rounded to
// nearest even on the way in and saturate at +-448 (CUDA's __NV_SATFINITE); attention widens
// them back exactly (fp8_e4m3_to_float, common/tensor.h).
#pragma once

#include <cstddef>
#include <string_view>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

enum class KvCacheDtype : uint8_t {
  kAuto,     // the run dtype (bf16 / fp16 on the GPU, fp32 on the CPU backend)
  kFp8E4M3,  // --kv-cache-dtype fp8 or fp8_e4m3
};

// "auto", "fp8" or "fp8_e4m3" (vLLM's spellings). fp8_e5m2 and anything else: INVALID_ARGUMENT
// naming the accepted values.
Expected<KvCacheDtype> parse_kv_cache_dtype(std::string_view text);

// "auto" | "fp8_e4m3": the canonical spelling (parse_kv_cache_dtype reads it back).
const char* kv_cache_dtype_name(KvCacheDtype dtype);

// What the cache stores when the model runs in `run_dtype`, in safetensors' spelling: "F8_E4M3",
// or dtype_name(run_dtype).
const char* kv_cache_storage_name(KvCacheDtype dtype, DType run_dtype);

// Bytes per cached element when the model runs in `run_dtype`.
size_t kv_cache_element_size(KvCacheDtype dtype, DType run_dtype);

}  // namespace tessera
