#include "driver/server/replica_generate.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace tessera::server {

namespace {

using Clock = std::chrono::steady_clock;

// The outputs of one call, handed from the replicas' engine threads to the calling thread.
// Shared with the sinks, which the replicas keep until each request's last output.
struct Inbox {
  std::mutex mu;
  std::condition_variable arrived;
  std::deque<std::pair<size_t, RequestOutput>> outputs;  // (request index, output); under mu
};

// A replica publishes its stats after the step whose outputs it handed over: how long the call
// waits for them to count every token it received.
constexpr std::chrono::seconds kStatsWait{2};

// A counter's growth from `before` to `after`; a replica whose worker group restarted counts
// from 0 again.
uint64_t since(uint64_t before, uint64_t after) { return after >= before ? after - before : after; }

// What each replica ran between the two snapshots (a replica added meanwhile counts from 0).
std::vector<ReplicaRun> runs(const std::vector<ReplicaView>& before,
                             const std::vector<ReplicaView>& after) {
  std::vector<ReplicaRun> out(after.size());
  for (size_t i = 0; i < after.size(); ++i) {
    const ReplicaView start = i < before.size() ? before[i] : ReplicaView{};
    out[i].requests = since(start.routed, after[i].routed);
    out[i].prompt_tokens = since(start.stats.prompt_tokens, after[i].stats.prompt_tokens);
    out[i].output_tokens = since(start.stats.generation_tokens, after[i].stats.generation_tokens);
  }
  return out;
}

uint64_t output_tokens(const std::vector<ReplicaRun>& runs) {
  uint64_t n = 0;
  for (const ReplicaRun& r : runs) n += r.output_tokens;
  return n;
}

// Adds one output to its request's result (as LLM::generate does).
void collect(GenerationResult& r, const RequestOutput& out) {
  const auto now = Clock::now();
  if (!r.first_token && !out.new_tokens.empty()) r.first_token = now;
  r.text += out.delta;
  r.token_ids.insert(r.token_ids.end(), out.new_tokens.begin(), out.new_tokens.end());
  r.logprobs.insert(r.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
  r.finished = now;
  r.cached_tokens = out.cached_tokens;
  if (out.finished) {
    r.finish_reason = out.finish_reason;
    r.stop_reason = out.stop_reason;
  }
}

}  // namespace

Expected<ReplicaGeneration> generate_on_replicas(
    ReplicaSet& replicas, std::vector<Request> requests,
    const std::function<void(size_t, const RequestOutput&)>& on_output) {
  const std::vector<ReplicaView> before = replicas.replicas();
  auto inbox = std::make_shared<Inbox>();
  ReplicaGeneration g;
  g.results.resize(requests.size());
  std::vector<uint64_t> ids;  // the set's, of the requests added
  ids.reserve(requests.size());
  Status failed;  // the first request refused or failed
  const auto arrival = Clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    g.results[i].prompt_token_ids = requests[i].prompt();
    g.results[i].arrival = arrival;
    auto id = replicas.add(std::move(requests[i]), [inbox, i](RequestOutput out) {
      {
        std::lock_guard lock(inbox->mu);
        inbox->outputs.emplace_back(i, std::move(out));
      }
      inbox->arrived.notify_one();
    });
    if (!id) {
      failed = id.status().with_context("prompt " + std::to_string(i));
      for (uint64_t added : ids) replicas.abort(added);
      break;
    }
    ids.push_back(*id);
  }
  // Every request added ends with one last output (kAbort when it was aborted).
  size_t unfinished = ids.size();
  std::deque<std::pair<size_t, RequestOutput>> arrived;
  while (unfinished > 0) {
    {
      std::unique_lock lock(inbox->mu);
      inbox->arrived.wait(lock, [&] { return !inbox->outputs.empty(); });
      arrived.swap(inbox->outputs);
    }
    for (auto& [i, out] : arrived) {
      unfinished -= out.finished;
      if (!failed.is_ok()) continue;  // the call has failed: the others are only drained
      if (out.finished && out.finish_reason == FinishReason::kError) {
        failed = (out.error.is_ok() ? internal_error("it failed") : out.error)
                     .with_context("prompt " + std::to_string(i));
        for (uint64_t id : ids) replicas.abort(id);  // ended ones are ignored
        continue;
      }
      collect(g.results[i], out);
      if (on_output) on_output(i, out);
    }
    arrived.clear();
  }
  if (!failed.is_ok()) return failed;
  uint64_t received = 0;
  for (const GenerationResult& r : g.results) received += r.token_ids.size();
  g.replicas = runs(before, replicas.replicas());
  for (const auto deadline = Clock::now() + kStatsWait;
       output_tokens(g.replicas) < received && Clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    g.replicas = runs(before, replicas.replicas());
  }
  return g;
}

}  // namespace tessera::server
