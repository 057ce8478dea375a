#include "kernels/cpu/paged_kv_cache.h"

#include <cstring>
#include <limits>
#include <new>
#include <string>

namespace tessera::cpu {

Expected<PagedKvCache> PagedKvCache::create(const KvCacheShape& shape) {
  if (shape.num_layers <= 0 || shape.num_blocks <= 0 || shape.block_size <= 0 ||
      shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    return invalid_argument(
        "kv cache: every dimension must be positive (layers " + std::to_string(shape.num_layers) +
        ", blocks " + std::to_string(shape.num_blocks) + ", block_size " +
        std::to_string(shape.block_size) + ", kv_heads " + std::to_string(shape.num_kv_heads) +
        ", head_dim " + std::to_string(shape.head_dim) + ")");
  }
  // Overflow-safe element count.
  const int64_t max = std::numeric_limits<int64_t>::max() / 8;
  int64_t elems = 1;
  for (int64_t d :
       {shape.num_layers, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim}) {
    if (elems > max / d) return resource_exhausted("kv cache: size overflows");
    elems *= d;
  }
  PagedKvCache cache;
  cache.shape_ = shape;
  cache.k_.reset(static_cast<float*>(std::calloc(static_cast<size_t>(elems), sizeof(float))));
  cache.v_.reset(static_cast<float*>(std::calloc(static_cast<size_t>(elems), sizeof(float))));
  if (!cache.k_ || !cache.v_) {
    return resource_exhausted("kv cache: cannot allocate 2 x " + std::to_string(elems) +
                              " floats (" + std::to_string(elems * 8 >> 20) + " MiB)");
  }
  return cache;
}

Status PagedKvCache::write(int64_t layer, std::span<const float> k, std::span<const float> v,
                           std::span<const int64_t> slot_mapping) {
  if (layer < 0 || layer >= shape_.num_layers) {
    return invalid_argument("kv cache write: layer " + std::to_string(layer) + " is outside [0, " +
                            std::to_string(shape_.num_layers) + ")");
  }
  const int64_t n = static_cast<int64_t>(slot_mapping.size());
  const int64_t te = shape_.token_elems();
  if (static_cast<int64_t>(k.size()) != n * te || static_cast<int64_t>(v.size()) != n * te) {
    return invalid_argument("kv cache write: k and v must be [" + std::to_string(n) + ", " +
                            std::to_string(shape_.num_kv_heads) + ", " +
                            std::to_string(shape_.head_dim) + "], got " + std::to_string(k.size()) +
                            " and " + std::to_string(v.size()) + " elements");
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slot_mapping[i];
    if (slot != -1 && (slot < 0 || slot >= shape_.num_slots())) {
      return invalid_argument("kv cache write: slot " + std::to_string(slot) + " of token " +
                              std::to_string(i) + " is outside [0, " +
                              std::to_string(shape_.num_slots()) + ")");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slot_mapping[i];
    if (slot < 0) continue;
    const int64_t at = index(layer, slot / shape_.block_size, slot % shape_.block_size);
    if (shape_.dtype == KvCacheDtype::kFp8E4M3) {
      for (int64_t e = 0; e < te; ++e) {
        k_[at + e] = fp8_e4m3_to_float(float_to_fp8_e4m3(k[i * te + e]));
        v_[at + e] = fp8_e4m3_to_float(float_to_fp8_e4m3(v[i * te + e]));
      }
    } else {
      std::memcpy(k_.get() + at, k.data() + i * te, te * sizeof(float));
      std::memcpy(v_.get() + at, v.data() + i * te, te * sizeof(float));
    }
  }
  return Status::ok();
}

}  // namespace tessera::cpu
