// Placement: which node and GPU each rank of a ParallelPlan runs on, and the choice of the plan
// itself (-tp / -pp auto) on a cluster as it is. Pure functions of the nodes the driver sees (no
// RPC here): `tessera plan` feeds them a cluster's NodeViews, tests synthetic ones; the worker
// group's placement (RankInfo, common/rank_info.h) takes PlacedRank's {node_id, gpu}.
//
// Rules:
//   - a TP group (the T ranks of a stage) stays on one node and, when the node allows, on one
//     NVLink island (GPUs all pairwise joined by NVLink); a group that crosses PCIe or nodes is
//     placed anyway, with a warning naming the weakest link and a better -tp / -pp;
//   - the whole plan stays on one node when one node has T x P free GPUs (among those, the one
//     whose TP groups have the best links, then the most free GPUs); otherwise stages go over
//     the nodes in order of free GPUs, most first, each node taking as many consecutive stages
//     as it has whole TP groups of free GPUs;
//   - busy GPUs (an actor runs there) are not used by place_ranks; plan_on_cluster first frees
//     those whose free memory still holds --gpu-memory-utilization x their total
//     (with_shared_gpus: vLLM's per-instance rule, so two replicas at 0.45 share a GPU);
//   - a cluster without GPUs (or device "cpu") gets CPU actors: each stage's TP group on one
//     node, stages spread over the nodes (most CPUs first) in consecutive runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/checkpoint/model_config.h"
#include "common/node_resources.h"
#include "common/status.h"
#include "driver/client.h"
#include "driver/plan/parallel_plan.h"

namespace tessera {

// A node as planning sees it.
struct ClusterNode {
  NodeView node;                    // as the head reports it; skipped when not alive or draining
  std::vector<uint32_t> busy_gpus;  // GpuDevice::index values taken by running actors
  size_t actors = 0;                // running actors: CPU ranks go to the nodes with fewest
};

// "node-a": the node's name, or its id when it has none.
std::string node_label(const NodeView& node);

// ---- topology of one node ------------------------------------------------------------------

// The node's NVLink islands: maximal sets of GPUs (GpuDevice::index values, ascending) that are
// all pairwise joined by NVLink, largest first. A GPU without NVLink is an island of one.
std::vector<std::vector<uint32_t>> nvlink_islands(const NodeResources& r);

// How many disjoint TP groups of each size fit on the node's free GPUs with every pair of a
// group on NVLink: {size, groups} for sizes 1..free GPUs, sizes with no group left out.
struct NvlinkGroups {
  int64_t tp = 0;
  int64_t groups = 0;
};
std::vector<NvlinkGroups> nvlink_tp_sizes(const NodeResources& r,
                                          const std::vector<uint32_t>& busy = {});

// ---- placement ------------------------------------------------------------------------------

struct PlacedRank {
  std::string node_id;
  std::string node_name;  // node_label
  int64_t gpu = -1;       // GpuDevice::index on that node; -1 = a CPU actor
  std::string gpu_name;   // "NVIDIA H200"; empty for CPU
  GpuMemory memory;       // that GPU's total and used bytes (zeros for CPU)
};

// How one stage's TP group is connected.
struct TpGroupLinks {
  int64_t stage = 0;
  bool cross_node = false;  // its ranks are on more than one node
  GpuLink worst;            // the weakest link between two of its GPUs (kSelf when T == 1)
  int64_t gpu_a = -1;       // a pair joined by `worst` (GpuDevice::index values; consecutive
  int64_t gpu_b = -1;       // in the group when such a pair exists, as a ring crosses them)
  // All ranks on one node and every pair on NVLink (trivially true for T == 1 and CPU ranks).
  bool on_nvlink() const { return !cross_node && worst.kind <= LinkKind::kNvlink; }
};

struct Placement {
  bool cpu = false;                   // CPU actors
  std::vector<PlacedRank> ranks;      // index = rank
  std::vector<TpGroupLinks> groups;   // one per stage
  std::vector<std::string> warnings;  // one per TP group off NVLink: the stage, the GPUs, the link
};

// Places tp x pp ranks. `cpu` forces CPU actors. Errors: FAILED_PRECONDITION when no node is
// alive, RESOURCE_EXHAUSTED when fewer GPUs are free than tp x pp (naming each node's free and
// busy GPUs and what would fit).
Expected<Placement> place_ranks(int64_t tp, int64_t pp, const std::vector<ClusterNode>& nodes,
                                bool cpu = false);

// "stage 0: node-a gpu0 gpu1 [NV18]", "stage 1: node-b gpu0 gpu1 [PHB]", "stage 0: node-a gpu3
// + node-b gpu0 [network]", "stage 0: node-a 2 CPU actors"; one line per stage, each ending in
// '\n'. Precondition: `placement` came from place_ranks(tp, pp, ...).
std::string format_stages(const Placement& placement, int64_t tp, int64_t pp);

// ---- choosing and checking a plan on a cluster ------------------------------------------------

// -tp/-pp auto want KV room for this many sequences of --max-model-len ("with headroom").
inline constexpr int64_t kAutoMinSequences = 4;

struct ClusterPlan {
  EngineSpec engine;  // the spec resolved for this plan (resolve_engine_spec)
  ParallelPlan plan;
  Placement placement;
  MemoryPlan memory;
  Status fit;  // memory_status with node/GPU labels, plus a -tp/-pp that fits where one does
  std::string choice;  // -tp/-pp auto: one line saying what was chosen and why; else empty
  // Each TP group off NVLink: the placement's warning plus the better plan where one exists
  // ("better: -tp 2 -pp 2, every TP group on NVLink").
  std::vector<std::string> warnings;
  // The same number of GPUs split so that every TP group is on NVLink and the model fits, when
  // some TP group of this plan is not and such a split exists (the largest T first).
  std::optional<ParallelConfig> better;  // tp_size, pp_size
};

// Validates the spec (as given) against the model, chooses T and P where auto, places the ranks and
// sizes memory. Auto tries every valid T (and P up to the layers) that the free GPUs allow and
// takes, in this order of preference:
//   1. among plans whose TP groups are all on NVLink and that leave KV room for
//      kAutoMinSequences sequences of max_model_len: the fewest stages, then the smallest T
//      (tensor parallelism inside an NVLink island before pipeline stages, as vLLM advises);
//   2. else the fewest GPUs with that room, TP groups off NVLink allowed;
//   3. else the first (as in 1, then by fewest GPUs) that holds one sequence;
//   4. else the plan with the most KV room, its `fit` saying it does not fit.
// `choice` says which and why in one line. Errors (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)
// when no plan can be made or placed; a plan that is placed but does not fit in memory is
// returned with `fit` saying so, so callers can show the figures.
// The plan's `engine` is the spec resolved for it: the one the actors load with.
Expected<ClusterPlan> plan_on_cluster(const ModelConfig& config, const EngineSpec& spec,
                                      const std::vector<ClusterNode>& nodes);

// `nodes` with the busy GPUs that can take one more rank at `utilization` no longer busy: their
// free memory (total - used) holds utilization x total.
std::vector<ClusterNode> with_shared_gpus(std::vector<ClusterNode> nodes, double utilization);

// `replicas` data-parallel replicas of the plan (`-dp`), each planned with plan_on_cluster on
// the nodes as the ones before left them (their GPUs busy with their budgets in use, their
// actors counted), as `tessera serve -dp` places them. Stops at the first replica that cannot
// be placed or does not fit and returns the plans so far and that one (its `fit`, or the
// status, saying why). replicas == 0 is -dp auto: as many as fit (CPU replicas: as long as
// each gets nodes no other one uses), the first that does not fit left out, failure OK.
struct ReplicaPlans {
  std::vector<ClusterPlan> plans;  // the replicas that fit, then the one that did not, if any
  Status failure;                  // why replica plans.size() - 1 (or plans.size()) does not fit
  size_t fitting() const;
};
ReplicaPlans plan_replicas(const ModelConfig& config, const EngineSpec& spec,
                           std::vector<ClusterNode> nodes, int64_t replicas);

}  // namespace tessera
