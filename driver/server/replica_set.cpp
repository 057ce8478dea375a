#include "driver/server/replica_set.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <utility>

namespace tessera::server {

ReplicaSet::ReplicaSet(RouterPolicy policy, size_t replicas, const ModelInfo& model)
    : router_(policy, replicas, static_cast<size_t>(model.block_size),
              static_cast<size_t>(model.kv_blocks)),
      load_(replicas),
      routed_count_(replicas, 0),
      matched_tokens_(replicas, 0) {}

Expected<std::unique_ptr<ReplicaSet>> ReplicaSet::start(const EngineArgs& given,
                                                        const ReplicaOptions& options,
                                                        const std::string& owner) {
  if (options.data_parallel_size < 1) {
    return invalid_argument("-dp/--data-parallel-size must be at least 1, got " +
                            std::to_string(options.data_parallel_size));
  }
  const auto n = static_cast<size_t>(options.data_parallel_size);
  EngineArgs args = given;
  std::unique_ptr<LocalNode> local;
  if (n > 1 && args.address.empty()) {
    // One node for all the replicas: each plan then sees what the ones before it hold.
    TESSERA_ASSIGN_OR_RETURN(local, LocalNode::start(args.tessera_binary));
    args.address = local->address();
    args.cluster_token = local->token();
  }
  std::vector<std::unique_ptr<AsyncEngine>> engines;
  double load_seconds = 0;
  for (size_t i = 0; i < n; ++i) {
    if (n > 1) spdlog::info("replica {} of {}: placing and loading", i, n);
    auto engine = AsyncEngine::start(args, n > 1 ? owner + " replica " + std::to_string(i) : owner);
    if (!engine) {
      if (n == 1) return engine.status();
      return engine.status().with_context("replica " + std::to_string(i) + " of " +
                                          std::to_string(n) + " (-dp)");
    }
    load_seconds += (*engine)->load_seconds();
    engines.push_back(std::move(*engine));
  }
  std::unique_ptr<ReplicaSet> set(new ReplicaSet(options.router, n, engines.front()->loaded()));
  set->local_ = std::move(local);
  set->engines_ = std::move(engines);
  set->load_seconds_ = load_seconds;
  if (n > 1) {
    spdlog::info("{} replicas behind one endpoint, router {}", n,
                 router_policy_name(options.router));
  }
  return set;
}

ReplicaSet::~ReplicaSet() {
  // Replicas first (their actors stop), then the node they ran on.
  engines_.clear();
  local_.reset();
}

Expected<uint64_t> ReplicaSet::add(Request request, AsyncEngine::Sink sink) {
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < engines_.size(); ++i) load_[i].routable = engines_[i]->healthy();
  if (engines_.size() == 1) load_[0].routable = true;  // its own add() says why it refuses
  const auto t0 = std::chrono::steady_clock::now();
  auto decision = router_.route(request.prompt(), load_);
  routing_.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!decision) {
    lock.unlock();
    return unavailable("no healthy replica: " + unhealthy_reason());
  }
  const size_t r = decision->replica;
  const uint64_t id = next_id_++;
  const auto prompt_tokens = static_cast<uint64_t>(request.prompt().size());
  routed_[id] = Routed{r, 0, prompt_tokens, false};
  ++load_[r].outstanding;
  load_[r].waiting_prompt_tokens += prompt_tokens;
  ++routed_count_[r];
  matched_tokens_[r] += decision->matched_tokens;
  lock.unlock();  // the sink may run on the engine thread before add() returns
  auto wrapped = [this, id, sink = std::move(sink)](RequestOutput out) {
    {
      std::lock_guard guard(mu_);
      auto it = routed_.find(id);
      if (it != routed_.end()) {
        Routed& rr = it->second;
        ReplicaLoad& l = load_[rr.replica];
        if (!rr.started) {
          rr.started = true;
          l.waiting_prompt_tokens -= std::min(l.waiting_prompt_tokens, rr.prompt_tokens);
        }
        if (out.finished) {
          l.outstanding -= std::min<uint64_t>(l.outstanding, 1);
          routed_.erase(it);
        }
      }
    }
    sink(std::move(out));
  };
  auto engine_id = engines_[r]->add(std::move(request), std::move(wrapped));
  lock.lock();
  auto it = routed_.find(id);
  if (!engine_id) {
    if (it != routed_.end()) {
      ReplicaLoad& l = load_[r];
      l.outstanding -= std::min<uint64_t>(l.outstanding, 1);
      if (!it->second.started) {
        l.waiting_prompt_tokens -= std::min(l.waiting_prompt_tokens, prompt_tokens);
      }
      routed_.erase(it);
    }
    return engine_id.status();
  }
  if (it != routed_.end()) it->second.engine_id = *engine_id;
  return id;
}

void ReplicaSet::abort(uint64_t id) {
  size_t replica = 0;
  uint64_t engine_id = 0;
  {
    std::lock_guard lock(mu_);
    auto it = routed_.find(id);
    if (it == routed_.end() || it->second.engine_id == 0) return;
    replica = it->second.replica;
    engine_id = it->second.engine_id;
  }
  engines_[replica]->abort(engine_id);
}

bool ReplicaSet::healthy() const {
  for (const auto& e : engines_) {
    if (e->healthy()) return true;
  }
  return false;
}

std::string ReplicaSet::unhealthy_reason() const {
  if (engines_.size() == 1) return engines_.front()->unhealthy_reason();
  std::string out;
  for (size_t i = 0; i < engines_.size(); ++i) {
    if (engines_[i]->healthy()) continue;
    out += (out.empty() ? "" : "; ") + std::string("replica ") + std::to_string(i) + ": " +
           engines_[i]->unhealthy_reason();
  }
  return out;
}

EngineStats ReplicaSet::stats() const {
  EngineStats sum;
  for (const auto& e : engines_) {
    const EngineStats s = e->stats();
    sum.running += s.running;
    sum.waiting += s.waiting;
    sum.kv_blocks_total += s.kv_blocks_total;
    sum.kv_blocks_used += s.kv_blocks_used;
    sum.prefix_cache_queries += s.prefix_cache_queries;
    sum.prefix_cache_hits += s.prefix_cache_hits;
    sum.prompt_tokens += s.prompt_tokens;
    sum.generation_tokens += s.generation_tokens;
    sum.preemptions += s.preemptions;
    sum.restarts += s.restarts;
    sum.restart_failures += s.restart_failures;
    sum.requests_failed_by_restarts += s.requests_failed_by_restarts;
  }
  sum.kv_cache_usage = sum.kv_blocks_total == 0 ? 0.0
                                                : static_cast<double>(sum.kv_blocks_used) /
                                                      static_cast<double>(sum.kv_blocks_total);
  return sum;
}

Histogram ReplicaSet::routing_times() const {
  std::lock_guard lock(mu_);
  return routing_;
}

std::vector<ReplicaView> ReplicaSet::replicas() const {
  std::vector<ReplicaView> out(engines_.size());
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < engines_.size(); ++i) {
    out[i].healthy = engines_[i]->healthy();
    if (!out[i].healthy) out[i].unhealthy_reason = engines_[i]->unhealthy_reason();
    out[i].routed = routed_count_[i];
    out[i].outstanding = load_[i].outstanding;
    out[i].prefix_matched_tokens = matched_tokens_[i];
    out[i].stats = engines_[i]->stats();
  }
  return out;
}

}  // namespace tessera::server
