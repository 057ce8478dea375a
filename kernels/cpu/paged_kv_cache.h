// The CPU backend's paged KV cache: fixed-size blocks of token slots, as in vLLM. The driver's
// block manager decides which block holds which tokens; this class only stores them.
//
// Storage, fp32, one array for K and one for V, each laid out
//   [layer][block][slot in block][kv_head][head_dim]
// so one token's K (or V) for a layer is num_kv_heads * head_dim contiguous floats, and a
// block is block_size such tokens. A token's global slot is block_id * block_size + offset.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include "common/kv_cache_dtype.h"
#include "common/status.h"

namespace tessera::cpu {

struct KvCacheShape {
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;  // tokens per block: the engine's (EngineSpec::block_size); required
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  // kFp8E4M3: write() rounds every value to E4M3 (stored as that float), so the cpu backend
  // computes what the GPU's FP8 cache holds; kAuto stores the values as given.
  KvCacheDtype dtype = KvCacheDtype::kAuto;

  int64_t token_elems() const { return num_kv_heads * head_dim; }
  int64_t num_slots() const { return num_blocks * block_size; }
};

class PagedKvCache {
 public:
  // Allocates 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim floats, zeroed.
  // They come from calloc: the kernel hands out zero pages as they are first written, so a cache
  // sized for a long context costs memory only for the tokens stored. INVALID_ARGUMENT for a
  // non-positive dimension, RESOURCE_EXHAUSTED when it cannot allocate.
  static Expected<PagedKvCache> create(const KvCacheShape& shape);

  PagedKvCache(PagedKvCache&&) = default;
  PagedKvCache& operator=(PagedKvCache&&) = default;
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;

  const KvCacheShape& shape() const { return shape_; }

  // Stores the K/V of n new tokens of one layer (reshape_and_cache).
  //   layer:        [0, num_layers)
  //   k, v:         [n, num_kv_heads, head_dim] fp32
  //   slot_mapping: [n] int64; slot of token i = block_id * block_size + offset, or -1 to skip
  //                 the token (vLLM's padding convention)
  // Everything is checked before anything is written: a slot outside [0, num_blocks *
  // block_size) other than -1, a bad layer or mismatched sizes are INVALID_ARGUMENT.
  Status write(int64_t layer, std::span<const float> k, std::span<const float> v,
               std::span<const int64_t> slot_mapping);

  // K / V of one token: [num_kv_heads, head_dim] fp32. Preconditions (unchecked): layer, block
  // and offset in range.
  const float* key(int64_t layer, int64_t block, int64_t offset) const {
    return k_.get() + index(layer, block, offset);
  }
  const float* value(int64_t layer, int64_t block, int64_t offset) const {
    return v_.get() + index(layer, block, offset);
  }

 private:
  PagedKvCache() = default;
  int64_t index(int64_t layer, int64_t block, int64_t offset) const {
    return ((layer * shape_.num_blocks + block) * shape_.block_size + offset) *
           shape_.token_elems();
  }

  KvCacheShape shape_;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free>
      k_;  // [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
  std::unique_ptr<float[], Free> v_;  // same layout
};

}  // namespace tessera::cpu
