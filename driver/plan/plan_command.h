// `tessera topo` and `tessera plan`, and the -tp / -pp options every model command shares.
//
//   tessera topo [--address HEAD:PORT] [--json]
//       each node's GPU link matrix, its NVLink islands and the TP sizes that stay on NVLink
//   tessera plan --model DIR -tp T -pp P [--pipeline-layer-partition 10,12,10]
//                [--max-model-len L] [--gpu-memory-utilization U] [--dtype D]
//                [--address HEAD:PORT | --cluster-file FILE | --gpus N [--gpu-memory GiB]]
//       the split, the placement, weights / KV cache / max concurrency per GPU, and the flag to
//       change when it does not fit. Starts nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/node_resources.h"
#include "common/status.h"
#include "driver/plan/placement.h"
#include "driver/status.h"

namespace CLI {
class App;
}

namespace tessera {

// ---- -tp / -pp ------------------------------------------------------------------------------

// The parallel flags as typed: "auto" or a positive integer.
struct ParallelArgs {
  std::string tensor_parallel_size = "1";  // -tp, --tensor-parallel-size
  // -pp, --pipeline-parallel-size; "" (not given) = 1, or the partition's number of stages.
  std::string pipeline_parallel_size;
  std::string pipeline_layer_partition;  // "10,12,10": layers per stage; "" = even
};

// Adds --tensor-parallel-size, --pipeline-parallel-size and --pipeline-layer-partition to `cmd`,
// bound to `args`. The short spellings -tp / -pp work once argv went through ParallelFlagArgv
// (CLI11 takes one-letter short names only).
void add_parallel_options(CLI::App* cmd, ParallelArgs& args);

// The flags every model command shares (generate, bench, serve, plan), with vLLM's names and
// meanings: one value, registered by add_model_options, validated by validate(ModelArgs), read
// by the planner (plan_for_nodes) and the driver's session alike.
struct ModelArgs {
  std::string model;  // --model: a Hugging Face model directory
  ParallelArgs parallel;
  std::string dtype = "auto";   // --dtype: auto | bfloat16 | float16 | half | float32 | float
  std::string device = "auto";  // --device: auto (GPUs when there are any) | cuda | cpu
  MemoryOptions memory;         // --max-model-len, --gpu-memory-utilization, --max-num-seqs,
                                // --max-num-batched-tokens, --enforce-eager
};

// Adds --model (required), the parallel options, --dtype, --device and the memory flags.
void add_model_options(CLI::App* cmd, ModelArgs& args);

// OK when the flags make sense before any model is read; INVALID_ARGUMENT naming the flag.
Status validate(const ModelArgs& args);

// Parses `args` into `request`'s tensor_parallel, pipeline_parallel (nullopt for "auto") and
// layer_partition. INVALID_ARGUMENT naming the flag and the text.
Status apply_parallel_args(const ParallelArgs& args, PlanRequest& request);

// A copy of argv with vLLM's spellings rewritten for CLI11: "-tp" becomes
// "--tensor-parallel-size", "-pp" "--pipeline-parallel-size" (also "-tp=2"). Arguments after a
// bare "--" are left alone. Hand argc()/argv() to CLI::App::parse; they live as long as this.
class ParallelFlagArgv {
 public:
  ParallelFlagArgv(int argc, const char* const* argv);
  ParallelFlagArgv(const ParallelFlagArgv&) = delete;
  ParallelFlagArgv& operator=(const ParallelFlagArgv&) = delete;

  int argc() const { return static_cast<int>(pointers_.size()); }
  const char* const* argv() const { return pointers_.data(); }

 private:
  std::vector<std::string> args_;
  std::vector<const char*> pointers_;
};

// ---- where the nodes come from ----------------------------------------------------------------

// The nodes of a status report, alive ones, each with the GPUs of its live actors marked busy.
std::vector<ClusterNode> cluster_nodes(const ClusterStatus& status);

// A made-up cluster: `nodes` nodes ("node-0", ...) of `gpus_per_node` GPUs with `gpu_memory`
// bytes each, every pair on one node joined by NV18 (`tessera plan --gpus`). No GPUs: CPU nodes.
std::vector<ClusterNode> synthetic_nodes(int64_t nodes, int64_t gpus_per_node, uint64_t gpu_memory);

// `tessera topo --json`: {"head_address", "nodes": [{"node_id", "name", "address", "is_head",
// "cpus", "memory_total", "memory_available", "gpu_note", "gpus": [{"index", "name", "uuid",
// "pci_bus_id", "memory_total", "memory_used", "busy"}], "links": [["X", "NV18", ...], ...],
// "nvlink_islands": [[0, 1], ...], "nvlink_tp_sizes": [{"tp", "groups"}]}]}.
std::string topology_json(const std::string& head_address, const std::vector<ClusterNode>& nodes);
// Reads topology_json's output back (`tessera plan --cluster-file`): the nodes with their GPUs,
// links and busy GPUs. INVALID_ARGUMENT naming `file` and the field on malformed input.
Expected<std::vector<ClusterNode>> parse_topology_json(const std::string& text,
                                                       const std::string& file);

// `tessera topo`'s text: per node, its GPUs (busy ones marked), the link matrix
// (format_link_matrix), the NVLink islands and the TP sizes that stay on NVLink.
std::string render_topology(const std::string& head_address, const std::vector<ClusterNode>& nodes);

// The report `tessera plan` prints: the model, the split (layers per stage, heads, KV heads,
// vocab padding), the placement (format_stages), per-rank weights and memory, the KV cache
// capacity and max concurrency at max_model_len, warnings, the auto choice, and the fit
// ("Fits." or "Does not fit: " and memory_status's message, which names the flag to change).
std::string render_cluster_plan(const ModelConfig& config, const ClusterPlan& plan);

// ---- the commands ---------------------------------------------------------------------------

struct TopoOptions {
  std::string address;             // head HOST:PORT; "" = the head started on this machine
  std::string temp_dir;            // the root it was started with
  std::string cluster_token_file;  // else $TESSERA_CLUSTER_TOKEN or this machine's
  bool json = false;
};

struct PlanOptions : ModelArgs {  // config.json is all that is read of the model
  // Where the nodes come from, first that applies: cluster_file; gpus >= 0 (made up); address;
  // the head started on this machine; this machine (describe_this_machine).
  std::string cluster_file;   // a `tessera topo --json` output
  int64_t gpus = -1;          // --gpus N per node, without a cluster (0 = CPU ranks)
  int64_t nodes = 1;          // --nodes, with --gpus
  double gpu_memory_gib = 0;  // --gpu-memory: each made-up GPU's memory; with this machine's
                              // GPUs, replaces what they report
  std::string address;
  std::string temp_dir;
  std::string cluster_token_file;
  // Describes this machine (NVML discovery lives in the daemon library; main injects it).
  std::function<NodeResources()> describe_this_machine;
};

// Adds `topo` / `plan` to `app` with their flags bound to `options`. The caller runs
// topo_command / plan_command when the subcommand was parsed.
CLI::App* add_topo_subcommand(CLI::App& app, TopoOptions& options);
CLI::App* add_plan_subcommand(CLI::App& app, PlanOptions& options);

// Run the commands; return the exit code (0 ok; 1 failed or, for plan, does not fit). Reports go
// to stdout (plan's ends in "Fits." or "Does not fit: ..."), errors to stderr prefixed
// "tessera topo: " / "tessera plan: ".
int topo_command(const TopoOptions& options);
int plan_command(const PlanOptions& options);

// plan_command's planning step on given nodes, without printing: the model flags turned into
// a PlanRequest (apply_parallel_args, memory flags) and plan_on_cluster. Errors as theirs.
Expected<ClusterPlan> plan_for_nodes(const ModelConfig& config, const ModelArgs& args,
                                     const std::vector<ClusterNode>& nodes);

}  // namespace tessera
