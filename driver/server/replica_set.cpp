#include "driver/server/replica_set.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <utility>

#include "driver/plan/plan_command.h"
#include "driver/status.h"

namespace tessera::server {

void add_replica_options(CLI::App* cmd, ReplicaOptions& options) {
  add_data_parallel_option(cmd, options.data_parallel_size);
  cmd->add_option_function<std::string>(
         "--router",
         [&options](const std::string& text) {
           auto policy = parse_router_policy(text);
           if (!policy) throw CLI::ValidationError(policy.status().message());
           options.router = *policy;
         },
         "With -dp: round_robin | least_load | prefix (the replica holding the longest cached "
         "prefix of the prompt unless it is much busier; the default)")
      ->type_name("POLICY");
}

const char* replica_state_name(ReplicaState state) {
  switch (state) {
    case ReplicaState::kServing:
      return "serving";
    case ReplicaState::kDraining:
      return "draining";
    case ReplicaState::kRemoved:
      return "removed";
  }
  return "?";
}

ReplicaSet::ReplicaSet(RouterPolicy policy, const ModelInfo& model)
    : router_(policy, 0, static_cast<size_t>(model.block_size),
              static_cast<size_t>(model.kv_blocks)) {}

namespace {

// "-dp 3: 2 replicas fit; replica 2: <why> (tessera plan -dp 3 shows the placements)".
Status replicas_short(const ParallelSize& dp, size_t fit, const Status& why) {
  return Status(why.code(), "-dp " + dp.to_string() + ": " + std::to_string(fit) +
                                (fit == 1 ? " replica fits" : " replicas fit") + "; replica " +
                                std::to_string(fit) + ": " + why.message() + " (tessera plan -dp " +
                                dp.to_string() + " shows the placements)");
}

// The daemons report their GPUs' memory with each heartbeat (every second): a plan made this
// long after a replica loaded sees the memory it took.
constexpr std::chrono::milliseconds kMemorySettles{2000};
// A replica that failed to start in the background is tried again this much later.
constexpr std::chrono::seconds kRetryGrowth{30};

// The nodes a replica's plan would use.
std::set<std::string> plan_nodes(const ClusterPlan& plan) {
  std::set<std::string> out;
  for (const PlacedRank& r : plan.placement.ranks) out.insert(r.node_id);
  return out;
}

}  // namespace

Expected<std::unique_ptr<ReplicaSet>> ReplicaSet::start(const EngineArgs& given,
                                                        const ReplicaOptions& options,
                                                        const std::string& owner) {
  const ParallelSize& dp = options.data_parallel_size;
  if (!dp.is_auto() && (dp.ranks < 1 || dp.ranks > kMaxParallelSize)) {
    return invalid_argument("-dp/--data-parallel-size must be auto or 1 to " +
                            std::to_string(kMaxParallelSize) + ", got " + dp.to_string());
  }
  const bool single = !dp.is_auto() && dp.ranks == 1;
  EngineArgs args = given;
  std::unique_ptr<LocalNode> local;
  if (!single && args.address.empty()) {
    // One node for all the replicas: each plan then sees what the ones before it hold.
    TESSERA_ASSIGN_OR_RETURN(local, LocalNode::start(args.tessera_binary));
    args.address = local->address();
    args.cluster_token = local->token();
  } else if (!args.address.empty() && args.cluster_token.empty()) {
    TESSERA_ASSIGN_OR_RETURN(HeadTarget head, find_head(args.address, "", args.cluster_token_file));
    args.cluster_token = head.token;
  }
  auto name = [&](size_t i) { return single ? owner : owner + " replica " + std::to_string(i); };
  if (!single) spdlog::info("replica 0: placing and loading");
  auto first = AsyncEngine::start(args, name(0));
  if (!first) return single ? first.status() : replicas_short(dp, 0, first.status());
  std::unique_ptr<ReplicaSet> set(new ReplicaSet(options.router, (*first)->loaded()));
  set->local_ = std::move(local);
  set->args_ = args;
  set->options_ = options;
  set->owner_ = owner;
  set->data_parallel_ = !single;
  set->first_ = first->get();
  set->attach(std::move(*first));
  // The others, one after another: each plan sees the ones before. auto: while one fits.
  for (size_t i = 1; dp.is_auto() || i < static_cast<size_t>(dp.ranks); ++i) {
    if (dp.is_auto()) {
      // The GPUs' memory as the daemons next report it (a heartbeat) after the last load.
      std::this_thread::sleep_for(kMemorySettles);
      EventLoop loop;
      auto status = collect_status(loop, args.address, args.cluster_token);
      if (!status) return status.status();
      if (Status room = set->room_for_replica(cluster_nodes(*status)); !room) {
        spdlog::info("-dp auto: {} replica(s) fit now ({}); a node that joins gets one more", i,
                     room.message());
        break;
      }
    } else if (!set->engine(i - 1)->nodes().empty()) {
      std::this_thread::sleep_for(kMemorySettles);
    }
    spdlog::info("replica {}: placing and loading", i);
    auto engine = AsyncEngine::start(args, name(i));
    if (!engine) return replicas_short(dp, i, engine.status());
    set->attach(std::move(*engine));
  }
  if (!single) {
    spdlog::info("{} replica(s) behind one endpoint, router {}", set->size(),
                 router_policy_name(options.router));
  }
  // A cluster to follow: drains, joins and replacements.
  if (!args.address.empty()) set->membership_ = std::thread([s = set.get()] { s->membership(); });
  return set;
}

std::unique_ptr<ReplicaSet> ReplicaSet::over(std::vector<std::unique_ptr<AsyncEngine>> engines,
                                             RouterPolicy policy) {
  std::unique_ptr<ReplicaSet> set(new ReplicaSet(policy, engines.front()->loaded()));
  set->first_ = engines.front().get();
  set->data_parallel_ = engines.size() > 1;
  for (auto& e : engines) set->attach(std::move(e));
  return set;
}

ReplicaSet::~ReplicaSet() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (membership_.joinable()) membership_.join();
  if (loading_.joinable()) loading_.join();
  if (monitor_.joinable()) monitor_.join();
  // Replicas next (their actors stop), then the node they ran on. No lock: nothing else runs.
  for (Replica& r : replicas_) r.engine.reset();
  local_.reset();
}

size_t ReplicaSet::attach(std::unique_ptr<AsyncEngine> engine) {
  std::unique_lock lock(mu_);
  const size_t i = replicas_.size();
  load_seconds_ += engine->load_seconds();
  Replica r;
  r.engine = std::move(engine);
  replicas_.push_back(std::move(r));
  load_.emplace_back();
  router_.add_replica();
  for (auto& [id, routed] : routed_) routed.tried.push_back(false);
  if (i > 0) {
    data_parallel_ = true;
    if (!monitor_.joinable()) monitor_ = std::thread([this] { monitor(); });
  }
  if (i > 0 || membership_.joinable()) {
    spdlog::info("replica {} is serving (on {}): the router sends it requests", i,
                 fmt::join(replicas_[i].engine->nodes(), ", "));
  }
  return i;
}

bool ReplicaSet::drain(size_t replica, const std::string& why) {
  std::lock_guard lock(mu_);
  if (replica >= replicas_.size() || replicas_[replica].state != ReplicaState::kServing) {
    return false;
  }
  replicas_[replica].state = ReplicaState::kDraining;
  replicas_[replica].note = why;
  load_[replica].routable = false;
  spdlog::warn(
      "replica {} is draining ({}): no new requests; it is removed once its {} "
      "request(s) finish",
      replica, why, load_[replica].outstanding);
  if (!monitor_.joinable()) monitor_ = std::thread([this] { monitor(); });
  return true;
}

size_t ReplicaSet::size() const {
  std::lock_guard lock(mu_);
  return replicas_.size();
}

size_t ReplicaSet::active() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const Replica& r : replicas_) n += r.state != ReplicaState::kRemoved;
  return n;
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
  r.tried.assign(replicas_.size(), false);
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
    bool any = false;
    for (size_t i = 0; i < replicas_.size(); ++i) {
      load_[i].routable =
          !r.tried[i] && replicas_[i].state == ReplicaState::kServing && engine(i)->healthy();
      any |= load_[i].routable;
    }
    if (!any) {
      // Nothing else serves (a drained -dp 1, its replacement still loading): a draining
      // replica keeps taking requests until one does, rather than the service refusing them.
      for (size_t i = 0; i < replicas_.size(); ++i) {
        load_[i].routable =
            !r.tried[i] && replicas_[i].state == ReplicaState::kDraining && engine(i)->healthy();
      }
    }
    // One replica: its own add() says why it refuses (it queues while it restarts).
    const bool alone = replicas_.size() == 1;
    if (alone) load_[0].routable = replicas_[0].state != ReplicaState::kRemoved;
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
    ++replicas_[replica].routed;
    replicas_[replica].matched_tokens += decision->matched_tokens;
    Request copy = *r.request;
    AsyncEngine* e = engine(replica);
    lock.unlock();  // the sink may run on the engine thread before add() returns
    auto engine_id = e->add(std::move(copy), [this, id, attempt](RequestOutput out) {
      on_output(id, attempt, std::move(out));
    });
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
    if (alone) return engine_id.status();
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
        replicas_.size() > 1 && !engine(r.replica)->healthy()) {
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
  out.request_id = id;  // ours, as add() returned it (the replica numbers its own)
  if (out.finished) {
    ReplicaLoad& l = load_[r.replica];
    l.outstanding -= std::min<uint64_t>(l.outstanding, 1);
    routed_.erase(it);
  }
  lock.unlock();
  (*sink)(std::move(out));
}

void ReplicaSet::monitor() {
  std::vector<bool> was_healthy;
  std::unique_lock lock(mu_);
  while (!stop_cv_.wait_for(lock, kMonitorPeriod, [this] { return stopping_; })) {
    was_healthy.resize(replicas_.size(), true);
    for (size_t i = 0; i < replicas_.size(); ++i) {
      if (replicas_[i].state == ReplicaState::kRemoved) continue;
      const bool healthy = engine(i)->healthy();
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
    lock.unlock();
    remove_idle_drained();
    lock.lock();
  }
}

void ReplicaSet::remove_idle_drained() {
  for (;;) {
    size_t replica = 0;
    AsyncEngine* e = nullptr;
    std::string why;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      for (size_t i = 0; i < replicas_.size() && e == nullptr; ++i) {
        if (replicas_[i].state == ReplicaState::kDraining && load_[i].outstanding == 0) {
          replica = i;
          e = engine(i);
          why = replicas_[i].note;
        }
      }
    }
    if (e == nullptr) return;
    // Idle: nothing is routed there any more, so its actors can stop.
    (void)e->retire(why);
    std::lock_guard lock(mu_);
    replicas_[replica].state = ReplicaState::kRemoved;
    router_.forget(replica);
    spdlog::info("replica {} removed ({}): its requests finished and its actors stopped", replica,
                 why);
  }
}

void ReplicaSet::move_unstarted(size_t replica) {
  std::unique_lock lock(mu_);
  bool other = false;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    other |= i != replica && replicas_[i].state == ReplicaState::kServing && engine(i)->healthy();
  }
  if (!other) return;  // nowhere better: they wait for it to come back
  std::vector<std::pair<uint64_t, uint64_t>> moving;  // (our id, its id on the replica)
  for (auto& [id, r] : routed_) {
    if (r.replica != replica || r.started || r.engine_id == 0) continue;
    moving.emplace_back(id, r.engine_id);
    unbook(r);
    r.tried[replica] = true;
    ++r.attempt;  // what the replica still says of it is dropped
  }
  AsyncEngine* e = engine(replica);
  for (const auto& [id, engine_id] : moving) {
    lock.unlock();
    e->abort(engine_id);
    lock.lock();
    if (Status st = dispatch(lock, id); !st) {
      auto it = routed_.find(id);
      if (it == routed_.end()) continue;
      std::shared_ptr<const AsyncEngine::Sink> sink = it->second.sink;
      routed_.erase(it);
      lock.unlock();
      RequestOutput failed;
      failed.request_id = id;
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
  AsyncEngine* e = nullptr;
  uint64_t engine_id = 0;
  {
    std::lock_guard lock(mu_);
    auto it = routed_.find(id);
    if (it == routed_.end() || it->second.engine_id == 0) return;
    e = engine(it->second.replica);
    engine_id = it->second.engine_id;
  }
  e->abort(engine_id);
}

Status ReplicaSet::room_for_replica(const std::vector<ClusterNode>& nodes) const {
  const EngineSpec& spec = args_;
  auto plan = plan_on_cluster(first_->session().config(), spec, nodes);
  if (!plan) return plan.status();
  if (!plan->fit) return plan->fit;
  if (plan->placement.cpu && options_.data_parallel_size.is_auto()) {
    // CPU ranks always place; auto gives each replica nodes of its own.
    std::set<std::string> used;
    {
      std::lock_guard lock(mu_);
      for (size_t i = 0; i < replicas_.size(); ++i) {
        if (replicas_[i].state == ReplicaState::kRemoved) continue;
        for (const std::string& n : engine(i)->nodes()) used.insert(n);
      }
    }
    for (const std::string& n : plan_nodes(*plan)) {
      if (used.contains(n)) return resource_exhausted("every node runs a replica already");
    }
  }
  return Status::ok();
}

void ReplicaSet::membership() {
  EventLoop loop;
  bool reported = false;  // a failure to reach the head, logged once
  std::string last_room;  // why no replica fits, logged when it changes
  std::unique_lock lock(mu_);
  while (!stop_cv_.wait_for(lock, kMembershipPeriod, [this] { return stopping_; })) {
    lock.unlock();
    auto status = collect_status(loop, args_.address, args_.cluster_token);
    lock.lock();
    if (stopping_) break;
    if (!status) {
      if (!reported) {
        spdlog::warn("membership: cannot read the cluster ({}); replicas serve on, retrying",
                     status.status().message());
      }
      reported = true;
      continue;
    }
    reported = false;
    std::set<std::string> draining;
    std::map<std::string, std::string> names;
    for (const NodeStatus& ns : status->nodes) {
      names[ns.node.node_id] = node_label(ns.node);
      if (ns.node.draining) draining.insert(ns.node.node_id);
    }
    // Replicas on a draining node drain.
    for (size_t i = 0; i < replicas_.size(); ++i) {
      if (replicas_[i].state != ReplicaState::kServing) continue;
      for (const std::string& n : engine(i)->nodes()) {
        if (!draining.contains(n)) continue;
        lock.unlock();
        drain(i, "node " + names[n] + " is draining");
        lock.lock();
        break;
      }
    }
    // Growth: one replica at a time, loaded in the background.
    if (loading_busy_ || std::chrono::steady_clock::now() < grow_after_) continue;
    size_t serving = 0;
    for (const Replica& r : replicas_) serving += r.state == ReplicaState::kServing;
    const ParallelSize& dp = options_.data_parallel_size;
    if (!dp.is_auto() && serving >= static_cast<size_t>(dp.ranks)) continue;
    lock.unlock();
    const Status room = room_for_replica(cluster_nodes(*status));
    lock.lock();
    if (stopping_) break;
    if (!room) {
      if (room.message() != last_room && !dp.is_auto()) {
        spdlog::warn("membership: {} of -dp {} replicas serve; another does not fit now: {}",
                     serving, dp.ranks, room.message());
      }
      last_room = room.message();
      continue;
    }
    last_room.clear();
    loading_busy_ = true;
    if (loading_.joinable()) {
      lock.unlock();
      loading_.join();  // the last one, finished
      lock.lock();
    }
    const size_t index = replicas_.size();
    spdlog::info("membership: room for replica {} ({}): placing and loading it in the background",
                 index, dp.is_auto() ? "-dp auto" : "-dp " + dp.to_string());
    loading_ = std::thread([this, index] {
      auto engine = AsyncEngine::start(args_, owner_ + " replica " + std::to_string(index));
      std::unique_lock lock(mu_);
      if (!engine) {
        spdlog::warn("membership: replica {} did not start: {}; trying again in {} s", index,
                     engine.status().message(), kRetryGrowth.count());
        grow_after_ = std::chrono::steady_clock::now() + kRetryGrowth;
      } else if (!stopping_) {
        grow_after_ = std::chrono::steady_clock::now() + kMemorySettles;
        lock.unlock();
        attach(std::move(*engine));
        lock.lock();
      } else {
        lock.unlock();
        engine->reset();
        lock.lock();
      }
      loading_busy_ = false;
    });
  }
}

bool ReplicaSet::healthy() const {
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < replicas_.size(); ++i) {
    if (replicas_[i].state == ReplicaState::kServing && engine(i)->healthy()) return true;
  }
  return false;
}

std::string ReplicaSet::unhealthy_reason() const {
  std::lock_guard lock(mu_);
  if (replicas_.size() == 1) {
    return replicas_[0].state == ReplicaState::kServing
               ? engine(0)->unhealthy_reason()
               : std::string(replica_state_name(replicas_[0].state)) + ": " + replicas_[0].note;
  }
  std::string out;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    const Replica& r = replicas_[i];
    std::string why;
    if (r.state != ReplicaState::kServing) {
      why = std::string(replica_state_name(r.state)) + " (" + r.note + ")";
    } else if (!engine(i)->healthy()) {
      why = engine(i)->unhealthy_reason();
    } else {
      continue;
    }
    out += (out.empty() ? "" : "; ") + std::string("replica ") + std::to_string(i) + ": " + why;
  }
  return out;
}

EngineStats ReplicaSet::stats() const {
  std::vector<std::pair<AsyncEngine*, bool>> engines;  // and whether it is removed
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < replicas_.size(); ++i) {
      engines.emplace_back(engine(i), replicas_[i].state == ReplicaState::kRemoved);
    }
  }
  EngineStats sum;
  for (const auto& [e, removed] : engines) {
    const EngineStats s = e->stats();
    if (!removed) {  // gauges: what serves now
      sum.running += s.running;
      sum.waiting += s.waiting;
      sum.kv_blocks_total += s.kv_blocks_total;
      sum.kv_blocks_used += s.kv_blocks_used;
    }
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
  std::lock_guard lock(mu_);
  std::vector<ReplicaView> out(replicas_.size());
  for (size_t i = 0; i < replicas_.size(); ++i) {
    const Replica& r = replicas_[i];
    out[i].state = r.state;
    out[i].note = r.note;
    out[i].nodes = engine(i)->nodes();
    out[i].healthy = r.state == ReplicaState::kServing && engine(i)->healthy();
    if (!out[i].healthy) {
      out[i].unhealthy_reason = r.state == ReplicaState::kServing
                                    ? engine(i)->unhealthy_reason()
                                    : std::string(replica_state_name(r.state)) + ": " + r.note;
    }
    out[i].routed = r.routed;
    out[i].outstanding = load_[i].outstanding;
    out[i].prefix_matched_tokens = r.matched_tokens;
    out[i].stats = engine(i)->stats();
  }
  return out;
}

}  // namespace tessera::server
