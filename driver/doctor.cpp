#include "driver/doctor.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/checkpoint/model_config.h"
#include "driver/cli/cli_help.h"
#include "driver/llm.h"
#include "driver/model_session.h"
#include "driver/plan/placement.h"
#include "driver/plan/plan_command.h"
#include "driver/status.h"
#include "driver/worker_group.h"

namespace tessera {

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kPass:
      return "pass";
    case Verdict::kWarn:
      return "warn";
    case Verdict::kFail:
      return "fail";
  }
  return "fail";
}

namespace {

using Clock = std::chrono::system_clock;

std::string mib(uint64_t bytes) {
  char buf[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(bytes) / (1ull << 30));
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f MiB", static_cast<double>(bytes) / (1ull << 20));
  }
  return buf;
}

std::string fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

class Report {
 public:
  void add(std::string node, std::string check, Verdict v, std::string detail,
           std::string fix = "") {
    findings_.push_back(
        {std::move(node), std::move(check), v, std::move(detail), v == Verdict::kPass ? "" : fix});
  }
  const std::vector<Finding>& findings() const { return findings_; }
  bool failed() const {
    return std::any_of(findings_.begin(), findings_.end(),
                       [](const Finding& f) { return f.verdict == Verdict::kFail; });
  }

 private:
  std::vector<Finding> findings_;
};

// What one node answered, with the clock readings around the call.
struct NodeAnswer {
  NodeView node;
  std::string label;
  bool answered = false;
  NodeCheckView check;
  int64_t sent_ms = 0, received_ms = 0;
};

void judge_limits(const NodeAnswer& a, Report& r) {
  namespace L = doctor_limits;
  const NodeCheckView& c = a.check;
  const std::string& n = a.label;
  std::string shm = c.shm_path + ": " + mib(c.shm_total) + " (" + mib(c.shm_free) + " free)";
  std::string shm_fix =
      "give the node a larger " + c.shm_path +
      " (e.g. `mount -o remount,size=16G /dev/shm`; in Docker `--shm-size=16g` or `--ipc=host`): "
      "step rings, the object store and NCCL's shared-memory transport live there";
  if (c.shm_total < L::kShmFail || c.shm_free < L::kShmFail / 4) {
    r.add(n, "shm", Verdict::kFail, shm + ", under the " + mib(L::kShmFail) + " Tessera needs",
          shm_fix);
  } else if (c.shm_total < L::kShmWarn) {
    r.add(n, "shm", Verdict::kWarn, shm + ", under the " + mib(L::kShmWarn) + " advised", shm_fix);
  } else {
    r.add(n, "shm", Verdict::kPass, shm);
  }

  std::string files =
      "open files (ulimit -n) of the daemon and its actors: " + std::to_string(c.nofile_soft) +
      " (hard " + std::to_string(c.nofile_hard) + ")";
  std::string files_fix =
      "raise the limit where the daemon starts (`ulimit -n 65536` before `tessera start`, "
      "LimitNOFILE=65536 in its systemd unit, nofile in /etc/security/limits.conf): every rank "
      "holds sockets, shared-memory segments and NCCL's descriptors";
  if (c.nofile_soft < L::kNofileFail) {
    r.add(n, "nofile", Verdict::kFail, files + ", under " + std::to_string(L::kNofileFail),
          files_fix);
  } else if (c.nofile_soft < L::kNofileWarn) {
    r.add(n, "nofile", Verdict::kWarn,
          files + ", under the " + std::to_string(L::kNofileWarn) + " advised for many ranks",
          files_fix);
  } else {
    r.add(n, "nofile", Verdict::kPass, files);
  }

  if (!c.disk_error.empty()) {
    r.add(n, "disk", Verdict::kFail, c.disk_error,
          "check that the path exists on this node (--model names a folder every node can read)");
  } else {
    std::string disk = mib(c.disk_free) + " free at " + c.disk_path;
    std::string disk_fix =
        "free space there: logs, compiled kernels and downloaded checkpoints need room";
    if (c.disk_free < L::kDiskFail) {
      r.add(n, "disk", Verdict::kFail, disk, disk_fix);
    } else if (c.disk_free < L::kDiskWarn) {
      r.add(n, "disk", Verdict::kWarn, disk, disk_fix);
    } else {
      r.add(n, "disk", Verdict::kPass, disk);
    }
  }
  if (!c.actor_binary_error.empty()) {
    r.add(n, "actor", Verdict::kFail, c.actor_binary + ": " + c.actor_binary_error,
          "reinstall Tessera on this node (tessera-actor must sit beside tessera, or pass "
          "--bin-dir to `tessera start`)");
  }
}

// The node's clock against this machine's, from the middle of the call: skew within +-(call
// time / 2).
void judge_clock(const NodeAnswer& a, Report& r) {
  namespace L = doctor_limits;
  const int64_t middle = (a.sent_ms + a.received_ms) / 2;
  const int64_t skew = static_cast<int64_t>(a.check.wall_clock_ms) - middle;
  const int64_t slack = (a.received_ms - a.sent_ms) / 2 + 1;
  const int64_t beyond = std::max<int64_t>(0, std::llabs(skew) - slack);
  std::string detail = "clock " + std::string(skew >= 0 ? "+" : "") + std::to_string(skew) +
                       " ms against this machine's (+-" + std::to_string(slack) + " ms)";
  std::string fix =
      "synchronise the clocks (chrony or systemd-timesyncd against one NTP server): logs, "
      "heartbeats and lease deadlines across nodes are compared by time";
  if (beyond > L::kSkewFailMs) {
    r.add(a.label, "clock", Verdict::kFail, detail, fix);
  } else if (beyond > L::kSkewWarnMs) {
    r.add(a.label, "clock", Verdict::kWarn, detail, fix);
  } else {
    r.add(a.label, "clock", Verdict::kPass, detail);
  }
}

void judge_reach(const NodeAnswer& a, const std::map<std::string, std::string>& label_of,
                 Report& r) {
  for (const auto& p : a.check.peers) {
    auto it = label_of.find(p.address);
    std::string peer = it == label_of.end() ? p.address : it->second + " (" + p.address + ")";
    if (p.reachable) {
      r.add(a.label, "reach", Verdict::kPass,
            "reaches " + peer + " in " + fixed(p.connect_ms, 1) + " ms");
    } else {
      r.add(a.label, "reach", Verdict::kFail, "cannot reach " + peer + ": " + p.error,
            "open the port between the nodes (firewall, security group), or start that node "
            "with --node-ip set to an address this one can reach; ranks on the two nodes "
            "could not join one group");
    }
  }
}

// A real copy between every pair of the node's GPUs, in an actor that sees them all: P2P can be
// advertised and still broken (IOMMU, ACS, a BIOS setting), which NCCL shows only as a hang.
void check_p2p(EventLoop& loop, ClusterClient& cluster, const NodeAnswer& a, Report& r) {
  const NodeResources& res = a.node.resources;
  if (res.gpus.size() == 1) {
    r.add(a.label, "p2p", Verdict::kPass, "one GPU: no pair to copy between");
    return;
  }
  if (res.gpus.size() < 2) return;
  std::string fix =
      "peer-to-peer copies are broken or absent on this machine: check `nvidia-smi topo -p2p r`, "
      "disable the IOMMU / PCIe ACS for the GPUs (BIOS or kernel `iommu=pt`), or set "
      "NCCL_P2P_DISABLE=1 in the daemons' environment so NCCL stages copies through host "
      "memory (slower, but it does not hang)";
  auto handle = a.node.node_id == cluster.head_id() ? Expected<NodeHandle>(cluster.head_node())
                                                    : cluster.node(a.node.node_id);
  if (!handle) {
    r.add(a.label, "p2p", Verdict::kFail, handle.status().message(), fix);
    return;
  }
  auto lease = handle->open_lease("doctor");
  if (!lease) {
    r.add(a.label, "p2p", Verdict::kFail, lease.status().message(), fix);
    return;
  }
  SpawnOptions spawn;
  for (const auto& g : res.gpus) spawn.gpus.push_back(g.index);
  spawn.name = "doctor-p2p";
  auto actor = (*lease)->spawn(spawn);
  if (!actor) {
    r.add(a.label, "p2p", Verdict::kFail,
          "cannot start an actor on every GPU: " + actor.status().message(),
          "look at the node's actor logs (`tessera status`)");
    return;
  }
  auto conn = ActorHandle::connect(loop, actor->address, actor->key);
  if (!conn) {
    r.add(a.label, "p2p", Verdict::kFail, conn.status().message(), fix);
    return;
  }
  auto req = (*conn)->capability().p2pCheckRequest();
  req.setBytes(64ull << 20);
  auto copies = wait_for(loop, req.send().then([](auto&& resp) {
    std::vector<std::tuple<uint32_t, uint32_t, bool, bool, double, std::string>> out;
    for (auto c : resp.getCopies()) {
      out.emplace_back(c.getSrc(), c.getDst(), c.getPeerAccess(), c.getOk(), c.getGbps(),
                       c.getError().cStr());
    }
    return out;
  }),
                         "P2P check", 120 * kj::SECONDS);
  if (!copies) {
    r.add(a.label, "p2p", Verdict::kFail, copies.status().message(), fix);
    return;
  }
  // The actor's CUDA ordinals are the node's GPUs in the order it was given them.
  auto name = [&](uint32_t ordinal) {
    return ordinal < res.gpus.size() ? gpu_label(res.gpus[ordinal]) : std::to_string(ordinal);
  };
  double slowest = 1e300, fastest = 0;
  std::string broken, indirect;
  for (const auto& [src, dst, peer, ok, gbps, error] : *copies) {
    std::string pair = name(src) + "->" + name(dst);
    if (!ok) broken += pair + ": " + error + "; ";
    if (ok && !peer) indirect += pair + " ";
    if (ok) slowest = std::min(slowest, gbps), fastest = std::max(fastest, gbps);
  }
  std::string detail = std::to_string(copies->size()) + " ordered pairs, 64 MiB each";
  if (slowest <= fastest) {
    detail += ": " + fixed(slowest, 1) + " to " + fixed(fastest, 1) + " GB/s";
  }
  if (!broken.empty()) {
    r.add(a.label, "p2p", Verdict::kFail, detail + "; broken: " + broken, fix);
  } else if (!indirect.empty()) {
    r.add(a.label, "p2p", Verdict::kWarn,
          detail + "; without peer access (through host memory): " + indirect,
          "these pairs cannot reach each other directly: keep TP groups off them (`tessera "
          "plan`) or expect PCIe-through-host all-reduce speeds");
  } else {
    r.add(a.label, "p2p", Verdict::kPass, detail + ", every copy intact");
  }
}

void judge_gpus(const NodeAnswer& a, Report& r) {
  const NodeResources& res = a.node.resources;
  if (res.gpus.empty()) {
    r.add(a.label, "gpus", Verdict::kPass,
          "no GPUs" + (res.gpu_note.empty() ? std::string() : " (" + res.gpu_note + ")") +
              ": the node runs CPU actors");
    return;
  }
  r.add(a.label, "gpus", Verdict::kPass,
        std::to_string(res.gpus.size()) + " x " + res.gpus.front().name + ", driver " +
            res.driver_version +
            (res.cuda_version.empty() ? "" : ", CUDA " + res.cuda_version + " supported"));
  if (res.gpus.size() < 2) return;
  std::vector<std::string> sizes;
  for (const NvlinkGroups& g : nvlink_tp_sizes(res)) {
    if (g.tp > 1) sizes.push_back(std::to_string(g.tp));
  }
  std::set<LinkKind> kinds;
  for (size_t i = 0; i < res.gpus.size(); ++i) {
    for (size_t j = 0; j < res.gpus.size(); ++j) {
      if (i != j) kinds.insert(gpu_link(res, i, j).kind);
    }
  }
  std::string matrix = format_link_matrix(res);
  std::string detail = "TP sizes on NVLink: " +
                       (sizes.empty() ? std::string("none") : [&] {
                         std::string s;
                         for (const auto& t : sizes) s += (s.empty() ? "" : ", ") + t;
                         return s;
                       }()) +
                       "\n" + matrix;
  bool mixed = kinds.count(LinkKind::kNvlink) && kinds.size() > 1;
  if (mixed) {
    r.add(a.label, "links", Verdict::kWarn, detail,
          "some GPU pairs are on NVLink and some only on PCIe: keep each TP group inside one "
          "NVLink island (`tessera plan` places them so) and check P2P with NCCL_P2P_LEVEL; "
          "mixed NVLink/PCIe groups are where NCCL hangs and timeouts come from");
  } else {
    r.add(a.label, "links", Verdict::kPass, detail);
  }
}

// Variables that differ between nodes: ranks that disagree on NCCL's settings can pick
// different algorithms and hang.
void judge_nccl_env(const std::vector<NodeAnswer>& answers, Report& r) {
  std::map<std::string, std::map<std::string, std::vector<std::string>>> by_name;
  size_t nodes = 0;
  for (const auto& a : answers) {
    if (!a.answered) continue;
    ++nodes;
    for (const auto& [k, v] : a.check.nccl_env) by_name[k][v].push_back(a.label);
  }
  if (by_name.empty()) {
    r.add("cluster", "nccl-env", Verdict::kPass, "no NCCL_* variables set on any daemon");
    return;
  }
  for (const auto& [name, values] : by_name) {
    size_t with = 0;
    for (const auto& [v, labels] : values) with += labels.size();
    std::string detail = name + "=";
    bool first = true;
    for (const auto& [v, labels] : values) {
      detail += (first ? "" : " / ") + v + " on ";
      first = false;
      for (size_t i = 0; i < labels.size(); ++i) detail += (i ? "," : "") + labels[i];
    }
    if (values.size() > 1 || with != nodes) {
      r.add("cluster", "nccl-env", Verdict::kWarn,
            detail + (with != nodes ? " (unset elsewhere)" : ""),
            "set NCCL variables the same on every node (in the environment `tessera start` "
            "runs in): ranks that disagree can choose different protocols and hang");
    } else if (name == "NCCL_P2P_DISABLE" && values.begin()->first == "1") {
      r.add("cluster", "nccl-env", Verdict::kWarn, detail,
            "NCCL_P2P_DISABLE=1 sends GPU-to-GPU traffic through host memory: unset it unless "
            "P2P is broken on this machine");
    } else {
      r.add("cluster", "nccl-env", Verdict::kPass, detail);
    }
  }
}

std::vector<ClusterNode> planning_nodes(const std::vector<NodeAnswer>& answers,
                                        const std::string& head_address) {
  ClusterStatus status;
  status.head_address = head_address;
  for (const auto& a : answers) {
    if (!a.answered) continue;
    NodeStatus s;
    s.node = a.node;
    status.nodes.push_back(std::move(s));
  }
  return cluster_nodes(status);
}

// The ranks of the collective check: the plan of --model, or -tp x -pp, or one rank per GPU of
// each node in a stage per node (CPU nodes: one rank per node, two on a cluster of one).
// With --model: the plan's sizes, and whether the model also fits on one rank (the reference of
// the parity check).
struct ModelPlan {
  int64_t tp = 1, pp = 1;
  bool fits = false;
  bool one_rank_fits = false;
  bool cpu = false;  // CPU ranks: fp32 math whatever the checkpoint's dtype
};

Expected<Placement> check_placement(const DoctorOptions& o, const std::vector<ClusterNode>& nodes,
                                    Report& r, ModelPlan* model_plan) {
  if (!o.engine.model.empty()) {
    TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(o.engine.model));
    // The plan a run of these flags gets (plan_session: a plan that does not fit is an error
    // naming the rank, its budget and the flag to change).
    auto plan = plan_session(config, o.engine, nodes);
    if (!plan) {
      r.add("cluster", "memory", Verdict::kFail, plan.status().message(),
            "change the flags the message names, or add GPUs");
      return plan.status();
    }
    model_plan->tp = plan->plan.tp;
    model_plan->pp = plan->plan.pp;
    model_plan->fits = true;
    model_plan->cpu = plan->placement.cpu;
    EngineSpec one = o.engine;
    one.tensor_parallel_size = ParallelSize{1};
    one.pipeline_parallel_size = ParallelSize{1};
    auto single = plan_on_cluster(config, one, nodes);
    model_plan->one_rank_fits = single && single->fit;
    r.add("cluster", "memory", Verdict::kPass,
          "the plan -tp " + std::to_string(plan->plan.tp) + " -pp " +
              std::to_string(plan->plan.pp) + " fits:\n" + render_cluster_plan(config, *plan));
    for (const auto& w : plan->warnings) {
      r.add("cluster", "placement", Verdict::kWarn, w, "use the better split it names");
    }
    return plan->placement;
  }
  bool cpu = true;
  size_t fewest_gpus = SIZE_MAX;
  for (const auto& n : nodes) {
    if (!n.node.takes_actors()) continue;
    fewest_gpus = std::min(fewest_gpus, n.node.resources.gpus.size());
    cpu = cpu && n.node.resources.gpus.empty();
  }
  const int64_t alive = static_cast<int64_t>(std::count_if(
      nodes.begin(), nodes.end(), [](const auto& n) { return n.node.takes_actors(); }));
  int64_t tp = o.engine.tensor_parallel_size.ranks;
  int64_t pp = o.engine.pipeline_parallel_size ? o.engine.pipeline_parallel_size->ranks : 0;
  if (tp <= 1 && pp <= 0) {
    if (cpu) {
      tp = alive > 1 ? 1 : 2;
      pp = std::max<int64_t>(1, alive);
    } else {
      tp = static_cast<int64_t>(fewest_gpus == SIZE_MAX ? 1 : fewest_gpus);
      pp = std::max<int64_t>(1, alive);
    }
  }
  tp = std::max<int64_t>(1, tp);
  pp = std::max<int64_t>(1, pp);
  return place_ranks(tp, pp, nodes, cpu);
}

void check_collectives(EventLoop& loop, ClusterClient& cluster, const DoctorOptions& o,
                       const Placement& placement, Report& r) {
  const int world = static_cast<int>(placement.ranks.size());
  // One TP group per stage.
  const int64_t pp = std::max<int64_t>(1, static_cast<int64_t>(placement.groups.size()));
  const int64_t tp = world / pp;
  if (world < 2) {
    r.add("cluster", "allreduce", Verdict::kPass,
          "one rank: no peer to all-reduce with (a second GPU or node enables this check)");
    return;
  }
  WorkerGroupSpec spec;
  spec.owner = "doctor";
  for (const PlacedRank& p : placement.ranks) {
    spec.placement.push_back(RankInfo{.rank = static_cast<int>(spec.placement.size()),
                                      .node_id = p.node_id,
                                      .gpu = static_cast<int>(p.gpu)});
  }
  spec.comm_backend = pick_collectives(o.engine.collectives, spec.placement);
  spec.use_rings = false;
  spec.load.engine = o.engine;
  spec.load.engine.nccl_init_timeout_s = o.join_timeout_s;
  spec.load.parallel.tp_size = static_cast<int>(tp);
  spec.load.parallel.pp_size = static_cast<int>(pp);
  std::string shape = std::to_string(tp) + " x " + std::to_string(pp) + " ranks (" +
                      comm_backend_name(spec.comm_backend) + ")";
  auto t0 = std::chrono::steady_clock::now();
  auto checks = WorkerGroup::check_collectives(loop, cluster, std::move(spec), o.allreduce_bytes,
                                               o.allreduce_iterations);
  double took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!checks) {
    r.add("cluster", "allreduce", Verdict::kFail,
          "all-reduce across " + shape + " failed after " + fixed(took_s, 1) +
              " s: " + checks.status().message(),
          "the rank named could not join or answer: look at its node's reach, its actor log "
          "(`tessera status`), and NCCL_SOCKET_IFNAME / firewalls between the nodes; rerun with "
          "NCCL_DEBUG=INFO in the daemons' environment for NCCL's own account");
    return;
  }
  // One line per group: the slowest rank's time.
  std::map<std::string, CollectiveCheck> slowest;
  for (const auto& c : *checks) {
    auto key = c.group;
    if (!slowest.count(key) || c.median_us > slowest[key].median_us) slowest[key] = c;
  }
  for (const auto& [group, c] : slowest) {
    r.add("cluster", "allreduce", Verdict::kPass,
          "all-reduce of " + mib(c.bytes) + " across " + shape + ", " + group + " groups of " +
              std::to_string(c.ranks) + ": " + fixed(c.median_us, 0) + " us, bus bandwidth " +
              fixed(c.busbw_gbps, 2) + " GB/s (slowest rank " + std::to_string(c.rank) +
              "; every sum checked)");
  }
}

// The third pitfall, checked: one greedy step of a few prompts at the plan's -tp x -pp and at
// one rank, their top logprobs compared. Tensor-parallel sums round differently from one rank's,
// so the tolerance follows the dtype; a different greedy token is a failure only where the
// reference's top two are further apart than that.
void check_parity(const DoctorOptions& o, const HeadTarget& head, const ModelPlan& plan,
                  Report& r) {
  if (plan.tp * plan.pp < 2) return;
  const std::string shape = "-tp " + std::to_string(plan.tp) + " -pp " + std::to_string(plan.pp);
  if (!plan.one_rank_fits) {
    r.add("cluster", "parity", Verdict::kWarn,
          "not run: the model does not fit on one rank, the reference of the check",
          "compare against a smaller split by hand (`tessera generate --temperature 0 "
          "--logprobs 5` at two plans)");
    return;
  }
  const std::vector<std::string> prompts = {"The capital of France is", "def fibonacci(n):\n    ",
                                            "1, 2, 3, 4, 5,"};
  SamplingParams params;
  params.temperature = 0;
  params.max_tokens = 1;
  params.logprobs = 20;
  auto run = [&](int64_t tp, int64_t pp) -> Expected<std::vector<GenerationResult>> {
    EngineArgs args;
    static_cast<EngineSpec&>(args) = o.engine;
    args.tensor_parallel_size = ParallelSize{tp};
    args.pipeline_parallel_size = ParallelSize{pp};
    args.max_model_len = 256;  // three short prompts: a small cache loads fast
    args.enforce_eager = true;
    args.address = head.address;
    args.cluster_token = head.token;
    TESSERA_ASSIGN_OR_RETURN(auto llm, LLM::open(args, "tessera doctor"));
    return llm->generate(prompts, params);
  };
  auto split = run(plan.tp, plan.pp);
  if (!split) {
    r.add("cluster", "parity", Verdict::kFail,
          shape + " could not run: " + split.status().message(), "fix the failure above first");
    return;
  }
  auto one = run(1, 1);
  if (!one) {
    r.add("cluster", "parity", Verdict::kFail, "one rank could not run: " + one.status().message(),
          "fix the failure above first");
    return;
  }
  const bool fp32 = plan.cpu || o.engine.dtype == "float32" || o.engine.dtype == "float";
  const double tolerance = fp32 ? 1e-3 : 0.15;
  double worst = 0;
  std::string mismatch;
  bool near_tie_only = true;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const auto& a = (*split)[p].logprobs;
    const auto& b = (*one)[p].logprobs;
    if (a.empty() || b.empty()) continue;
    std::map<int32_t, float> ref(b[0].top.begin(), b[0].top.end());
    for (const auto& [token, lp] : a[0].top) {
      if (auto it = ref.find(token); it != ref.end()) {
        worst = std::max(worst, static_cast<double>(std::fabs(lp - it->second)));
      }
    }
    if (a[0].token != b[0].token) {
      double margin = b[0].top.size() > 1 ? b[0].top[0].second - b[0].top[1].second : 1e9;
      mismatch += "prompt " + std::to_string(p) + ": greedy token " + std::to_string(a[0].token) +
                  " at " + shape + ", " + std::to_string(b[0].token) +
                  " on one rank (its top-2 margin " + fixed(margin, 4) + "); ";
      near_tie_only = near_tie_only && margin < tolerance;
    }
  }
  std::string detail = std::to_string(prompts.size()) + " prompts, one greedy step at " + shape +
                       " against one rank: max |logprob difference| " + fixed(worst, 6) +
                       " over the top 20 (tolerance " + fixed(tolerance, 3) +
                       (fp32 ? ", fp32" : "") + ")";
  std::string fix =
      "tensor-parallel output should match one GPU to rounding: check --dtype and "
      "--quantization are the same as the reference, that every node runs the same Tessera, "
      "CUDA and NCCL versions (see gpus above), and report the prompts with this output";
  if (!mismatch.empty() && !near_tie_only) {
    r.add("cluster", "parity", Verdict::kFail, detail + "; " + mismatch, fix);
  } else if (worst > 10 * tolerance) {
    r.add("cluster", "parity", Verdict::kFail, detail, fix);
  } else if (!mismatch.empty() || worst > tolerance) {
    r.add("cluster", "parity", Verdict::kWarn, detail + (mismatch.empty() ? "" : "; " + mismatch),
          "a near-tie or rounding beyond the usual: rerun with --dtype float32 to tell them "
          "apart");
  } else {
    r.add("cluster", "parity", Verdict::kPass, detail + "; greedy tokens identical");
  }
}

std::string render(const Report& r, const std::string& head) {
  std::ostringstream o;
  o << "tessera doctor: cluster at " << head << "\n";
  std::string node;
  for (const auto& f : r.findings()) {
    if (f.node != node) {
      node = f.node;
      o << "\n" << node << "\n";
    }
    std::string tag = f.verdict == Verdict::kPass   ? "  PASS "
                      : f.verdict == Verdict::kWarn ? "  WARN "
                                                    : "  FAIL ";
    std::istringstream lines(f.detail);
    std::string line;
    std::getline(lines, line);
    o << tag << f.check << ": " << line << "\n";
    while (std::getline(lines, line)) o << "         " << line << "\n";
    if (!f.fix.empty()) o << "       fix: " << f.fix << "\n";
  }
  size_t counts[3] = {0, 0, 0};
  for (const auto& f : r.findings()) ++counts[static_cast<int>(f.verdict)];
  o << "\n" << counts[0] << " passed, " << counts[1] << " warning(s), " << counts[2] << " failed\n";
  return o.str();
}

std::string render_json(const Report& r, const std::string& head) {
  nlohmann::json findings = nlohmann::json::array();
  for (const auto& f : r.findings()) {
    findings.push_back({{"node", f.node},
                        {"check", f.check},
                        {"verdict", verdict_name(f.verdict)},
                        {"detail", f.detail},
                        {"fix", f.fix}});
  }
  nlohmann::json out = {{"head_address", head}, {"ok", !r.failed()}, {"findings", findings}};
  return out.dump(2) + "\n";
}

}  // namespace

CLI::App* add_doctor_subcommand(CLI::App& app, DoctorOptions& o) {
  auto* cmd = app.add_subcommand(
      "doctor",
      "Check every node of the cluster before a run: limits, shared memory, clocks, "
      "reach, GPUs and links, a real all-reduce; each problem with its fix");
  add_head_options(cmd, o.address, o.temp_dir, o.cluster_token_file);
  cmd->add_option("--model", o.engine.model,
                  "A Hugging Face model directory: plan its ranks and check their memory");
  add_parallel_size_options(cmd, o.engine);
  add_collectives_option(cmd, o.engine);
  cmd->add_option("--node-timeout", o.node_timeout_s,
                  "Seconds a node has to answer before it fails (default 10)")
      ->check(CLI::Range(1, 600));
  cmd->add_option("--allreduce-bytes", o.allreduce_bytes,
                  "Bytes per all-reduce of the collective check (default 4 MiB)")
      ->check(CLI::Range(uint64_t{4}, uint64_t{1} << 30));
  cmd->add_option("--join-timeout", o.join_timeout_s,
                  "Seconds every rank has to join the collective check (default 30)")
      ->check(CLI::Range(1, 3600));
  cmd->add_flag("--json", o.json, "Print the findings as JSON");
  add_examples(cmd, {"tessera doctor", "tessera doctor --address 10.0.0.1:6380 --json",
                     "tessera doctor --model ./Llama-3-8B -tp 2"});
  return cmd;
}

int doctor_command(const DoctorOptions& o) {
  auto head = find_head(o.address, o.temp_dir, o.cluster_token_file);
  if (!head) {
    std::cerr << "tessera doctor: " << head.status().message() << "\n";
    return 1;
  }
  Report report;
  auto loop = std::make_unique<EventLoop>();
  auto cluster = ClusterClient::connect(*loop, head->address, head->token);
  if (!cluster) {
    report.add("cluster", "head", Verdict::kFail,
               "cannot reach the head at " + head->address + ": " + cluster.status().message(),
               "check that `tessera start --head` runs there and that the token is this "
               "cluster's");
    std::cout << (o.json ? render_json(report, head->address) : render(report, head->address));
    return 1;
  }
  auto listed = (*cluster)->nodes(/*include_dead=*/true);
  if (!listed) {
    std::cerr << "tessera doctor: " << listed.status().message() << "\n";
    return 1;
  }
  std::vector<NodeAnswer> answers;
  std::map<std::string, std::string> label_of;
  std::vector<std::string> addresses;
  for (const auto& n : *listed) {
    if (!n.alive) continue;
    label_of[n.address] = node_label(n) + (n.is_head ? " [head]" : "");
    addresses.push_back(n.address);
  }
  for (const auto& n : *listed) {
    NodeAnswer a;
    a.node = n;
    a.label = node_label(n) + (n.is_head ? " [head]" : "");
    if (!n.alive) {
      report.add(a.label, "alive", Verdict::kFail, "the head marked it dead: " + n.death_reason,
                 "restart its daemon (`tessera start --address " + head->address +
                     "` on that machine) or look at its logs in " + n.session_dir);
      answers.push_back(std::move(a));
      continue;
    }
    std::vector<std::string> peers;
    for (const auto& p : addresses) {
      if (p != n.address) peers.push_back(p);
    }
    auto handle = n.node_id == (*cluster)->head_id() ? Expected<NodeHandle>((*cluster)->head_node())
                                                     : (*cluster)->node(n.node_id);
    a.sent_ms = now_ms();
    Expected<NodeCheckView> check =
        handle ? handle->check(peers, o.engine.model, 2000, std::chrono::seconds(o.node_timeout_s))
               : Expected<NodeCheckView>(handle.status());
    a.received_ms = now_ms();
    if (!check) {
      report.add(a.label, "alive", Verdict::kFail,
                 "its daemon at " + n.address + " did not answer: " + check.status().message(),
                 "is the daemon stopped (SIGSTOP), its machine down or overloaded, or a firewall "
                 "in between? `tessera status` shows its last heartbeat; restart it with "
                 "`tessera start --address " +
                     head->address + "` there");
      answers.push_back(std::move(a));
      continue;
    }
    a.answered = true;
    a.check = std::move(*check);
    report.add(a.label, "alive", Verdict::kPass,
               "daemon at " + n.address + " answered in " +
                   std::to_string(a.received_ms - a.sent_ms) + " ms");
    judge_gpus(a, report);
    judge_limits(a, report);
    judge_clock(a, report);
    judge_reach(a, label_of, report);
    answers.push_back(std::move(a));
  }
  for (const auto& a : answers) {
    if (a.answered) check_p2p(*loop, **cluster, a, report);
  }
  judge_nccl_env(answers, report);
  bool all_answered =
      std::all_of(answers.begin(), answers.end(), [](const NodeAnswer& a) { return a.answered; });
  auto nodes = planning_nodes(answers, head->address);
  ModelPlan model_plan;
  auto placement = check_placement(o, nodes, report, &model_plan);
  if (!placement) {
    report.add("cluster", "plan", Verdict::kFail, placement.status().message(),
               "use -tp/-pp that the cluster's GPUs allow (`tessera plan` shows the options)");
  } else if (!all_answered) {
    report.add("cluster", "allreduce", Verdict::kFail, "not run: a node did not answer (above)",
               "fix the node first");
  } else {
    check_collectives(*loop, **cluster, o, *placement, report);
  }
  // The parity check opens sessions with event loops of their own: this one goes first.
  cluster = Status(internal_error("closed"));
  loop.reset();
  if (!o.engine.model.empty() && placement && all_answered && model_plan.fits) {
    check_parity(o, *head, model_plan, report);
  }
  std::cout << (o.json ? render_json(report, head->address) : render(report, head->address));
  return report.failed() ? 1 : 0;
}

}  // namespace tessera
