#include "driver/server/async_engine.h"

#include <spdlog/spdlog.h>

#include <future>

namespace tessera::server {

Expected<std::unique_ptr<AsyncEngine>> AsyncEngine::start(EngineArgs args, std::string owner) {
  std::unique_ptr<AsyncEngine> e(new AsyncEngine());
  std::promise<Status> opened;
  auto ready = opened.get_future();
  AsyncEngine* self = e.get();
  e->thread_ = std::thread([self, args = std::move(args), owner = std::move(owner), &opened]() {
    auto session = ModelSession::open(args, owner);
    if (!session) {
      opened.set_value(session.status());
      return;
    }
    self->session_ = std::move(*session);
    self->healthy_ = true;
    self->stats_ = self->session_->engine().stats();
    opened.set_value(Status::ok());
    self->run();
    self->session_.reset();  // the actors stop; on this thread, which owns the event loop
  });
  Status st = ready.get();
  if (!st) {
    e->thread_.join();
    return st;
  }
  return e;
}

AsyncEngine::~AsyncEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Expected<uint64_t> AsyncEngine::add(std::vector<int32_t> prompt, SamplingParams sampling,
                                    Sink sink) {
  const ModelInfo& m = session_->model();
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  for (int32_t id : prompt) {
    if (id < 0 || id >= m.vocab_size) {
      return invalid_argument("token id " + std::to_string(id) + " is outside the vocabulary");
    }
  }
  if (static_cast<int64_t>(prompt.size()) >= m.max_model_len) {
    return invalid_argument("the prompt has " + std::to_string(prompt.size()) +
                            " tokens; the context holds " + std::to_string(m.max_model_len));
  }
  TESSERA_RETURN_IF_ERROR(sampling.validate(m.vocab_size));
  const uint64_t id = next_id_++;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return unavailable("the engine is shutting down");
    commands_.push_back(
        Command{false, id, std::move(prompt), std::move(sampling), std::move(sink)});
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

EngineStats AsyncEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void AsyncEngine::drain_commands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(commands_);
  }
  LlmEngine& engine = session_->engine();
  for (Command& c : batch) {
    if (c.abort) {
      auto it = engine_id_.find(c.id);
      if (it == engine_id_.end()) continue;  // finished already (or never queued)
      if (auto last = engine.abort_request(it->second)) {
        auto sink = by_engine_id_.find(it->second);
        if (sink != by_engine_id_.end()) {
          last->request_id = c.id;
          sink->second.second(std::move(*last));
          by_engine_id_.erase(sink);
        }
      }
      engine_id_.erase(it);
      continue;
    }
    if (!healthy_) {
      RequestOutput failed;
      failed.request_id = c.id;
      failed.finished = true;
      failed.finish_reason = "error: " + unhealthy_reason();
      c.sink(std::move(failed));
      continue;
    }
    auto engine_id = engine.add_request(std::move(c.prompt), std::move(c.sampling));
    if (!engine_id) {
      RequestOutput failed;
      failed.request_id = c.id;
      failed.finished = true;
      failed.finish_reason = "error: " + engine_id.status().message();
      c.sink(std::move(failed));
      continue;
    }
    engine_id_[c.id] = *engine_id;
    by_engine_id_[*engine_id] = {c.id, std::move(c.sink)};
  }
}

void AsyncEngine::run() {
  LlmEngine& engine = session_->engine();
  WorkerGroup& group = session_->group();
  EventLoop& loop = session_->loop();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) break;
    }
    drain_commands();
    if (healthy_ && !group.alive()) {
      std::lock_guard<std::mutex> lock(mu_);
      unhealthy_ = group.death();
      healthy_ = false;
      spdlog::error("serving stops: {}; restart the server", unhealthy_);
    }
    if (engine.has_unfinished()) {
      auto outputs = engine.step();
      if (!outputs) {
        // Not a failed step (those fail their requests): the engine itself cannot go on.
        std::lock_guard<std::mutex> lock(mu_);
        unhealthy_ = outputs.status().message();
        healthy_ = false;
        spdlog::error("engine step failed: {}", unhealthy_);
      } else {
        for (RequestOutput& out : *outputs) {
          auto it = by_engine_id_.find(out.request_id);
          if (it == by_engine_id_.end()) continue;
          const uint64_t ours = it->second.first;
          const bool finished = out.finished;
          out.request_id = ours;
          it->second.second(std::move(out));
          if (finished) {
            by_engine_id_.erase(it);
            engine_id_.erase(ours);
          }
        }
      }
      if (!healthy_) {
        // Fail what is left: nothing will run it.
        for (auto& [engine_request, entry] : by_engine_id_) {
          if (auto last = engine.abort_request(engine_request)) {
            last->request_id = entry.first;
            last->finish_reason = "error: " + unhealthy_reason();
            entry.second(std::move(*last));
          }
        }
        by_engine_id_.clear();
        engine_id_.clear();
      }
    } else {
      // Idle: process the cluster's events (death reports) and wait briefly for work.
      loop.wait_scope().poll();
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, std::chrono::milliseconds(2),
                     [this] { return stop_ || !commands_.empty(); });
    }
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = engine.stats();
  }
  // Shutting down: every unfinished request ends, the steps in flight are dropped.
  for (auto& [engine_request, entry] : by_engine_id_) {
    if (auto last = engine.abort_request(engine_request)) {
      last->request_id = entry.first;
      entry.second(std::move(*last));
    }
  }
  by_engine_id_.clear();
  auto dropped = group.abort();
  if (!dropped) spdlog::warn("stopping: {}", dropped.status().message());
}

}  // namespace tessera::server
