// The server's engine thread over a fake host (no processes): a worker group that dies, its
// restart, the retry budget of the requests that were running, and the restart counters.
#include "driver/server/async_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "driver/server/replica_set.h"
#include "tests/driver/engine_fakes.h"

namespace tessera::server {
namespace {

using namespace std::chrono_literals;
using engine_testing::FakeDetokenizer;

constexpr int32_t kPoison = 42;  // a prompt token that kills the group whenever a step has it
constexpr const char* kDeath = "rank 0: actor a-1 was killed by signal 9";

// What the test sets and reads while the engine thread runs the host.
struct World {
  std::atomic<bool> dead{false};
  std::atomic<bool> kill_next_step{false};
  std::atomic<int> failing_restarts{0};  // restarts still to fail
  std::atomic<int> restarts{0};          // restarts that worked
};

// Runs steps at once (a token "a" for each sample, after 2 ms: a request of many tokens runs
// long enough to be seen running), unless the group is dead or the step kills it.
class FakeGroup final : public StepExecutor {
 public:
  explicit FakeGroup(World& world) : world_(world) {}

  Status submit(StepInput step) override {
    in_flight_.push_back(std::move(step));
    return Status::ok();
  }

  Expected<StepOutput> collect() override {
    StepInput step = std::move(in_flight_.front());
    in_flight_.pop_front();
    bool poison = world_.kill_next_step.exchange(false);
    for (const SeqStep& s : step.seqs) {
      poison |= std::find(s.tokens.begin(), s.tokens.end(), kPoison) != s.tokens.end();
    }
    if (poison) world_.dead = true;
    if (world_.dead) return unavailable("the connection to rank 0 broke");
    std::this_thread::sleep_for(2ms);
    StepOutput out;
    out.step_id = step.step_id;
    for (const SeqStep& s : step.seqs) {
      if (!s.sample) continue;
      SeqOutput o;
      o.request_id = s.request_id;
      o.sample.token = 1;
      out.outputs.push_back(o);
    }
    return out;
  }

 private:
  World& world_;
  std::deque<StepInput> in_flight_;
};

// A served model whose group is a FakeGroup; restart() makes a new group and a fresh engine, as
// ModelSession::restart() does.
class FakeHost final : public EngineHost {
 public:
  explicit FakeHost(World& world) : world_(world) {
    model_ = engine_testing::config().model;
    start_group();
  }
  ~FakeHost() override { engine_.reset(); }

  LlmEngine& engine() override { return *engine_; }
  const ModelInfo& model() const override { return model_; }
  double load_seconds() const override { return 0.0; }
  bool alive() const override { return !world_.dead; }
  std::string death() const override { return world_.dead ? kDeath : ""; }
  Status restart() override {
    if (world_.failing_restarts > 0) {
      --world_.failing_restarts;
      return unavailable("no node has a free CPU");
    }
    start_group();
    world_.dead = false;
    ++world_.restarts;
    return Status::ok();
  }
  void poll() override {}
  Status abort_steps(std::chrono::milliseconds) override { return Status::ok(); }

 private:
  void start_group() {
    engine_.reset();
    group_ = std::make_unique<FakeGroup>(world_);
    engine_ = std::make_unique<LlmEngine>(engine_testing::config(), *group_, detokenizer_);
  }

  World& world_;
  ModelInfo model_;
  FakeDetokenizer detokenizer_;
  std::unique_ptr<FakeGroup> group_;
  std::unique_ptr<LlmEngine> engine_;
};

// Queues a request made against the model the engine loaded, as the server makes its own.
Expected<uint64_t> add(AsyncEngine& engine, std::vector<int32_t> prompt, SamplingParams sampling,
                       AsyncEngine::Sink sink) {
  TESSERA_ASSIGN_OR_RETURN(Request r,
                           Request::make(std::move(prompt), std::move(sampling), engine.loaded()));
  return engine.add(std::move(r), std::move(sink));
}

// Every request's outputs, as the engine thread hands them over.
class Outputs {
 public:
  AsyncEngine::Sink sink() {
    return [this](RequestOutput out) {
      std::lock_guard<std::mutex> lock(mu_);
      by_request_[out.request_id].push_back(std::move(out));
      changed_.notify_all();
    };
  }
  // The last output of request `id` once it finished (a default one after 20 s).
  RequestOutput last(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(lock, 20s, [&] { return finished(id); });
    return finished(id) ? by_request_[id].back() : RequestOutput{};
  }
  // Waits until request `id` produced a token.
  bool started(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, 20s, [&] {
      for (const auto& o : by_request_[id]) {
        if (!o.new_tokens.empty()) return true;
      }
      return false;
    });
  }
  size_t tokens(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& o : by_request_[id]) n += o.new_tokens.size();
    return n;
  }

 private:
  bool finished(uint64_t id) {
    auto it = by_request_.find(id);
    return it != by_request_.end() && !it->second.empty() && it->second.back().finished;
  }

  std::mutex mu_;
  std::condition_variable changed_;
  std::map<uint64_t, std::vector<RequestOutput>> by_request_;
};

std::unique_ptr<AsyncEngine> start(World& world) {
  auto engine = AsyncEngine::start([&world]() -> Expected<std::unique_ptr<EngineHost>> {
    return std::unique_ptr<EngineHost>(std::make_unique<FakeHost>(world));
  });
  EXPECT_TRUE(engine) << engine.status().to_string();
  return engine ? std::move(*engine) : nullptr;
}

SamplingParams tokens(int n) {
  SamplingParams s;
  s.max_tokens = n;
  return s;
}

// Polls `done` for up to 20 s.
template <typename F>
bool eventually(F done) {
  for (int i = 0; i < 2000 && !done(); ++i) std::this_thread::sleep_for(10ms);
  return done();
}

TEST(AsyncEngineTest, ServesRequestsOverAHost) {
  World world;
  Outputs outs;  // outlives the engine, whose stop hands outputs to it
  auto engine = start(world);
  ASSERT_TRUE(engine);
  auto id = add(*engine, {1, 2}, tokens(3), outs.sink());
  ASSERT_TRUE(id) << id.status().to_string();
  RequestOutput last = outs.last(*id);
  EXPECT_EQ(last.finish_reason, FinishReason::kLength);
  EXPECT_TRUE(last.error.is_ok());
  EXPECT_EQ(outs.tokens(*id), 3u);
  EXPECT_TRUE(engine->healthy());
  // A prompt outside the vocabulary makes no Request: nothing reaches the engine.
  EXPECT_FALSE(add(*engine, {1000}, tokens(3), outs.sink()));
}

TEST(AsyncEngineTest, ARequestRunningAtEachDeathIsRetriedThenFailsWithTheBudgetMessage) {
  World world;
  Outputs outs;  // outlives the engine, whose stop hands outputs to it
  auto engine = start(world);
  ASSERT_TRUE(engine);
  // `streaming` has produced tokens when the poison request kills the group: its KV cache is
  // gone, so it fails naming the death. The poison request is run again on the new group, dies
  // with it again, and then fails instead of running a third time.
  auto streaming = add(*engine, {1}, tokens(200), outs.sink());
  ASSERT_TRUE(streaming);
  ASSERT_TRUE(outs.started(*streaming));
  auto poison = add(*engine, {kPoison, 1}, tokens(4), outs.sink());
  ASSERT_TRUE(poison);

  RequestOutput failed = outs.last(*streaming);
  EXPECT_EQ(failed.finish_reason, FinishReason::kError);
  EXPECT_EQ(failed.error.message(), kDeath);
  EXPECT_LT(outs.tokens(*streaming), 200u);

  RequestOutput gave_up = outs.last(*poison);
  EXPECT_EQ(gave_up.finish_reason, FinishReason::kError);
  EXPECT_EQ(gave_up.error.message(),
            std::string("the worker group died 2 times while this request was running, so it is "
                        "not run again (last: ") +
                kDeath + ")");
  EXPECT_EQ(gave_up.prompt_tokens, 2u);
  EXPECT_EQ(outs.tokens(*poison), 0u);

  ASSERT_TRUE(eventually([&] { return engine->stats().restarts == 2; }));
  EXPECT_EQ(world.restarts.load(), 2);
  const EngineStats stats = engine->stats();
  EXPECT_EQ(stats.restart_failures, 0u);
  EXPECT_EQ(stats.requests_failed_by_restarts, 1u);
  ASSERT_TRUE(eventually([&] { return engine->healthy(); }));

  // The new group serves.
  auto after = add(*engine, {1, 2}, tokens(3), outs.sink());
  ASSERT_TRUE(after);
  EXPECT_EQ(outs.last(*after).finish_reason, FinishReason::kLength);
  EXPECT_EQ(outs.tokens(*after), 3u);
}

TEST(AsyncEngineTest, AFailedRestartIsCountedAndTriedAgainWhileNewRequestsWait) {
  World world;
  Outputs outs;  // outlives the engine, whose stop hands outputs to it
  auto engine = start(world);
  ASSERT_TRUE(engine);
  auto running = add(*engine, {1}, tokens(200), outs.sink());
  ASSERT_TRUE(running);
  ASSERT_TRUE(outs.started(*running));
  world.failing_restarts = 1;
  world.kill_next_step = true;

  RequestOutput failed = outs.last(*running);
  EXPECT_EQ(failed.finish_reason, FinishReason::kError);
  EXPECT_EQ(failed.error.message(), kDeath);
  // The first restart fails; the next one comes after a pause, with the engine unhealthy and new
  // requests waiting for it.
  const std::string reason = std::string(kDeath) + "; restart failed: no node has a free CPU";
  ASSERT_TRUE(eventually([&] { return engine->unhealthy_reason() == reason; }));
  EXPECT_FALSE(engine->healthy());
  auto waiting = add(*engine, {1, 2}, tokens(3), outs.sink());
  ASSERT_TRUE(waiting);

  RequestOutput done = outs.last(*waiting);
  EXPECT_EQ(done.finish_reason, FinishReason::kLength);
  EXPECT_EQ(outs.tokens(*waiting), 3u);
  ASSERT_TRUE(eventually([&] { return engine->stats().restarts == 1; }));
  EXPECT_EQ(engine->stats().restart_failures, 1u);
  EXPECT_EQ(engine->stats().requests_failed_by_restarts, 0u);
  EXPECT_TRUE(engine->healthy());
}

TEST(AsyncEngineTest, StoppingAbortsUnfinishedRequests) {
  World world;
  Outputs outs;  // outlives the engine, whose stop hands outputs to it
  auto engine = start(world);
  ASSERT_TRUE(engine);
  auto id = add(*engine, {1}, tokens(200), outs.sink());
  ASSERT_TRUE(id);
  ASSERT_TRUE(outs.started(*id));
  engine.reset();
  EXPECT_EQ(outs.last(*id).finish_reason, FinishReason::kAbort);
}

// Two replicas (ReplicaSet over fake hosts): replica 0's group dies at its first step and never
// comes back. The requests it held had not started: they move to replica 1 and finish there,
// each exactly once with all its tokens; new requests skip the dead replica; health names it.
TEST(ReplicaSetTest, UnstartedRequestsOfADeadReplicaFinishOnAnother) {
  World w0, w1;
  w0.kill_next_step = true;
  w0.failing_restarts = 1000000;
  std::vector<std::unique_ptr<AsyncEngine>> engines;
  engines.push_back(start(w0));
  engines.push_back(start(w1));
  ASSERT_TRUE(engines[0] && engines[1]);
  const ModelInfo model = engines[0]->loaded();
  auto set = ReplicaSet::over(std::move(engines), RouterPolicy::kRoundRobin);

  constexpr int kRequests = 8;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> finished(kRequests, 0), tokens_seen(kRequests, 0);
  std::vector<RequestOutput> last(kRequests);
  for (int k = 0; k < kRequests; ++k) {
    auto r = Request::make({1, 2, 3}, tokens(5), model);
    ASSERT_TRUE(r);
    auto id = set->add(std::move(*r), [&, k](RequestOutput out) {
      std::lock_guard lock(mu);
      tokens_seen[k] += static_cast<int>(out.new_tokens.size());
      if (out.finished) {
        ++finished[k];
        last[k] = out;
        cv.notify_all();
      }
    });
    ASSERT_TRUE(id) << id.status().to_string();
  }
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 20s, [&] {
      return std::all_of(finished.begin(), finished.end(), [](int f) { return f > 0; });
    }));
  }
  std::this_thread::sleep_for(3 * ReplicaSet::kMonitorPeriod);  // anything duplicated shows
  std::lock_guard lock(mu);
  for (int k = 0; k < kRequests; ++k) {
    EXPECT_EQ(finished[k], 1) << k;
    EXPECT_EQ(last[k].finish_reason, FinishReason::kLength) << k << ": " << last[k].error.message();
    EXPECT_EQ(tokens_seen[k], 5) << k;
  }
  EXPECT_FALSE(set->replicas()[0].healthy);
  EXPECT_TRUE(set->healthy());
  EXPECT_NE(set->unhealthy_reason().find("replica 0: "), std::string::npos);
  EXPECT_EQ(set->replicas()[1].outstanding, 0u);
}

// Membership over fake hosts: a drained replica takes no new requests, finishes the one it
// holds (all its tokens, not aborted), and is then removed (retired: it refuses adds); a replica
// attached later takes traffic at once; with every replica drained the set answers UNAVAILABLE
// naming them.
TEST(ReplicaSetTest, ADrainedReplicaFinishesItsRequestsAndAnAttachedOneTakesTraffic) {
  World w0, w1, w2;
  std::vector<std::unique_ptr<AsyncEngine>> engines;
  engines.push_back(start(w0));
  engines.push_back(start(w1));
  ASSERT_TRUE(engines[0] && engines[1]);
  const ModelInfo model = engines[0]->loaded();
  auto set = ReplicaSet::over(std::move(engines), RouterPolicy::kRoundRobin);
  Outputs outs;
  auto add_one = [&](int max_tokens) -> Expected<uint64_t> {
    TESSERA_ASSIGN_OR_RETURN(Request r, Request::make({1, 2, 3}, tokens(max_tokens), model));
    return set->add(std::move(r), outs.sink());
  };
  auto held = add_one(200);  // round robin: replica 0
  ASSERT_TRUE(held) << held.status().to_string();
  ASSERT_TRUE(outs.started(*held));
  ASSERT_TRUE(set->drain(0, "node a is draining"));
  EXPECT_FALSE(set->drain(0, "again"));
  EXPECT_EQ(set->replicas()[0].state, ReplicaState::kDraining);
  std::vector<uint64_t> ids;
  for (int k = 0; k < 4; ++k) {
    auto id = add_one(3);
    ASSERT_TRUE(id) << id.status().to_string();
    ids.push_back(*id);
  }
  EXPECT_EQ(set->replicas()[0].routed, 1u);
  EXPECT_EQ(set->replicas()[1].routed, 4u);
  const RequestOutput last = outs.last(*held);
  EXPECT_EQ(last.finish_reason, FinishReason::kLength) << last.error.message();
  EXPECT_EQ(outs.tokens(*held), 200u);
  for (uint64_t id : ids) EXPECT_EQ(outs.last(id).finish_reason, FinishReason::kLength);
  // Idle now: the monitor removes it.
  for (int i = 0; i < 50 && set->replicas()[0].state != ReplicaState::kRemoved; ++i) {
    std::this_thread::sleep_for(ReplicaSet::kMonitorPeriod);
  }
  EXPECT_EQ(set->replicas()[0].state, ReplicaState::kRemoved);
  EXPECT_EQ(set->active(), 1u);
  EXPECT_TRUE(set->healthy());
  EXPECT_EQ(set->replicas()[0].note, "node a is draining");

  // A replica that joins takes requests from the next one on.
  auto joined = start(w2);
  ASSERT_TRUE(joined);
  EXPECT_EQ(set->attach(std::move(joined)), 2u);
  for (int k = 0; k < 4; ++k) {
    auto id = add_one(2);
    ASSERT_TRUE(id) << id.status().to_string();
    EXPECT_EQ(outs.last(*id).finish_reason, FinishReason::kLength);
  }
  EXPECT_EQ(set->replicas()[2].routed, 2u);
  EXPECT_EQ(set->replicas()[1].routed, 6u);
  EXPECT_EQ(set->replicas()[0].routed, 1u);

  // Nothing left serving: a draining replica still takes requests while it lives (a -dp 1
  // whose replacement loads); once the drained ones are removed, a clear refusal naming them.
  auto longer = add_one(200);  // round robin: replica 2
  ASSERT_TRUE(longer);
  ASSERT_TRUE(outs.started(*longer));
  ASSERT_TRUE(set->drain(1, "node b is draining"));
  ASSERT_TRUE(set->drain(2, "node c is draining"));
  auto still = add_one(2);
  ASSERT_TRUE(still) << still.status().to_string();
  EXPECT_EQ(outs.last(*still).finish_reason, FinishReason::kLength);
  EXPECT_EQ(outs.last(*longer).finish_reason, FinishReason::kLength);
  for (int i = 0; i < 50 && set->active() > 0; ++i) {
    std::this_thread::sleep_for(ReplicaSet::kMonitorPeriod);
  }
  EXPECT_EQ(set->active(), 0u);
  auto refused = add_one(2);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.status().code(), Code::kUnavailable);
  EXPECT_NE(refused.status().message().find("(node b is draining)"), std::string::npos)
      << refused.status().message();
  EXPECT_FALSE(set->healthy());
}

}  // namespace
}  // namespace tessera::server
