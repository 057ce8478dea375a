#include "driver/model_session.h"

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>
#include <sstream>

#include "common/session.h"
#include "driver/engine/tokenizer_detokenizer.h"
#include "driver/status.h"
#include "protocol/auth.h"

namespace tessera {

void add_collectives_option(CLI::App* cmd, EngineSpec& e) {
  cmd->add_option_function<std::string>(
         "--collectives",
         [&e](const std::string& text) {
           Expected<Collectives> v = parse_collectives(text);
           if (!v) throw CLI::ValidationError(v.status().message());
           e.collectives = *v;
         },
         "auto|tcp|nccl|ipc: how the ranks talk (auto: tcp for CPU actors, nccl across GPUs, "
         "ipc when ranks share a GPU)")
      ->type_name("KIND");
}

void add_engine_options(CLI::App* cmd, EngineArgs& args) {
  EngineSpec& e = args;
  ClusterOptions& c = args;
  add_model_options(cmd, e);
  cmd->add_option("--address", c.address,
                  "A cluster's head HOST:PORT (default: $TESSERA_ADDRESS, else start a local "
                  "node)")
      ->envname("TESSERA_ADDRESS");
  cmd->add_option("--cluster-token-file", c.cluster_token_file,
                  "With --address: the cluster token (default: $TESSERA_CLUSTER_TOKEN or this "
                  "machine's)");
  add_collectives_option(cmd, e);
  cmd->add_flag("--disable-custom-all-reduce", e.disable_custom_all_reduce,
                "With nccl: NCCL for every all-reduce (default: the custom one for small "
                "tensors when a stage's GPUs share a node)");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", e.enable_prefix_caching,
                "Share the KV cache of common prompt prefixes (on by default)");
  cmd->add_flag("--async-scheduling", e.async_scheduling,
                "Schedule each decode step while the one before runs, its input the token that "
                "step samples (pipeline parallel size 1; vLLM's flag)");
  cmd->add_option("--nccl-init-timeout", e.nccl_init_timeout_s,
                  "Seconds every rank has to join the collectives at start-up")
      ->capture_default_str();
}

namespace {

// Ranks sharing GPUs round robin, a stage's TP group on one node: only with --collectives ipc,
// when a node has fewer free GPUs than a TP group (NCCL refuses two ranks on one GPU).
Expected<Placement> share_gpus(const ClusterPlan& plan, const std::vector<ClusterNode>& nodes) {
  const ClusterNode* node = nullptr;
  for (const ClusterNode& n : nodes) {
    if (!n.node.resources.gpus.empty() &&
        (node == nullptr || n.node.resources.gpus.size() > node->node.resources.gpus.size())) {
      node = &n;
    }
  }
  if (node == nullptr) return failed_precondition("--collectives ipc needs a node with a GPU");
  Placement p;
  const auto& gpus = node->node.resources.gpus;
  for (int64_t r = 0; r < plan.plan.world; ++r) {
    const GpuDevice& g = gpus[static_cast<size_t>(r) % gpus.size()];
    PlacedRank pr;
    pr.node_id = node->node.node_id;
    pr.node_name = node_label(node->node);
    pr.gpu = g.index;
    pr.gpu_name = g.name;
    pr.memory = {g.memory_total, g.memory_used};
    p.ranks.push_back(pr);
  }
  // The stages' TP groups: on one GPU ("X"), or across GPUs of the node sharing them.
  for (int64_t st = 0; st < plan.plan.pp; ++st) {
    TpGroupLinks g;
    g.stage = st;
    g.worst.kind = gpus.size() == 1 ? LinkKind::kSelf : LinkKind::kUnknown;
    p.groups.push_back(g);
  }
  return p;
}

}  // namespace

std::string plan_summary(const ClusterPlan& plan) {
  std::string out;
  if (!plan.choice.empty()) out += "plan: " + plan.choice + "\n";
  std::string stages = format_stages(plan.placement, plan.plan.tp, plan.plan.pp);
  for (size_t at = 0; at < stages.size();) {
    size_t end = stages.find('\n', at);
    if (end == std::string::npos) end = stages.size();
    out += "plan: " + stages.substr(at, end - at) + "\n";
    at = end + 1;
  }
  return out;
}

Expected<ClusterPlan> plan_session(const ModelConfig& config, const EngineSpec& a,
                                   const std::vector<ClusterNode>& nodes) {
  auto planned = plan_on_cluster(config, a, nodes);
  if (!planned && planned.status().code() == Code::kResourceExhausted &&
      a.collectives == Collectives::kIpc && !a.tensor_parallel_size.is_auto() && a.pp() != 0) {
    // Too few free GPUs: with ipc collectives the ranks may share them.
    ClusterPlan shared;
    ParallelConfig pc = a.shape();
    TESSERA_ASSIGN_OR_RETURN(DType dtype, resolve_dtype(a.dtype, config.torch_dtype, true));
    TESSERA_ASSIGN_OR_RETURN(QuantConfig quant, resolve_quantization(a.quantization, config.quant));
    TESSERA_ASSIGN_OR_RETURN(shared.plan, make_parallel_plan(config, pc, dtype, quant));
    TESSERA_ASSIGN_OR_RETURN(shared.placement, share_gpus(shared, nodes));
    // The actors size their KV caches themselves; the load needs the resolved spec.
    TESSERA_ASSIGN_OR_RETURN(shared.engine,
                             resolve_engine_spec(a, config, shared.plan.tp, shared.plan.pp,
                                                 shared.plan.stage_layers, Device::kCuda));
    // Each rank sizes itself to its share of its GPU (the actors' gpu_shares rule: the budget
    // divided by the ranks on the GPU), so the plan sizes each as a GPU of that share.
    std::vector<std::optional<GpuMemory>> shares;
    for (const PlacedRank& r : shared.placement.ranks) {
      uint64_t k = 0;
      for (const PlacedRank& o : shared.placement.ranks)
        k += o.node_id == r.node_id && o.gpu == r.gpu;
      shares.push_back(GpuMemory{r.memory.total / k, r.memory.used / k});
    }
    TESSERA_ASSIGN_OR_RETURN(EngineSpec lengths, resolve_lengths(a, config));
    shared.memory = estimate_memory(config, shared.plan, shares, lengths);
    TESSERA_RETURN_IF_ERROR(memory_status(shared.memory));
    std::set<int64_t> gpus;
    for (const PlacedRank& r : shared.placement.ranks) gpus.insert(r.gpu);
    spdlog::warn(
        "plan: {} ranks share {} GPU(s) of {} through CUDA IPC (--collectives ipc): for "
        "testing tensor parallelism, not for speed",
        shared.plan.world, gpus.size(), shared.placement.ranks.front().node_name);
    shared.fit = Status::ok();
    return shared;
  }
  if (!planned) return planned.status();
  ClusterPlan& plan = *planned;
  for (const std::string& w : plan.warnings) spdlog::warn("plan: {}", w);
  if (!plan.fit.is_ok()) return plan.fit;
  return planned;
}

// The collectives for a placement: what the user asked, else tcp for CPU actors, ipc when two
// ranks share a GPU (NCCL refuses that), nccl otherwise.
CommBackend pick_collectives(Collectives asked, const std::vector<RankInfo>& ranks) {
  switch (asked) {
    case Collectives::kTcp:
      return CommBackend::kTcp;
    case Collectives::kNccl:
      return CommBackend::kNccl;
    case Collectives::kIpc:
      return CommBackend::kIpc;
    case Collectives::kAuto:
      break;
  }
  if (ranks.empty() || ranks.front().gpu < 0) return CommBackend::kTcp;
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = i + 1; j < ranks.size(); ++j) {
      if (ranks[i].node_id == ranks[j].node_id && ranks[i].gpu == ranks[j].gpu) {
        return CommBackend::kIpc;
      }
    }
  }
  return CommBackend::kNccl;
}

ModelSession::~ModelSession() { close(); }

void ModelSession::close() {
  engine_.reset();
  group_.reset();  // stops the actors
  cluster_.reset();
}

Expected<std::unique_ptr<ModelSession>> ModelSession::open(const EngineArgs& args,
                                                           const std::string& owner,
                                                           bool detokenize) {
  const EngineSpec& engine = args;
  TESSERA_RETURN_IF_ERROR(validate(engine));
  std::unique_ptr<ModelSession> s(new ModelSession());
  s->engine_spec_ = engine;
  s->cluster_options_ = args;
  s->owner_ = owner;
  TESSERA_ASSIGN_OR_RETURN(s->config_, load_model_config(engine.model, &s->defaults_));
  TESSERA_ASSIGN_OR_RETURN(s->tokenizer_, Tokenizer::load(engine.model));
  TESSERA_RETURN_IF_ERROR(resolve_lengths(engine, s->config_).status());
  // A -tp / -pp that cannot split the model is refused before anything starts.
  if (!engine.tensor_parallel_size.is_auto() && engine.pp() != 0) {
    TESSERA_RETURN_IF_ERROR(LayerPlan::make(s->config_, engine.shape()).status());
  }
  s->loop_ = std::make_unique<EventLoop>();
  TESSERA_RETURN_IF_ERROR(s->connect());
  TESSERA_RETURN_IF_ERROR(s->place());
  auto t0 = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(s->group_, WorkerGroup::start(*s->loop_, *s->cluster_, s->spec_));
  s->load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s->start_engine(detokenize);
  return s;
}

Status ModelSession::connect() {
  const ClusterOptions& a = cluster_options_;
  std::string token;
  if (a.address.empty()) {
    TESSERA_ASSIGN_OR_RETURN(local_, LocalNode::start(a.tessera_binary));
    address_ = local_->address();
    token = local_->token();
  } else {
    address_ = a.address;
    if (!a.cluster_token.empty()) {
      token = a.cluster_token;
    } else {
      TESSERA_ASSIGN_OR_RETURN(HeadTarget head, find_head(a.address, "", a.cluster_token_file));
      token = head.token;
    }
  }
  token_ = token;
  TESSERA_ASSIGN_OR_RETURN(cluster_, ClusterClient::connect(*loop_, address_, token));
  return Status::ok();
}

Status ModelSession::place() {
  const EngineSpec& a = engine_spec_;
  TESSERA_ASSIGN_OR_RETURN(ClusterStatus cluster, collect_status(*loop_, address_, token_));
  std::vector<ClusterNode> nodes = cluster_nodes(cluster);
  TESSERA_ASSIGN_OR_RETURN(plan_, plan_session(config_, a, nodes));
  {
    std::stringstream lines(plan_summary(plan_));
    for (std::string line; std::getline(lines, line);) spdlog::info("{}", line);
  }
  if (a.async_scheduling && plan_.plan.pp > 1) {
    return invalid_argument(
        "--async-scheduling needs pipeline parallel size 1: the token a step samples on the last "
        "stage is not at the first stage when the next step starts there; the plan has " +
        std::to_string(plan_.plan.pp) + " stages");
  }
  // The resolved spec's sizes and partition are the plan's.
  ParallelConfig parallel = plan_.engine.shape();

  WorkerGroupSpec spec;
  spec.owner = owner_;
  for (const PlacedRank& r : plan_.placement.ranks) {
    spec.placement.push_back(RankInfo{.rank = static_cast<int>(spec.placement.size()),
                                      .node_id = r.node_id,
                                      .gpu = static_cast<int>(r.gpu)});
  }
  spec.comm_backend = pick_collectives(a.collectives, spec.placement);
  spec.use_rings = cluster_options_.step_rings;
  // Beside NCCL, the custom all-reduce for tensors up to its buffer's size, where every TP
  // group's GPUs share a node and NVLink (vLLM's rule: PCIe peers gain nothing from it).
  if (spec.comm_backend == CommBackend::kNccl && !a.disable_custom_all_reduce &&
      plan_.plan.tp > 1) {
    bool on_nvlink = !plan_.placement.groups.empty();
    for (const TpGroupLinks& g : plan_.placement.groups) on_nvlink &= g.on_nvlink();
    if (on_nvlink) {
      spec.custom_all_reduce_max_bytes = spec.ipc_buffer_bytes;
    } else {
      spdlog::info(
          "custom all-reduce off: a TP group is not on one node's NVLink; NCCL does every "
          "all-reduce");
    }
  }
  LoadSpec& load = spec.load;
  load.engine = plan_.engine;  // resolved by the planner
  load.parallel = parallel;
  // Ranks sharing a GPU share its memory budget (the actor divides; its messages quote the
  // --gpu-memory-utilization the user gave).
  for (const auto& r : spec.placement) {
    int n = 0;
    for (const auto& o : spec.placement) n += o.node_id == r.node_id && o.gpu == r.gpu;
    if (r.gpu >= 0) load.gpu_shares = std::max(load.gpu_shares, n);
  }
  // CPU actors on one node share its cores.
  int per_node = 1;
  for (const auto& r : spec.placement) {
    int n = 0;
    for (const auto& o : spec.placement) n += o.node_id == r.node_id;
    per_node = std::max(per_node, n);
  }
  if (spec.placement.front().gpu < 0 && per_node > 1) {
    for (const auto& n : nodes) {
      if (n.node.node_id == spec.placement.front().node_id) {
        load.threads = std::max<int>(1, static_cast<int>(n.node.resources.cpus) / per_node);
      }
    }
  }
  if (local_) {
    // The local node's folder (and the actors' logs in it) goes with it: a dead actor's log is
    // kept beside it.
    spec.keep_log = [root = std::filesystem::path(local_->root()).parent_path()](
                        const std::string& path) { return keep_failed_log(root, path); };
  }
  spec_ = std::move(spec);
  return Status::ok();
}

void ModelSession::start_engine(bool detokenize) {
  EngineConfig ec;
  ec.model = group_->model();
  ec.enable_prefix_caching = plan_.engine.enable_prefix_caching;
  ec.async_scheduling = plan_.engine.async_scheduling;
  ec.kv_window = static_cast<uint32_t>(config_.kv_cache_window());
  for (int64_t id : config_.eos_token_ids) ec.eos_token_ids.push_back(static_cast<int32_t>(id));
  if (!detokenizer_) {
    if (detokenize) {
      detokenizer_ = std::make_unique<TokenizerDetokenizer>(*tokenizer_);
    } else {
      detokenizer_ = std::make_unique<NoDetokenizer>();
    }
  }
  engine_ = std::make_unique<LlmEngine>(ec, *group_, *detokenizer_);
}

Status ModelSession::restart() {
  const auto t0 = std::chrono::steady_clock::now();
  engine_.reset();
  group_.reset();  // the old actors stop, their leases end
  // The cluster as it is now: a head that is gone is reached again (a local node is started
  // anew), and a placement on a node that left is made again on the nodes that are left.
  if (!cluster_->nodes()) {
    spdlog::warn("the cluster at {} does not answer; {}", address_,
                 local_ ? "starting a new local node" : "connecting again");
    cluster_.reset();
    local_.reset();  // stops what is left of it; its folder and segments go
    TESSERA_RETURN_IF_ERROR(connect());
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<NodeView> live, cluster_->nodes());
  bool placed_on_live_nodes = true;
  for (const RankInfo& r : spec_.placement) {
    bool found = false;
    for (const NodeView& n : live) found |= n.node_id == r.node_id && n.alive;
    placed_on_live_nodes &= found;
  }
  if (!placed_on_live_nodes) TESSERA_RETURN_IF_ERROR(place());
  TESSERA_ASSIGN_OR_RETURN(group_, WorkerGroup::start(*loop_, *cluster_, spec_));
  start_engine(true);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::ok();
}

std::string keep_failed_log(const std::filesystem::path& root, const std::string& path) {
  namespace fs = std::filesystem;
  constexpr size_t kKept = 20;
  std::error_code ec;
  const fs::path dir = root / "failed-logs";
  fs::create_directories(dir, ec);
  fs::permissions(dir, fs::perms::owner_all, ec);
  const fs::path kept = dir / fs::path(path).filename();
  fs::remove(kept, ec);
  // A second name for the same file: it outlives the folder, and the daemon's last lines land.
  if (::link(path.c_str(), kept.c_str()) != 0) {
    fs::copy_file(path, kept, ec);
    if (ec) return path;
  }
  // The newest kKept stay.
  std::vector<std::pair<fs::file_time_type, fs::path>> all;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    all.emplace_back(e.last_write_time(ec), e.path());
  }
  if (all.size() > kKept) {
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i + kKept < all.size(); ++i) fs::remove(all[i].second, ec);
  }
  return kept.string();
}

}  // namespace tessera
