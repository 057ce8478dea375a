// KV-cache blocks of the paged cache, owned by the driver: reference-counted blocks, per-sequence
// block tables and the prefix cache. A block holds `block_size` tokens of every layer's K and V
// on every actor.
//
// Prefix caching (vLLM's automatic prefix caching, nano-vllm's hash chain): a full block whose
// K/V are computed is keyed by a hash of its tokens chained with the hash of the block before
// it, so a key names the whole prefix up to the block's end. A new sequence whose first blocks'
// keys are cached shares those blocks (reference counts) instead of computing them. A block
// whose count drops to zero keeps its content and key, and counts as free: it is evicted (least
// recently freed first) only when a fresh block is needed and no never-cached one is left.
//
// A hit is trusted only when it is verified, never on the hash alone: the cached block's own
// token ids must equal the sequence's, and the block must have been computed right after the
// very block (same physical id, same allocation epoch) that the sequence's previous hit is.
// By induction the whole prefix matches, so a hash collision costs a miss, never wrong output.
//
// Shared blocks are never written: a sequence computes only positions past its cached prefix,
// and the prefix never covers its last token (that one is recomputed for its logits).
//
// Sliding window (window > 0: every layer of the model attends to the last `window` positions
// only, ModelConfig::kv_cache_window): once a step has computed a sequence up to position c, no
// later query reads the K/V of positions before c - window + 1, so release_out_of_window() hands
// the blocks wholly before that back (a long sequence holds about (window + chunk) / block_size
// + 1 blocks). Their table entries become kFreedBlock: the table stays indexed by position (the
// actors keep the ids they were sent; the attention kernels never read blocks before a query's
// window). A freed block that was cached stays in the prefix cache like any released one, so a
// new sequence with the same prefix can still hit it: its content depends only on the tokens up
// to its end. A block whose predecessor the sequence no longer held when it filled is not cached
// (its parent link could not be verified). When only some layers slide (Gemma's local layers)
// the window is 0 and every block is kept; vLLM's hybrid allocator (a block pool per window) is
// the step beyond.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "driver/engine/sequence.h"

namespace tessera {

class BlockManager {
 public:
  // The key of a full block: a hash of the previous block's key (kRootHash for the first) and
  // the block's token ids. Replaceable for tests (a weak hash to force collisions).
  using Hasher = uint64_t (*)(uint64_t parent, std::span<const int32_t> tokens);
  static constexpr uint64_t kRootHash = 0;
  // The default hasher: a 64-bit mix of every token and the parent key.
  static uint64_t hash_block(uint64_t parent, std::span<const int32_t> tokens);

  // A block_table entry whose block release_out_of_window() gave back.
  static constexpr uint32_t kFreedBlock = UINT32_MAX;

  // window: 0 = keep every block of a sequence; > 0 = the sliding window, in tokens, of every
  // layer (blocks before it are freed as sequences advance).
  BlockManager(uint32_t num_blocks, uint32_t block_size, bool prefix_caching = true,
               Hasher hasher = &hash_block, uint32_t window = 0);

  uint32_t block_size() const { return block_size_; }
  uint32_t window() const { return window_; }
  uint32_t total_blocks() const { return num_blocks_; }
  // Blocks no sequence holds: never-cached ones and cached ones with no reference.
  uint32_t free_blocks() const { return static_cast<uint32_t>(free_.size() + evictable_.size()); }
  // Of the free blocks, those holding cached content.
  uint32_t cached_free_blocks() const { return static_cast<uint32_t>(evictable_.size()); }
  uint32_t used_blocks() const { return num_blocks_ - free_blocks(); }
  bool prefix_caching() const { return prefix_caching_; }

  // Blocks needed to hold `tokens` tokens.
  uint32_t blocks_for(size_t tokens) const;
  // The most tokens one step may compute for one sequence so that the blocks it holds then fit
  // the whole cache: unbounded (SIZE_MAX) without a window; with one, a step computing n tokens
  // holds at most (window + n - 2) / block_size + 2 blocks (its window's and its own), so
  // (total_blocks - 2) * block_size - window + 2; 0 when not even one token fits.
  size_t max_step_tokens() const;
  // Whether one sequence of `tokens` tokens can ever run alone in this cache.
  bool fits_alone(size_t tokens) const;

  // The cached blocks of seq's longest verified prefix of full blocks, first block first: at
  // most (seq.total() - 1) / block_size blocks, so the last token is always computed. Empty
  // when prefix caching is off. Precondition: seq holds no blocks.
  std::vector<uint32_t> match_prefix(const Sequence& seq) const;
  // Whether seq, taking `hits` (from match_prefix, unchanged since), can hold `tokens` tokens.
  bool can_admit(std::span<const uint32_t> hits, size_t tokens) const;
  // Gives seq the hit blocks (seq.computed = their tokens) and fresh blocks up to `tokens`
  // tokens; counts a prefix-cache query of seq.total() tokens and its hits. Precondition:
  // can_admit(hits, tokens), seq holds no blocks.
  void admit(Sequence& seq, const std::vector<uint32_t>& hits, size_t tokens);

  // Whether `seq` can grow to `tokens` tokens with the free blocks left.
  bool can_grow(const Sequence& seq, size_t tokens) const;
  // Appends fresh blocks to seq.block_table until it holds `tokens` tokens (evicting cached
  // content if it must). Precondition: can_grow.
  void grow(Sequence& seq, size_t tokens);
  // Caches seq's blocks that seq.computed has filled since the last call (no-op when prefix
  // caching is off). Call once the step that computed them has succeeded.
  void commit(Sequence& seq);
  // With a window: frees seq's blocks that lie wholly before the window of position
  // seq.computed (the next query's), which no later step reads; their entries become
  // kFreedBlock. Call after commit(), once the step that computed up to seq.computed has
  // succeeded (every block it frees has been sent to the actors then). No-op without a window.
  void release_out_of_window(Sequence& seq);
  // Drops seq's references to its blocks (last block first, so a sequence's tail is evicted
  // before its head); seq.block_table and seq.block_hashes are cleared, seq.freed_blocks is 0.
  void release(Sequence& seq);

  // Prefix-cache statistics since construction, in tokens: looked up at admissions, and found.
  uint64_t prefix_queries() const { return queries_; }
  uint64_t prefix_hits() const { return hits_; }

 private:
  static constexpr uint32_t kNoBlock = UINT32_MAX;
  struct Block {
    uint32_t refs = 0;
    uint64_t epoch = 0;   // bumped each time the block is handed out fresh (its content changes)
    bool cached = false;  // in the cache: key, tokens and parent below are set
    uint64_t key = 0;
    std::vector<int32_t> tokens;
    uint32_t parent = kNoBlock;  // the block computed right before it (none for a first block)
    uint64_t parent_epoch = 0;
    std::list<uint32_t>::iterator lru;  // in evictable_ while cached and unreferenced
  };

  // A fresh block: a never-cached free one, else the least recently freed cached one.
  uint32_t allocate();
  // Drops one reference to block b (to the free pool or the evictable list at zero).
  void unref(uint32_t b);
  // Whether `candidate` holds block `index` of `seq` after `previous` (kNoBlock for index 0).
  bool verified(uint32_t candidate, const Sequence& seq, size_t index, uint32_t previous) const;
  // The token ids of block `index` of seq.
  std::vector<int32_t> block_tokens(const Sequence& seq, size_t index) const;

  uint32_t num_blocks_;
  uint32_t block_size_;
  bool prefix_caching_;
  Hasher hasher_;
  uint32_t window_;
  std::vector<Block> blocks_;
  std::vector<uint32_t> free_;     // never-cached free blocks, a stack
  std::list<uint32_t> evictable_;  // cached, unreferenced blocks, least recently freed first
  std::unordered_map<uint64_t, uint32_t> cache_;  // key -> cached block
  uint64_t queries_ = 0;
  uint64_t hits_ = 0;
};

}  // namespace tessera
