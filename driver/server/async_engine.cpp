#include "driver/server/async_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>

namespace tessera::server {

namespace {

// The production host: a ModelSession's worker group and engine.
class SessionHost final : public EngineHost {
 public:
  explicit SessionHost(std::unique_ptr<ModelSession> session) : session_(std::move(session)) {}
  const ModelSession& session() const { return *session_; }
  LlmEngine& engine() override { return session_->engine(); }
  const ModelInfo& model() const override { return session_->model(); }
  double load_seconds() const override { return session_->load_seconds(); }
  bool alive() const override { return session_->group().alive(); }
  std::string death() const override { return session_->group().death(); }
  Status restart() override { return session_->restart(); }
  void poll() override { session_->loop().wait_scope().poll(); }
  Status abort_steps(std::chrono::milliseconds within) override {
    auto dropped = session_->group().abort(within);
    return dropped ? Status::ok() : dropped.status();
  }
  void retire() override { session_->close(); }
  std::vector<std::string> nodes() const override {
    std::vector<std::string> out;
    for (const PlacedRank& r : session_->plan().placement.ranks) {
      if (std::find(out.begin(), out.end(), r.node_id) == out.end()) out.push_back(r.node_id);
    }
    return out;
  }

 private:
  std::unique_ptr<ModelSession> session_;
};

// The last output of request `id`, which failed.
RequestOutput failed_output(uint64_t id, Status why, size_t prompt_tokens = 0) {
  RequestOutput out;
  out.request_id = id;
  out.finished = true;
  out.finish_reason = FinishReason::kError;
  out.error = std::move(why);
  out.prompt_tokens = prompt_tokens;
  return out;
}

// The last output of request `id`, aborted before the engine had it.
RequestOutput aborted_output(uint64_t id) {
  RequestOutput out;
  out.request_id = id;
  out.finished = true;
  out.finish_reason = FinishReason::kAbort;
  return out;
}

}  // namespace

Expected<std::unique_ptr<AsyncEngine>> AsyncEngine::start(EngineArgs args, std::string owner) {
  const ModelSession* session = nullptr;  // written on the engine thread before start returns
  auto e = start([&]() -> Expected<std::unique_ptr<EngineHost>> {
    TESSERA_ASSIGN_OR_RETURN(auto opened, ModelSession::open(args, owner));
    auto host = std::make_unique<SessionHost>(std::move(opened));
    session = &host->session();
    return std::unique_ptr<EngineHost>(std::move(host));
  });
  if (!e) return e.status();
  (*e)->session_ = session;
  return e;
}

Expected<std::unique_ptr<AsyncEngine>> AsyncEngine::start(OpenHost open) {
  std::unique_ptr<AsyncEngine> e(new AsyncEngine());
  std::promise<Status> opened;
  auto ready = opened.get_future();
  AsyncEngine* self = e.get();
  e->thread_ = std::thread([self, open = std::move(open), &opened]() {
    auto host = open();
    if (!host) {
      opened.set_value(host.status());
      return;
    }
    self->host_ = std::move(*host);
    self->loaded_ = self->host_->model();
    self->load_seconds_ = self->host_->load_seconds();
    self->healthy_ = true;
    self->nodes_ = self->host_->nodes();
    self->publish_stats();
    opened.set_value(Status::ok());
    self->run();
    self->end_requests();
    std::unique_lock<std::mutex> lock(self->mu_);
    if (self->retire_ && !self->stop_) {
      // Retired: the group stops now; the session (tokenizer, config, plan) stays until the
      // engine is destroyed, on this thread, which owns the event loop.
      lock.unlock();
      self->host_->retire();
      lock.lock();
      self->retired_ = true;
      self->wake_.notify_all();
      self->wake_.wait(lock, [self] { return self->stop_; });
    }
    lock.unlock();
    self->host_.reset();  // the actors stop; on this thread, which owns the event loop
  });
  Status st = ready.get();
  if (!st) {
    e->thread_.join();
    return st;
  }
  return e;
}

const ModelSession& AsyncEngine::session() const {
  TESSERA_CHECK(session_ != nullptr, "AsyncEngine::session() of an engine over a test host");
  return *session_;
}

AsyncEngine::~AsyncEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Expected<uint64_t> AsyncEngine::add(Request request, Sink sink) {
  const uint64_t id = next_id_++;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return unavailable("the engine is shutting down");
    if (retire_) return unavailable("the replica was taken out of service: " + unhealthy_);
    commands_.push_back(Command{false, id, std::move(request), std::move(sink)});
  }
  wake_.notify_one();
  return id;
}

void AsyncEngine::abort(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Command c;
    c.abort = true;
    c.id = id;
    commands_.push_back(std::move(c));
  }
  wake_.notify_one();
}

std::string AsyncEngine::unhealthy_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unhealthy_;
}

std::vector<std::string> AsyncEngine::nodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return nodes_;
}

EngineStats AsyncEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void AsyncEngine::set_unhealthy(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  unhealthy_ = why;
  healthy_ = false;
}

void AsyncEngine::fail_all(const Status& why) {
  for (auto& [id, t] : tracked_) t.sink(failed_output(id, why, t.request.prompt().size()));
  tracked_.clear();
  ours_.clear();
}

void AsyncEngine::drain_commands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!healthy_ && !given_up_) {
      // Recovering: adds wait for the new group; aborts are taken now.
      std::deque<Command> later;
      for (Command& c : commands_) (c.abort ? batch : later).push_back(std::move(c));
      commands_.swap(later);
    } else {
      batch.swap(commands_);
    }
  }
  LlmEngine& engine = host_->engine();
  for (Command& c : batch) {
    if (c.abort) {
      auto it = tracked_.find(c.id);
      if (it == tracked_.end()) continue;  // finished already (or never queued)
      std::optional<RequestOutput> last;
      if (it->second.engine_id != 0) last = engine.abort_request(it->second.engine_id);
      if (!last) last = aborted_output(c.id);
      last->request_id = c.id;
      it->second.sink(std::move(*last));
      ours_.erase(it->second.engine_id);
      tracked_.erase(it);
      continue;
    }
    if (given_up_) {
      c.sink(failed_output(c.id, unavailable(unhealthy_reason())));
      continue;
    }
    auto engine_id = engine.add_request(*c.request);
    if (!engine_id) {
      c.sink(failed_output(c.id, engine_id.status()));
      continue;
    }
    tracked_.emplace(c.id, Tracked{std::move(*c.request), std::move(c.sink), *engine_id, false});
    ours_[*engine_id] = c.id;
  }
}

void AsyncEngine::publish_stats() {
  EngineStats now = host_->engine().stats();
  now.restarts = restarts_;
  now.restart_failures = restart_failures_;
  now.requests_failed_by_restarts = requests_failed_by_restarts_;
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = now;
}

void AsyncEngine::recover() {
  const std::string why = unhealthy_reason();
  // Requests that streamed tokens fail; so do those that were running each time the group
  // died; the others run again on the new group.
  for (auto it = tracked_.begin(); it != tracked_.end();) {
    Tracked& t = it->second;
    if (t.in_failed_step) ++t.deaths;
    t.in_failed_step = false;
    const bool poison = t.deaths >= kMaxRequestRestarts;
    if (t.emitted || poison) {
      RequestOutput last = failed_output(
          it->first,
          unavailable(poison ? "the worker group died " + std::to_string(t.deaths) +
                                   " times while this request was running, so it is not run "
                                   "again (last: " +
                                   why + ")"
                             : why),
          t.request.prompt().size());
      if (poison) {
        ++requests_failed_by_restarts_;
        spdlog::error("request {} failed: the group died {} times while it ran ({} prompt tokens)",
                      it->first, t.deaths, t.request.prompt().size());
      }
      t.sink(std::move(last));
      it = tracked_.erase(it);
    } else {
      it->second.engine_id = 0;
      ++it;
    }
  }
  ours_.clear();
  for (int attempt = 1; attempt <= kMaxRestarts; ++attempt) {
    spdlog::warn("restarting the worker group ({}), attempt {} of {}", why, attempt, kMaxRestarts);
    Status st = host_->restart();
    if (st) {
      spdlog::info("worker group restarted in {:.1f} s; serving again ({} queued request(s) rerun)",
                   host_->load_seconds(), tracked_.size());
      LlmEngine& engine = host_->engine();
      for (auto it = tracked_.begin(); it != tracked_.end();) {
        auto id = engine.add_request(it->second.request);
        if (!id) {
          it->second.sink(failed_output(it->first, id.status()));
          it = tracked_.erase(it);
          continue;
        }
        it->second.engine_id = *id;
        ours_[*id] = it->first;
        ++it;
      }
      ++restarts_;
      publish_stats();
      std::lock_guard<std::mutex> lock(mu_);
      healthy_ = true;
      unhealthy_.clear();
      nodes_ = host_->nodes();
      return;
    }
    ++restart_failures_;
    spdlog::error("restart failed: {}", st.message());
    set_unhealthy(why + "; restart failed: " + st.message());
    std::unique_lock<std::mutex> lock(mu_);
    if (wake_.wait_for(lock, std::chrono::seconds(2 * attempt),
                       [this] { return stop_ || retire_; })) {
      return;
    }
  }
  spdlog::error("giving up after {} failed restarts: the served model is down; restart the server",
                kMaxRestarts);
  given_up_ = true;
  fail_all(unavailable(unhealthy_reason()));
}

Status AsyncEngine::retire(const std::string& why) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) return unavailable("the engine is shutting down");
  if (!retire_) {
    retire_ = true;
    healthy_ = false;
    unhealthy_ = "taken out of service: " + why;
  }
  wake_.notify_all();
  wake_.wait(lock, [this] { return retired_ || stop_; });
  return Status::ok();
}

void AsyncEngine::run() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_ || retire_) break;
    }
    drain_commands();
    if (!given_up_ && !host_->alive()) {
      const std::string why = host_->death();
      spdlog::error("an actor of the served model died: {}", why);
      set_unhealthy(why);
      recover();
      continue;
    }
    LlmEngine& engine = host_->engine();
    if (!given_up_ && engine.has_unfinished()) {
      auto outputs = engine.step();
      if (!outputs) {
        // Not a failed step (those fail their requests): the engine itself cannot go on.
        spdlog::error("engine step failed: {}", outputs.status().message());
        set_unhealthy(outputs.status().message());
        recover();
        continue;
      }
      for (RequestOutput& out : *outputs) {
        auto o = ours_.find(out.request_id);
        if (o == ours_.end()) continue;
        const uint64_t ours = o->second;
        auto t = tracked_.find(ours);
        if (t == tracked_.end()) continue;
        const bool finished = out.finished;
        if (!out.new_tokens.empty()) t->second.emitted = true;
        if (finished && out.finish_reason == FinishReason::kError && !host_->alive()) {
          // Failed because an actor died: recovery decides (rerun, or fail naming the cause).
          t->second.in_failed_step = true;
          continue;
        }
        out.request_id = ours;
        t->second.sink(std::move(out));
        if (finished) {
          ours_.erase(o);
          tracked_.erase(t);
        }
      }
    } else {
      // Idle: process the cluster's events (death reports) and wait briefly for work.
      host_->poll();
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, std::chrono::milliseconds(2),
                     [this] { return stop_ || !commands_.empty(); });
    }
    publish_stats();
  }
}

void AsyncEngine::end_requests() {
  // Shutting down: every unfinished request ends, the steps in flight are dropped.
  {
    // Queued adds and aborts that never reached the engine.
    std::deque<Command> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(commands_);
    }
    for (Command& c : left) {
      if (!c.abort) c.sink(aborted_output(c.id));
    }
  }
  if (given_up_) return;  // fail_all ended them
  LlmEngine& engine = host_->engine();
  for (auto& [id, t] : tracked_) {
    std::optional<RequestOutput> last;
    if (t.engine_id != 0) last = engine.abort_request(t.engine_id);
    if (!last) last = aborted_output(id);
    last->request_id = id;
    t.sink(std::move(*last));
  }
  tracked_.clear();
  Status dropped = host_->abort_steps(kStopWait);
  if (!dropped) spdlog::warn("stopping: {}", dropped.message());
}

}  // namespace tessera::server
