// One model served by a worker group, for the driver's commands (generate, bench, later serve):
// the cluster connection (or an embedded local node), the T x P actors placed on its nodes
// (driver/worker_group.h), and an engine over them.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint/model_config.h"
#include "common/load_spec.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/client.h"
#include "driver/engine/engine.h"
#include "driver/local_node.h"
#include "driver/plan/plan_command.h"
#include "driver/worker_group.h"

namespace tessera {

// How a driver reaches its cluster; not engine configuration (the same engine runs on any).
struct ClusterOptions {
  std::string address;             // a cluster's head; "" = start a local node for this command
  std::string cluster_token_file;  // with address: where the token is (else the environment
                                   // or this machine's temp root, see protocol/auth.h)
  // With address: the token itself, for a program that started the node it joins (the Python
  // module's tessera.init()); it takes precedence over cluster_token_file. Never a flag.
  std::string cluster_token;
  // The `tessera` executable a local node is started from ("" = this process's own, as for the
  // CLI; a program linking the driver library, such as the Python module, names it).
  std::string tessera_binary;
  // Local ranks take steps through the node's shared-memory rings; false sends every step as an
  // execute RPC, as ranks on other machines get them (`tessera bench control-plane --transport
  // rpc` compares the two).
  bool step_rings = true;
};

// What a model command (generate, bench, serve, the C++ LLM) is given: the engine spec and how
// to reach the cluster. Each value lives in one of the two.
struct EngineArgs : EngineSpec, ClusterOptions {};

// Adds the engine flags (add_model_options and the engine's own: --collectives,
// --disable-custom-all-reduce, --[no-]enable-prefix-caching, --async-scheduling,
// --nccl-init-timeout) and the cluster's (--address, --cluster-token-file) to a model command.
void add_engine_options(CLI::App* cmd, EngineArgs& args);
// Just --collectives (add_engine_options has it).
void add_collectives_option(CLI::App* cmd, EngineSpec& spec);

class ModelSession {
 public:
  // Connects (or starts a local node), places and starts the worker group, loads the model.
  // `detokenize` = false gives the engine a detokenizer that returns no text (benchmarks).
  static Expected<std::unique_ptr<ModelSession>> open(const EngineArgs& args,
                                                      const std::string& owner,
                                                      bool detokenize = true);
  ~ModelSession();

  LlmEngine& engine() { return *engine_; }
  const ModelInfo& model() const { return group_->model(); }
  const ClusterPlan& plan() const { return plan_; }
  const ModelConfig& config() const { return config_; }
  const GenerationDefaults& defaults() const { return defaults_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  WorkerGroup& group() { return *group_; }
  EventLoop& loop() { return *loop_; }
  double load_seconds() const { return load_seconds_; }

  // Starts the worker group again (new actors, the model loaded anew) and a fresh engine over
  // it (empty: no requests, no cached prefixes): how a served model recovers from a dead actor
  // or node. The same placement while its nodes live; else a new plan on the nodes that are
  // left; a head that is gone is connected to again (a local node is started anew). The old
  // engine and its requests are gone.
  Status restart();
  // Stops the worker group (its actors exit) and the engine, for good: engine(), model() and
  // group() are gone; the tokenizer, config, defaults and plan stay (a replica taken out of
  // service while the server still uses them).
  void close();

 private:
  ModelSession() = default;
  // Reaches the cluster: the head at --address, or a local node started now.
  Status connect();
  // Plans on the cluster's live nodes: plan_ and the worker group's spec_.
  Status place();
  // A fresh engine over the group, sized by what its actors report (group_->model()).
  void start_engine(bool detokenize);

  ModelConfig config_;
  ClusterPlan plan_;
  GenerationDefaults defaults_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LocalNode> local_;
  std::unique_ptr<EventLoop> loop_;
  std::unique_ptr<ClusterClient> cluster_;
  std::unique_ptr<WorkerGroup> group_;
  WorkerGroupSpec spec_;  // what restart() starts again
  EngineSpec engine_spec_;  // as given (plan_.engine is it resolved)
  ClusterOptions cluster_options_;
  std::string owner_;
  std::string address_;  // the head's
  std::string token_;
  std::unique_ptr<Detokenizer> detokenizer_;
  std::unique_ptr<LlmEngine> engine_;
  double load_seconds_ = 0.0;
};

// The plan in lines for people: the auto choice when there was one, then one line per stage
// ("plan: stage 0: node-a gpu0 gpu1 [NV18]"), each ending in '\n'.
std::string plan_summary(const ClusterPlan& plan);

// Keeps a dead actor's log (a file in a local node's folder, which goes when the node stops)
// as <root>/failed-logs/<its name>, the newest 20 of them; returns the path to name (`path`
// itself when it cannot be kept).
// The collectives for a placement: what the user asked, else tcp for CPU actors, ipc when two
// ranks share a GPU (NCCL refuses that), nccl otherwise.
CommBackend pick_collectives(Collectives asked, const std::vector<RankInfo>& ranks);

std::string keep_failed_log(const std::filesystem::path& root, const std::string& path);

// The plan a session runs: plan_on_cluster's choice and placement on `nodes`, its engine spec
// resolved. With --collectives ipc, ranks may share GPUs when too few are free (testing tensor
// parallelism on one GPU). The plan's lines (stages, warnings, the auto choice) are logged.
Expected<ClusterPlan> plan_session(const ModelConfig& config, const EngineSpec& engine,
                                   const std::vector<ClusterNode>& nodes);

}  // namespace tessera
