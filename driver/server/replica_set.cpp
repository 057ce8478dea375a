#include "driver/server/replica_set.h"

#include <spdlog/spdlog.h>

#include <algorithm>
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
  for (size_t i = 0; i < n; ++i) {
    if (n > 1) spdlog::info("replica {} of {}: placing and loading", i, n);
    auto engine = AsyncEngine::start(args, n > 1 ? owner + " replica " + std::to_string(i) : owner);
    if (!engine) {
      if (n == 1) return engine.status();
      // "-dp 3: 2 replicas fit; replica 2: <why>" (tessera plan -dp shows the placements).
      return Status(engine.status().code(), "-dp " + std::to_string(n) + ": " + std::to_string(i) +
                                                (i == 1 ? " replica fits" : " replicas fit") +
                                                "; replica " + std::to_string(i) + ": " +
                                                engine.status().message() + " (tessera plan -dp " +
                                                std::to_string(n) + " shows the placements)");
    }
    engines.push_back(std::move(*engine));
  }
  auto set = over(std::move(engines), options.router);
  set->local_ = std::move(local);
  if (n > 1) {
    spdlog::info("{} replicas behind one endpoint, router {}", n,
                 router_policy_name(options.router));
  }
  return set;
}

std::unique_ptr<ReplicaSet> ReplicaSet::over(std::vector<std::unique_ptr<AsyncEngine>> engines,
                                             RouterPolicy policy) {
  std::unique_ptr<ReplicaSet> set(
      new ReplicaSet(policy, engines.size(), engines.front()->loaded()));
  set->engines_ = std::move(engines);
  for (const auto& e : set->engines_) set->load_seconds_ += e->load_seconds();
  if (set->engines_.size() > 1) set->monitor_ = std::thread([s = set.get()] { s->monitor(); });
  return set;
}

ReplicaSet::~ReplicaSet() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  // Replicas next (their actors stop), then the node they ran on.
  engines_.clear();
  local_.reset();
}

void ReplicaSet::unbook(Routed& r) {
  ReplicaLoad& l = load_[r.replica];
  l.outstanding -= std::min<uint64_t>(l.outstanding, 1);
  if (!r.started) l.waiting_prompt_tokens -= std::min(l.waiting_prompt_tokens, r.prompt_tokens);
}

Expected<uint64_t> ReplicaSet::add(Request request, AsyncEngine::Sink sink) {
  std::unique_lock lock(mu_);
  const uint64_t id = next_id_++;
  Routed& r = routed_[id];
  r.prompt_tokens = static_cast<uint64_t>(request.prompt().size());
  r.request = std::move(request);
  r.sink = std::make_shared<const AsyncEngine::Sink>(std::move(sink));
  r.tried.assign(engines_.size(), false);
  if (Status st = dispatch(lock, id); !st) {
    routed_.erase(id);
    return st;
  }
  return id;
}

Status ReplicaSet::dispatch(std::unique_lock<std::mutex>& lock, uint64_t id) {
  for (;;) {
    auto it = routed_.find(id);
    if (it == routed_.end()) return Status::ok();  // finished meanwhile
    Routed& r = it->second;
    for (size_t i = 0; i < engines_.size(); ++i) {
      load_[i].routable = !r.tried[i] && engines_[i]->healthy();
    }
    // One replica: its own add() says why it refuses (it queues while it restarts).
    if (engines_.size() == 1) load_[0].routable = true;
    const auto t0 = std::chrono::steady_clock::now();
    auto decision = router_.route(r.request->prompt(), load_);
    routing_.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (!decision) {
      lock.unlock();
      std::string why = unhealthy_reason();
      lock.lock();
      return unavailable("no healthy replica" + (why.empty() ? "" : ": " + why));
    }
    const size_t replica = decision->replica;
    r.replica = replica;
    r.engine_id = 0;
    const uint32_t attempt = ++r.attempt;
    ++load_[replica].outstanding;
    load_[replica].waiting_prompt_tokens += r.prompt_tokens;
    ++routed_count_[replica];
    matched_tokens_[replica] += decision->matched_tokens;
    Request copy = *r.request;
    lock.unlock();  // the sink may run on the engine thread before add() returns
    auto engine_id = engines_[replica]->add(
        std::move(copy),
        [this, id, attempt](RequestOutput out) { on_output(id, attempt, std::move(out)); });
    lock.lock();
    it = routed_.find(id);
    if (it == routed_.end() || it->second.attempt != attempt) return Status::ok();
    if (engine_id) {
      it->second.engine_id = *engine_id;
      return Status::ok();
    }
    // Refused there (it is stopping): another replica, if there is one.
    unbook(it->second);
    it->second.tried[replica] = true;
    if (engines_.size() == 1) return engine_id.status();
  }
}

void ReplicaSet::on_output(uint64_t id, uint32_t attempt, RequestOutput out) {
  std::unique_lock lock(mu_);
  auto it = routed_.find(id);
  if (it == routed_.end() || it->second.attempt != attempt) return;  // an attempt moved away
  const bool output = !out.new_tokens.empty() || !out.delta.empty();
  {
    Routed& r = it->second;
    if (!r.started && out.finished && out.finish_reason == FinishReason::kError && !output &&
        engines_.size() > 1 && !engines_[r.replica]->healthy()) {
      // Failed unstarted because its replica gave up: another replica runs it.
      spdlog::warn("replica {} failed a request before it started ({}): routing it again",
                   r.replica, out.error.message());
      unbook(r);
      r.tried[r.replica] = true;
      if (dispatch(lock, id).is_ok()) return;
      it = routed_.find(id);
      if (it == routed_.end()) return;
    }
  }
  Routed& r = it->second;
  if (!r.started && (output || out.finished)) {
    ReplicaLoad& l = load_[r.replica];
    l.waiting_prompt_tokens -= std::min(l.waiting_prompt_tokens, r.prompt_tokens);
    r.started = true;
    r.request.reset();
  }
  std::shared_ptr<const AsyncEngine::Sink> sink = r.sink;
  if (out.finished) {
    ReplicaLoad& l = load_[r.replica];
    l.outstanding -= std::min<uint64_t>(l.outstanding, 1);
    routed_.erase(it);
  }
  lock.unlock();
  (*sink)(std::move(out));
}

void ReplicaSet::monitor() {
  std::vector<bool> was_healthy(engines_.size(), true);
  std::unique_lock lock(mu_);
  while (!stop_cv_.wait_for(lock, kMonitorPeriod, [this] { return stopping_; })) {
    for (size_t i = 0; i < engines_.size(); ++i) {
      const bool healthy = engines_[i]->healthy();
      if (!healthy) {
        lock.unlock();
        move_unstarted(i);
        lock.lock();
        if (stopping_) return;
      }
      if (healthy != was_healthy[i]) {
        spdlog::warn("replica {} is {}", i,
                     healthy ? "healthy again: the router sends it requests"
                             : "unhealthy: the router skips it, and its requests that have not "
                               "started move to the others");
        was_healthy[i] = healthy;
      }
    }
  }
}

void ReplicaSet::move_unstarted(size_t replica) {
  std::unique_lock lock(mu_);
  bool other = false;
  for (size_t i = 0; i < engines_.size(); ++i) other |= i != replica && engines_[i]->healthy();
  if (!other) return;  // nowhere better: they wait for it to come back
  std::vector<std::pair<uint64_t, uint64_t>> moving;  // (our id, its id on the replica)
  for (auto& [id, r] : routed_) {
    if (r.replica != replica || r.started || r.engine_id == 0) continue;
    moving.emplace_back(id, r.engine_id);
    unbook(r);
    r.tried[replica] = true;
    ++r.attempt;  // what the replica still says of it is dropped
  }
  for (const auto& [id, engine_id] : moving) {
    lock.unlock();
    engines_[replica]->abort(engine_id);
    lock.lock();
    if (Status st = dispatch(lock, id); !st) {
      auto it = routed_.find(id);
      if (it == routed_.end()) continue;
      std::shared_ptr<const AsyncEngine::Sink> sink = it->second.sink;
      routed_.erase(it);
      lock.unlock();
      RequestOutput failed;
      failed.finished = true;
      failed.finish_reason = FinishReason::kError;
      failed.error = st;
      (*sink)(std::move(failed));
      lock.lock();
    }
  }
  if (!moving.empty()) {
    spdlog::warn("replica {} is unhealthy: {} request(s) that had not started moved", replica,
                 moving.size());
  }
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
