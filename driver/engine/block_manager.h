// KV-cache blocks of the paged cache, owned by the driver: a free list and per-sequence block
// tables. A block holds `block_size` tokens of every layer's K and V on every actor.
#pragma once

#include <cstdint>
#include <vector>

#include "driver/engine/sequence.h"

namespace tessera {

class BlockManager {
 public:
  BlockManager(uint32_t num_blocks, uint32_t block_size);

  uint32_t block_size() const { return block_size_; }
  uint32_t free_blocks() const { return static_cast<uint32_t>(free_.size()); }
  uint32_t total_blocks() const { return num_blocks_; }

  // Blocks needed to hold `tokens` tokens.
  uint32_t blocks_for(size_t tokens) const;
  // Whether `seq` can grow to `tokens` tokens with the free blocks left.
  bool can_grow(const Sequence& seq, size_t tokens) const;
  // Appends blocks to seq.block_table until it holds `tokens` tokens. Precondition: can_grow.
  void grow(Sequence& seq, size_t tokens);
  // Returns all of seq's blocks to the free list.
  void release(Sequence& seq);

 private:
  uint32_t num_blocks_;
  uint32_t block_size_;
  std::vector<uint32_t> free_;  // a stack: recently freed blocks are reused first
};

}  // namespace tessera
