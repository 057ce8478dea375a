// The router of a data-parallel service (`tessera serve -dp N`): which replica takes a request.
//
//   round_robin  replicas in turn (routable ones only)
//   least_load   the replica with the least load: requests routed to it and not finished, plus
//                the prompt tokens of those that have not started yet (a 4,000-token prompt
//                waiting weighs like several short ones), as the router counts them itself (no
//                stale reports: a burst at an idle start is spread at once)
//   prefix       (the default) the replica that holds the longest cached prefix of the prompt,
//                unless it is much busier than the least loaded one (then load wins); no match:
//                least_load. SGLang's cache-aware router, without a tree: the router mirrors
//                each replica's prefix cache as the chain hashes of the full KV blocks it sent
//                there (the engine's own block hashing, block_manager.h), each replica's set
//                bounded and evicted least recently used, about as its cache evicts.
//
// A Router is not thread-safe: its owner (ReplicaSet) calls it under its lock.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace tessera::server {

enum class RouterPolicy : uint8_t { kRoundRobin, kLeastLoad, kPrefix };
// "round_robin" | "least_load" | "prefix"; else INVALID_ARGUMENT naming --router and the choices.
Expected<RouterPolicy> parse_router_policy(std::string_view text);
const char* router_policy_name(RouterPolicy policy);

// What the router knows of one replica when it decides.
struct ReplicaLoad {
  bool routable = true;                // healthy, and not draining
  uint64_t outstanding = 0;            // requests routed to it and not finished
  uint64_t waiting_prompt_tokens = 0;  // prompt tokens of those that produced nothing yet
};

// The load a decision compares: requests, plus waiting prompt tokens in units of kTokensPerLoad.
double load_score(const ReplicaLoad& r);
inline constexpr double kTokensPerLoad = 512.0;
// Prefix affinity yields to load when the matching replica's score exceeds the least loaded
// one's by both of these (SGLang's balance thresholds, in requests).
inline constexpr double kBalanceAbs = 8.0;
inline constexpr double kBalanceRel = 1.5;

struct RouteDecision {
  size_t replica = 0;
  size_t matched_tokens = 0;  // of the prompt, in the chosen replica's mirrored prefix cache
};

class Router {
 public:
  // `blocks_per_replica`: how many block hashes each replica's mirror keeps (its KV blocks).
  Router(RouterPolicy policy, size_t replicas, size_t block_size, size_t blocks_per_replica);

  // Picks a replica for `prompt` among the routable ones of `load` (one entry per replica) and
  // records that it will hold the prompt's full blocks. nullopt when none is routable.
  std::optional<RouteDecision> route(std::span<const int32_t> prompt,
                                     const std::vector<ReplicaLoad>& load);
  // A replica whose cache is empty again (restarted, removed).
  void forget(size_t replica);
  // One more replica (a node joined), with an empty mirror; returns its index.
  size_t add_replica();

  RouterPolicy policy() const { return policy_; }
  size_t replicas() const { return mirrors_.size(); }
  size_t cached_blocks(size_t replica) const { return mirrors_[replica].index.size(); }

 private:
  // A replica's mirrored prefix cache: block chain hashes, most recently used first.
  struct Mirror {
    std::list<uint64_t> lru;
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> index;
  };
  size_t matched_blocks(const Mirror& m, const std::vector<uint64_t>& chain) const;
  void remember(Mirror& m, const std::vector<uint64_t>& chain);
  std::optional<size_t> least_loaded(const std::vector<ReplicaLoad>& load) const;

  RouterPolicy policy_;
  size_t block_size_;
  size_t capacity_;
  size_t next_ = 0;  // round robin's, and the tie-break that spreads equal loads
  std::vector<Mirror> mirrors_;
};

}  // namespace tessera::server
