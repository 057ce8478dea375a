#include "driver/engine/block_manager.h"

#include <algorithm>

#include "common/status.h"

namespace tessera {
namespace {

// splitmix64's finalizer: every input bit affects every output bit.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

}  // namespace

uint64_t BlockManager::hash_block(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = mix64(parent + kGolden);
  for (int32_t t : tokens)
    h = mix64(h + kGolden * (static_cast<uint64_t>(static_cast<uint32_t>(t)) + 1));
  return mix64(h ^ tokens.size());
}

BlockManager::BlockManager(uint32_t num_blocks, uint32_t block_size, bool prefix_caching,
                           Hasher hasher, uint32_t window)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(prefix_caching),
      hasher_(hasher),
      window_(window),
      blocks_(num_blocks) {
  TESSERA_CHECK(block_size > 0);
  TESSERA_CHECK(hasher != nullptr);
  free_.reserve(num_blocks);
  for (uint32_t b = num_blocks; b > 0; --b) free_.push_back(b - 1);
}

uint32_t BlockManager::blocks_for(size_t tokens) const {
  return static_cast<uint32_t>((tokens + block_size_ - 1) / block_size_);
}

size_t BlockManager::max_step_tokens() const {
  if (window_ == 0) return SIZE_MAX;
  const int64_t n = (static_cast<int64_t>(num_blocks_) - 2) * block_size_ - window_ + 2;
  return n > 0 ? static_cast<size_t>(n) : 0;
}

bool BlockManager::fits_alone(size_t tokens) const {
  if (window_ == 0) return blocks_for(tokens) <= num_blocks_;
  return blocks_for(tokens) <= num_blocks_ || max_step_tokens() > 0;
}

std::vector<int32_t> BlockManager::block_tokens(const Sequence& seq, size_t index) const {
  std::vector<int32_t> tokens(block_size_);
  for (size_t i = 0; i < block_size_; ++i) tokens[i] = seq.token_at(index * block_size_ + i);
  return tokens;
}

bool BlockManager::verified(uint32_t candidate, const Sequence& seq, size_t index,
                            uint32_t previous) const {
  const Block& b = blocks_[candidate];
  if (!b.cached || b.parent != previous) return false;
  if (previous != kNoBlock && b.parent_epoch != blocks_[previous].epoch) return false;
  for (size_t i = 0; i < block_size_; ++i) {
    if (b.tokens[i] != seq.token_at(index * block_size_ + i)) return false;
  }
  return true;
}

std::vector<uint32_t> BlockManager::match_prefix(const Sequence& seq) const {
  std::vector<uint32_t> hits;
  if (!prefix_caching_ || seq.total() == 0) return hits;
  TESSERA_CHECK(seq.block_table.empty(), "match_prefix for a sequence that holds blocks");
  const size_t max_blocks = (seq.total() - 1) / block_size_;
  uint64_t key = kRootHash;
  uint32_t previous = kNoBlock;
  for (size_t i = 0; i < max_blocks; ++i) {
    key = hasher_(key, block_tokens(seq, i));
    auto it = cache_.find(key);
    if (it == cache_.end() || !verified(it->second, seq, i, previous)) break;
    previous = it->second;
    hits.push_back(previous);
  }
  return hits;
}

bool BlockManager::can_admit(std::span<const uint32_t> hits, size_t tokens) const {
  size_t need = blocks_for(tokens);
  size_t fresh = need > hits.size() ? need - hits.size() : 0;
  // Hits nobody holds come out of the free pool too.
  size_t idle_hits = 0;
  for (uint32_t b : hits) idle_hits += blocks_[b].refs == 0;
  return fresh + idle_hits <= free_blocks();
}

void BlockManager::admit(Sequence& seq, const std::vector<uint32_t>& hits, size_t tokens) {
  TESSERA_CHECK(seq.block_table.empty(), "admit a sequence that holds blocks");
  TESSERA_CHECK(can_admit(hits, tokens), "admit without enough free blocks");
  for (uint32_t b : hits) {
    Block& block = blocks_[b];
    if (block.refs++ == 0) evictable_.erase(block.lru);
    seq.block_table.push_back(b);
    seq.block_hashes.push_back(block.key);
  }
  seq.computed = hits.size() * block_size_;
  if (prefix_caching_) {
    queries_ += seq.total();
    hits_ += seq.computed;
  }
  grow(seq, std::max(tokens, seq.computed));
}

bool BlockManager::can_grow(const Sequence& seq, size_t tokens) const {
  uint32_t need = blocks_for(tokens);
  uint32_t have = static_cast<uint32_t>(seq.block_table.size());
  return need <= have || need - have <= free_blocks();
}

uint32_t BlockManager::allocate() {
  uint32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    TESSERA_CHECK(!evictable_.empty(), "allocate with no free block");
    b = evictable_.front();
    evictable_.pop_front();
    Block& evicted = blocks_[b];
    auto it = cache_.find(evicted.key);
    if (it != cache_.end() && it->second == b) cache_.erase(it);
    evicted.cached = false;
    evicted.tokens.clear();
  }
  Block& block = blocks_[b];
  block.refs = 1;
  ++block.epoch;
  return b;
}

void BlockManager::grow(Sequence& seq, size_t tokens) {
  TESSERA_CHECK(can_grow(seq, tokens), "grow without enough free blocks");
  while (seq.block_table.size() < blocks_for(tokens)) seq.block_table.push_back(allocate());
}

void BlockManager::commit(Sequence& seq) {
  if (!prefix_caching_) return;
  const size_t full = std::min<size_t>(seq.computed / block_size_, seq.block_table.size());
  for (size_t i = seq.block_hashes.size(); i < full; ++i) {
    std::vector<int32_t> tokens = block_tokens(seq, i);
    uint64_t key = hasher_(i == 0 ? kRootHash : seq.block_hashes[i - 1], tokens);
    seq.block_hashes.push_back(key);
    // Its predecessor already freed (a window shorter than a block): the parent link cannot be
    // verified, so the block stays uncached.
    if (i > 0 && seq.block_table[i - 1] == kFreedBlock) continue;
    Block& block = blocks_[seq.block_table[i]];
    // A key already cached (another sequence computed the same prefix meanwhile, or a
    // collision) keeps its block; this one stays uncached and is freed plainly.
    if (block.cached || cache_.count(key)) continue;
    block.cached = true;
    block.key = key;
    block.tokens = std::move(tokens);
    block.parent = i == 0 ? kNoBlock : seq.block_table[i - 1];
    block.parent_epoch = i == 0 ? 0 : blocks_[block.parent].epoch;
    cache_.emplace(key, seq.block_table[i]);
  }
}

void BlockManager::unref(uint32_t b) {
  Block& block = blocks_[b];
  TESSERA_CHECK(block.refs > 0, "release of a free block");
  if (--block.refs > 0) return;
  if (block.cached) {
    block.lru = evictable_.insert(evictable_.end(), b);
  } else {
    free_.push_back(b);
  }
}

void BlockManager::release_out_of_window(Sequence& seq) {
  if (window_ == 0 || seq.computed < window_) return;
  // Positions before computed - window + 1 are outside every later query's window.
  const size_t dead = std::min((seq.computed - window_ + 1) / block_size_, seq.block_table.size());
  // Oldest first: the head of a sequence is evicted before blocks freed later.
  for (; seq.freed_blocks < dead; ++seq.freed_blocks) {
    unref(seq.block_table[seq.freed_blocks]);
    seq.block_table[seq.freed_blocks] = kFreedBlock;
  }
}

void BlockManager::release(Sequence& seq) {
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) {
    if (*it != kFreedBlock) unref(*it);
  }
  seq.block_table.clear();
  seq.block_hashes.clear();
  seq.freed_blocks = 0;
}

}  // namespace tessera
