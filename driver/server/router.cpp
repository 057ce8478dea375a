#include "driver/server/router.h"

#include <algorithm>
#include <string>

#include "driver/engine/block_manager.h"

namespace tessera::server {

Expected<RouterPolicy> parse_router_policy(std::string_view text) {
  if (text == "round_robin") return RouterPolicy::kRoundRobin;
  if (text == "least_load") return RouterPolicy::kLeastLoad;
  if (text == "prefix") return RouterPolicy::kPrefix;
  return invalid_argument("--router: '" + std::string(text) +
                          "' is not a policy (round_robin, least_load, prefix)");
}

const char* router_policy_name(RouterPolicy policy) {
  switch (policy) {
    case RouterPolicy::kRoundRobin:
      return "round_robin";
    case RouterPolicy::kLeastLoad:
      return "least_load";
    case RouterPolicy::kPrefix:
      return "prefix";
  }
  return "?";
}

double load_score(const ReplicaLoad& r) {
  return static_cast<double>(r.outstanding) +
         static_cast<double>(r.waiting_prompt_tokens) / kTokensPerLoad;
}

Router::Router(RouterPolicy policy, size_t replicas, size_t block_size, size_t blocks_per_replica)
    : policy_(policy),
      block_size_(std::max<size_t>(block_size, 1)),
      capacity_(std::max<size_t>(blocks_per_replica, 1)),
      mirrors_(replicas) {}

std::optional<size_t> Router::least_loaded(const std::vector<ReplicaLoad>& load) const {
  std::optional<size_t> best;
  // From next_ on, so that equal loads (an idle start) go to the replicas in turn.
  for (size_t k = 0; k < load.size(); ++k) {
    const size_t i = (next_ + k) % load.size();
    if (!load[i].routable) continue;
    if (!best || load_score(load[i]) < load_score(load[*best])) best = i;
  }
  return best;
}

size_t Router::matched_blocks(const Mirror& m, const std::vector<uint64_t>& chain) const {
  size_t n = 0;
  while (n < chain.size() && m.index.count(chain[n]) != 0) ++n;
  return n;
}

void Router::remember(Mirror& m, const std::vector<uint64_t>& chain) {
  for (uint64_t h : chain) {
    auto it = m.index.find(h);
    if (it != m.index.end()) {
      m.lru.splice(m.lru.begin(), m.lru, it->second);
      continue;
    }
    m.lru.push_front(h);
    m.index.emplace(h, m.lru.begin());
    if (m.index.size() > capacity_) {
      m.index.erase(m.lru.back());
      m.lru.pop_back();
    }
  }
}

void Router::forget(size_t replica) {
  mirrors_[replica].lru.clear();
  mirrors_[replica].index.clear();
}

size_t Router::add_replica() {
  mirrors_.emplace_back();
  return mirrors_.size() - 1;
}

std::optional<RouteDecision> Router::route(std::span<const int32_t> prompt,
                                           const std::vector<ReplicaLoad>& load) {
  // The chain hashes of the prompt's full blocks, as the replica's block manager computes them.
  std::vector<uint64_t> chain;
  if (policy_ == RouterPolicy::kPrefix) {
    uint64_t parent = BlockManager::kRootHash;
    for (size_t b = 0; (b + 1) * block_size_ <= prompt.size(); ++b) {
      parent = BlockManager::hash_block(parent, prompt.subspan(b * block_size_, block_size_));
      chain.push_back(parent);
    }
  }
  std::optional<size_t> pick;
  size_t matched = 0;
  switch (policy_) {
    case RouterPolicy::kRoundRobin:
      for (size_t k = 0; k < load.size() && !pick; ++k) {
        const size_t i = (next_ + k) % load.size();
        if (load[i].routable) pick = i;
      }
      break;
    case RouterPolicy::kLeastLoad:
      pick = least_loaded(load);
      break;
    case RouterPolicy::kPrefix: {
      pick = least_loaded(load);
      if (!pick) break;
      const double least = load_score(load[*pick]);
      for (size_t i = 0; i < load.size(); ++i) {
        if (!load[i].routable) continue;
        const size_t m = matched_blocks(mirrors_[i], chain);
        const double score = load_score(load[i]);
        const bool too_busy = score - least > kBalanceAbs && score > kBalanceRel * least;
        if (m > matched && !too_busy) {
          matched = m;
          pick = i;
        }
      }
      break;
    }
  }
  if (!pick) return std::nullopt;
  next_ = (*pick + 1) % load.size();
  if (policy_ == RouterPolicy::kPrefix) remember(mirrors_[*pick], chain);
  return RouteDecision{*pick, matched * block_size_};
}

}  // namespace tessera::server
