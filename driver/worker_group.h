// The actors that serve one model: T x P ranks placed on the cluster's nodes, each holding its
// shard. The group spawns them (one lease per node), runs the rendezvous (collective endpoints
// or the NCCL id or IPC handles, relayed over RPC), loads every rank at once, sizes the KV cache
// to what the tightest rank holds, and runs steps:
//   - ranks on this machine read each step from their node's shared-memory step ring and write
//     their result to an output ring of their own (no RPC per step);
//   - ranks on other machines get an execute RPC.
// Steps complete in order; up to pipeline_depth() (the stages) can be in flight. When a rank
// dies, the step fails with how it died ("actor a-… (GPU 1 on node n-…) was killed by signal 9
// (SIGKILL)"), never a bare disconnection. The group watches, besides its daemons' death
// reports, the connection to every actor, to the head and the cluster's node events: a dead
// daemon sends no report, so the loss of a socket alone fails the steps in flight (within about
// a second, naming the rank and node), and never a 10-minute wait. Destroying the group ends its
// leases: its actors are stopped and its rings unlinked.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/expert_load.h"
#include "common/load_spec.h"
#include "common/status.h"
#include "common/step.h"
#include "driver/client.h"
#include "driver/engine/engine.h"

namespace tessera {

struct WorkerGroupSpec {
  LoadSpec load;  // the model's fields; each rank's parallel position and comm are filled in
  // By world rank (pp_rank * tp_size + tp_rank): each rank's node and GPU. Its rank, actor and
  // endpoint are the group's to fill in as it starts.
  std::vector<RankInfo> placement;
  // kTcp (cpu backend), kNccl, kIpc (cuda); ignored for one rank.
  CommBackend comm_backend = CommBackend::kTcp;
  std::string owner = "driver";
  bool use_rings = true;  // local ranks take steps through shared-memory rings
  uint64_t ipc_buffer_bytes = 8ull << 20;
  // nccl: tensor-parallel all-reduces up to this many bytes go through the custom all-reduce
  // over CUDA-IPC buffers (every TP group must be on one node, its GPUs peer-capable); 0 = NCCL
  // only. Capped at ipc_buffer_bytes.
  uint64_t custom_all_reduce_max_bytes = 0;
  // Where a person can read a dead actor's log after the run: given the path the daemon
  // reported, returns the one to name (a local node's folder goes with it: the session keeps a
  // copy). Unset: the reported path. Logs are named in this process's log, never in statuses.
  std::function<std::string(const std::string&)> keep_log;
};

// One rank's answer to a collective check (WorkerGroup::check_collectives).
struct CollectiveCheck {
  int rank = 0;
  std::string actor_id, node_id;
  std::string group;  // "tensor-parallel" or "pipeline"
  int ranks = 0;
  uint64_t bytes = 0;
  int iterations = 0;
  double median_us = 0;
  double busbw_gbps = 0;
};

class WorkerGroup final : public StepExecutor {
 public:
  // `tessera doctor`: spawns the spec's ranks and runs their rendezvous as start() does, then,
  // instead of loading a model, every rank all-reduces `bytes` `iterations` times through its
  // groups (actor commCheck), each sum checked. One entry per rank and group; errors name the
  // rank that failed or did not join (within the spec's init timeout). The actors end with it.
  static Expected<std::vector<CollectiveCheck>> check_collectives(EventLoop& loop,
                                                                  ClusterClient& cluster,
                                                                  WorkerGroupSpec spec,
                                                                  uint64_t bytes, int iterations);

  static Expected<std::unique_ptr<WorkerGroup>> start(EventLoop& loop, ClusterClient& cluster,
                                                      WorkerGroupSpec spec);
  ~WorkerGroup() override;

  // Rank 0's view of the model, with kv_blocks the fewest any rank holds.
  const ModelInfo& model() const { return model_; }
  const std::vector<ActorView>& actors() const { return actors_; }
  int world_size() const { return static_cast<int>(ranks_.size()); }
  // No actor of the group has died (as its daemon reported; a stuck one is killed by the
  // daemon's heartbeat watchdog and reported too) and no connection it needs was lost (an
  // actor's, the head's, a node declared dead). Events arrive as the loop runs.
  bool alive() const { return first_death() == nullptr && lost_.empty(); }
  // Why the group is not alive, in words ("rank 1: actor a-… was killed by signal 9", "lost the
  // connection to rank 0 (actor a-…, CPU on node n-…)"), without file paths; "" while alive.
  std::string death() const;

  Status submit(StepInput step) override;
  Expected<StepOutput> collect() override;
  // Drops every step in flight: their outputs are read and thrown away as they arrive (a step
  // the actors started runs to its end), so the group is idle and a later submit starts clean.
  // How many were dropped, or how a rank failed meanwhile (as collect names it); past `within`
  // it stops waiting (DEADLINE_EXCEEDED) and the group is for destruction only.
  Expected<int> abort(std::chrono::milliseconds within = std::chrono::minutes(10));
  int pipeline_depth() const override { return spec_.load.parallel.pp_size; }

  // Where the last collected step's time went, in microseconds: submit to collect as the
  // driver saw it, the sampling rank's execute, and of that its GPU forward.
  struct StepTimes {
    uint32_t call_us = 0, actor_us = 0, gpu_us = 0;
  };
  const StepTimes& last_times() const { return last_times_; }
  // The routings every rank counted in its MoE layers since it loaded, added up (empty for a
  // dense model). Errors name the rank that did not answer.
  Expected<ExpertLoad> expert_load();
  // Logits of the sampled rows of the last step, when loaded with return_logits.
  const std::vector<float>& last_logits() const { return last_logits_; }

  struct Rank;
  struct Node;
  struct Pending;

 private:
  WorkerGroup(EventLoop& loop, WorkerGroupSpec spec);
  // `failed`, or how one of the group's actors died when that is why it failed.
  Status explain(Status failed);
  // The first death reported among this group's actors, if any.
  const ActorView* first_death() const;
  // Collects the oldest step, giving up at `deadline`.
  Expected<StepOutput> collect_until(std::chrono::steady_clock::time_point deadline);
  // Records the first lost connection (or dead node) and wakes every wait on the group.
  void lose(std::string why, bool daemon_gone);
  // After a loss: how the group failed, waiting briefly for a death report (which says how the
  // actor died) when its daemon may still send one.
  Status failure();
  // Watches the actors' and the head's connections and the cluster's node deaths.
  void start_watching(ClusterClient& cluster);
  // "rank 1: " when the group has several ranks and the actor is one of them.
  std::string rank_prefix(const std::string& actor_id) const;

  // start's phases, in order; each leaves in the members what the next one reads.
  Status open_leases(ClusterClient& cluster);
  Status spawn_ranks();
  Status rendezvous();
  Status create_rings();
  struct Loaded;  // what load_weights leaves for init_caches
  Expected<Loaded> load_weights();
  Status init_caches(const Loaded& loaded);
  // What `rank` loads: the spec's model with its place in the group and the collectives.
  LoadSpec rank_load_spec(const Rank& rank, const std::string& secret) const;

  EventLoop& loop_;
  WorkerGroupSpec spec_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<ActorView> actors_;
  ModelInfo model_;
  int sampler_rank_ = 0;
  std::vector<std::unique_ptr<Pending>> pending_;
  StepTimes last_times_;
  std::vector<float> last_logits_;
  std::string lost_;          // the first loss, "" while none
  bool daemon_gone_ = false;  // the loss was a daemon or the head: no death report will come
  bool reported_ = false;     // the failure was logged (with the dead actor's log)
  struct Watch;               // the watching promises, and the one the first loss resolves
  std::unique_ptr<Watch> watch_;
};

}  // namespace tessera
