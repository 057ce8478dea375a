// The engine behind the server: a ModelSession (worker group + LlmEngine) running on its own
// thread (through the EngineHost seam below, which tests fill with a fake), which owns everything
// Cap'n Proto (the KJ event loop is bound to one thread), like vLLM's EngineCore beside its API
// server. Other threads add and abort requests through a queue; each request's outputs go to its
// own sink, called on the engine thread (a sink only hands them over, e.g. posts them to the HTTP
// connection's executor).
//
// The loop: take queued adds/aborts, run one engine step when anything is unfinished (steps
// keep running while requests arrive), else wait for work while processing the cluster's
// events (an actor's death). A request is checked before it is queued (prompt and sampling
// against the model), so a bad one is refused at once and never reaches the engine.
//
// When an actor dies, the requests that already streamed tokens fail naming the cause (their
// KV cache is gone), the worker group is started again (new actors, the model reloaded: the
// session's restart()), and the requests that had not produced anything yet run on it as if
// nothing happened; requests that arrive meanwhile wait. A request that was in the failed step
// each time the group died, kMaxRequestRestarts times (a prompt that kills its actors: a poison
// request), fails with the cause instead of running again. Health is false from the death until
// the group is back: the group sees a death within about a second, whether its daemon reports
// it or the actor's, daemon's or head's connection drops. The group restarts on the nodes that
// are left (a new local node when the local one died). After kMaxRestarts failed restarts in a
// row the engine gives up: every request fails and health stays false. /metrics counts restarts.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "driver/model_session.h"

namespace tessera::server {

// What the engine thread drives: a served model's LlmEngine over its worker group, and the
// group's life. A ModelSession in production (AsyncEngine::start(EngineArgs, ...)), a fake in
// tests. Used on the engine thread only.
class EngineHost {
 public:
  virtual ~EngineHost() = default;
  // The engine over the current group; a new one after each restart().
  virtual LlmEngine& engine() = 0;
  virtual const ModelInfo& model() const = 0;
  virtual double load_seconds() const = 0;
  // Every actor of the group alive; else death() says why, in words.
  virtual bool alive() const = 0;
  virtual std::string death() const = 0;
  // A new group and a fresh engine (ModelSession::restart()).
  virtual Status restart() = 0;
  // Processes the cluster's events (death reports) without blocking.
  virtual void poll() = 0;
  // Stopping: drops the steps in flight, waiting for them at most `within`.
  virtual Status abort_steps(std::chrono::milliseconds within) = 0;
  // The ids of the nodes the group's ranks run on (none for a fake).
  virtual std::vector<std::string> nodes() const { return {}; }
  // Out of service: stops the group (its actors); nothing but the destructor follows.
  virtual void retire() {}
};

class AsyncEngine {
 public:
  // Called on the engine thread with each output of one request; the last has finished set.
  using Sink = std::function<void(RequestOutput)>;

  // Opens the session (places the actors, loads the model) on the engine thread and starts the
  // loop; returns when the model is ready or failed to load.
  static Expected<std::unique_ptr<AsyncEngine>> start(EngineArgs args, std::string owner);
  // The same over any host: `open` is called once, on the engine thread (which then owns the
  // host and its event loop), before start returns. session() is not available.
  using OpenHost = std::function<Expected<std::unique_ptr<EngineHost>>()>;
  static Expected<std::unique_ptr<AsyncEngine>> start(OpenHost open);
  // Stops the loop (unfinished requests end with kAbort) and closes the session.
  ~AsyncEngine();

  // Queues a request (made against loaded(): request.h); its outputs go to `sink`. UNAVAILABLE
  // (nothing queued) while the engine shuts down.
  Expected<uint64_t> add(Request request, Sink sink);
  // Ends a request (its client went away); its sink gets a last output with kAbort. Unknown
  // or finished ids are ignored.
  void abort(uint64_t id);
  // Takes the engine out of service (a drained replica): unfinished requests end with kAbort,
  // the worker group stops (its actors exit), health turns false with `why`, and add() refuses
  // from then on. The session (tokenizer, config, plan) stays until the engine is destroyed.
  // Returns once the actors are stopped.
  Status retire(const std::string& why);

  // Every actor alive and the loop running.
  bool healthy() const { return healthy_.load(); }
  std::string unhealthy_reason() const;
  EngineStats stats() const;
  // The nodes (ids) its ranks run on, as last placed (a restart may move them).
  std::vector<std::string> nodes() const;

  // The session, for what does not change when the engine thread restarts the worker group:
  // the tokenizer, the config, the plan. Its model() and engine() belong to the engine thread.
  // Only for an engine started from EngineArgs.
  const ModelSession& session() const;
  // The model as it was loaded at start (a copy: safe from any thread).
  const ModelInfo& loaded() const { return loaded_; }
  double load_seconds() const { return load_seconds_; }

 private:
  AsyncEngine() = default;
  void run();
  void drain_commands();
  // After run(): every unfinished or queued request ends (kAbort), the steps in flight dropped.
  void end_requests();

  struct Command {
    bool abort = false;
    uint64_t id = 0;
    std::optional<Request> request;  // none for an abort
    Sink sink;
  };

  std::unique_ptr<EngineHost> host_;       // engine thread only (after start)
  const ModelSession* session_ = nullptr;  // the host's, when it is a ModelSession
  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Command> commands_;
  bool stop_ = false;
  bool retire_ = false;   // retire() asked: run() ends, then the group stops
  bool retired_ = false;  // the group has stopped
  std::atomic<bool> healthy_{false};
  std::string unhealthy_;
  EngineStats stats_;
  std::vector<std::string> nodes_;
  std::atomic<uint64_t> next_id_{1};
  ModelInfo loaded_;  // as loaded at start
  double load_seconds_ = 0;
  static constexpr int kMaxRestarts = 3;
  static constexpr int kMaxRequestRestarts = 2;
  // How long stopping waits for the steps in flight before the group is torn down.
  static constexpr std::chrono::milliseconds kStopWait{3000};
  // Engine thread only; copied into stats_.
  uint64_t restarts_ = 0, restart_failures_ = 0, requests_failed_by_restarts_ = 0;
  void publish_stats();
  void recover();
  void fail_all(const Status& why);
  void set_unhealthy(const std::string& why);
  // Engine thread only: every unfinished request, by our id, and the engine's ids to ours.
  struct Tracked {
    Request request;  // kept to run it again on a restarted group
    Sink sink;
    uint64_t engine_id = 0;
    bool emitted = false;         // it has streamed tokens: it cannot be rerun unnoticed
    bool in_failed_step = false;  // it was in the step that failed when the group died
    int deaths = 0;               // group deaths it was running at
  };
  std::unordered_map<uint64_t, Tracked> tracked_;
  std::unordered_map<uint64_t, uint64_t> ours_;  // engine id -> our id
  bool given_up_ = false;
};

}  // namespace tessera::server
