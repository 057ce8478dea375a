#include "driver/engine/block_manager.h"

#include "common/status.h"

namespace tessera {

BlockManager::BlockManager(uint32_t num_blocks, uint32_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  TESSERA_CHECK(block_size > 0);
  free_.reserve(num_blocks);
  for (uint32_t b = num_blocks; b > 0; --b) free_.push_back(b - 1);
}

uint32_t BlockManager::blocks_for(size_t tokens) const {
  return static_cast<uint32_t>((tokens + block_size_ - 1) / block_size_);
}

bool BlockManager::can_grow(const Sequence& seq, size_t tokens) const {
  uint32_t need = blocks_for(tokens);
  uint32_t have = static_cast<uint32_t>(seq.block_table.size());
  return need <= have || need - have <= free_.size();
}

void BlockManager::grow(Sequence& seq, size_t tokens) {
  TESSERA_CHECK(can_grow(seq, tokens), "grow without enough free blocks");
  while (seq.block_table.size() < blocks_for(tokens)) {
    seq.block_table.push_back(free_.back());
    free_.pop_back();
  }
}

void BlockManager::release(Sequence& seq) {
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) {
    free_.push_back(*it);
  }
  seq.block_table.clear();
}

}  // namespace tessera
