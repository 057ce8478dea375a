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

// ---- the model flags -------------------------------------------------------------------------

// Binds the flags every model command shares (generate, bench, serve, plan) straight into
// `spec` (common/engine_spec.h), with vLLM's names: --model (required), -tp / -pp (parsed here,
// once, into ParallelSize; a bad value is a usage error), --pipeline-layer-partition, --dtype,
// --device, --max-model-len, --gpu-memory-utilization, --max-num-seqs,
// --max-num-batched-tokens, --block-size, --enforce-eager, --kv-cache-dtype and vLLM's
// --trust-remote-code (taken, changing nothing: trust_remote_code_note). Bounds are checked by
// validate(EngineSpec).
void add_model_options(CLI::App* cmd, EngineSpec& spec);
// Just -tp/--tensor-parallel-size and -pp/--pipeline-parallel-size (add_model_options has them).
void add_parallel_size_options(CLI::App* cmd, EngineSpec& spec);

// After `app` parsed a command line: the line to log when its model command was given
// --trust-remote-code (nothing of the model's runs here: it is read, never executed), else "".
std::string trust_remote_code_note(const CLI::App& app);

// vLLM's `serve MODEL` spelling for every model command (serve, generate, plan, and bench
// latency, throughput, report and control-plane): a first argument after the command that is
// not a flag becomes --model (also after tessera's own flags, e.g. --log-level info). Other
// command lines are returned as they are.
std::vector<std::string> positional_model_argv(std::vector<std::string> args);

// A copy of argv with vLLM's spellings rewritten for CLI11: "-tp" becomes
// "--tensor-parallel-size", "-pp" "--pipeline-parallel-size" (also "-tp=2"). Arguments after a
// bare "--" are left alone. Hand argc()/argv() to CLI::App::parse; they live as long as this.
// -dp / --data-parallel-size N: replicas of the plan (serve runs them, plan places them), 1 to
// kMaxParallelSize; the flag's one parser for both commands.
void add_data_parallel_option(CLI::App* cmd, ParallelSize& replicas);

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
// "alive", "draining", "cpus", "memory_total", "memory_available", "gpu_note", "gpus": [{"index",
// "name", "uuid", "pci_bus_id", "memory_total", "memory_used", "busy"}], "links": [["X", "NV18",
// ...], ...], "nvlink_islands": [[0, 1], ...], "nvlink_tp_sizes": [{"tp", "groups"}]}]}.
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

struct PlanOptions {
  EngineSpec engine;  // the model flags; config.json is all that is read of the model
  // Where the nodes come from, first that applies: cluster_file; gpus >= 0 (made up); address;
  // the head started on this machine; this machine (describe_this_machine).
  ParallelSize data_parallel_size;  // -dp: replicas of the plan, placed one after another
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

}  // namespace tessera
