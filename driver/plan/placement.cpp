#include "driver/plan/placement.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

namespace tessera {

std::string node_label(const NodeView& node) {
  return node.name.empty() ? node.node_id : node.name;
}

namespace {

// ---- links and groups on one node (positions are indices into NodeResources::gpus) ----------

bool is_nvlink(const NodeResources& r, size_t a, size_t b) {
  return a == b || gpu_link(r, a, b).kind == LinkKind::kNvlink;
}

// Worse first: a later LinkKind, then fewer NVLinks.
bool worse_link(const GpuLink& a, const GpuLink& b) {
  if (a.kind != b.kind) return a.kind > b.kind;
  return a.kind == LinkKind::kNvlink && a.nvlinks < b.nvlinks;
}

// A group's score: its weakest link. Smaller is better.
struct GroupScore {
  GpuLink worst{LinkKind::kSelf, 0};
  bool operator<(const GroupScore& o) const { return worse_link(o.worst, worst); }
  bool operator==(const GroupScore& o) const {
    return worst.kind == o.worst.kind && worst.nvlinks == o.worst.nvlinks;
  }
};

GroupScore score_group(const NodeResources& r, const std::vector<size_t>& group) {
  GroupScore s;
  for (size_t i = 0; i < group.size(); ++i) {
    for (size_t j = i + 1; j < group.size(); ++j) {
      const GpuLink& l = gpu_link(r, group[i], group[j]);
      if (worse_link(l, s.worst) || s.worst.kind == LinkKind::kSelf) s.worst = l;
    }
  }
  return s;
}

// A selection's score: its groups' scores, worst first; lexicographically smaller is better.
using SelectionScore = std::vector<GroupScore>;

bool better_selection(const SelectionScore& a, const SelectionScore& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] < b[i]) return true;
    if (b[i] < a[i]) return false;
  }
  return false;
}

SelectionScore score_selection(const NodeResources& r,
                               const std::vector<std::vector<size_t>>& groups) {
  SelectionScore s;
  for (const auto& g : groups) s.push_back(score_group(r, g));
  std::sort(s.begin(), s.end(), [](const GroupScore& a, const GroupScore& b) { return b < a; });
  return s;
}

// `count` disjoint groups of `size` GPUs among `free` (ascending positions) whose weakest group
// is as strong as possible, then the next weakest, ...; ties go to the lowest positions. An
// exhaustive search with a work bound (nodes have few GPUs); empty when count * size > free.
std::vector<std::vector<size_t>> pick_groups(const NodeResources& r,
                                             const std::vector<size_t>& free, size_t size,
                                             size_t count) {
  if (count == 0 || size == 0 || count * size > free.size()) return {};
  std::vector<std::vector<size_t>> best, current;
  SelectionScore best_score;
  std::vector<bool> used(free.size(), false);
  size_t budget = 100000;  // search steps; the first complete selection comes within a few
  const size_t skips_allowed = free.size() - count * size;

  std::function<void(size_t, size_t)> search = [&](size_t next, size_t skipped) {
    if (budget == 0) return;
    --budget;
    if (current.size() == count) {
      SelectionScore s = score_selection(r, current);
      if (best.empty() || better_selection(s, best_score)) {
        best = current;
        best_score = std::move(s);
      }
      return;
    }
    // Bound: the selection can only get worse than its current weakest group.
    if (!best.empty() && !current.empty()) {
      SelectionScore partial = score_selection(r, current);
      if (best_score.front() < partial.front()) return;
    }
    while (next < free.size() && used[next]) ++next;
    if (next >= free.size()) return;
    // Start a group with `next`, completing it from the positions after it.
    std::vector<size_t> group{free[next]};
    used[next] = true;
    std::function<void(size_t)> extend = [&](size_t from) {
      if (group.size() == size) {
        current.push_back(group);
        search(next + 1, skipped);
        current.pop_back();
        return;
      }
      for (size_t i = from; i < free.size() && budget > 0; ++i) {
        if (used[i]) continue;
        used[i] = true;
        group.push_back(free[i]);
        extend(i + 1);
        group.pop_back();
        used[i] = false;
      }
    };
    extend(next + 1);
    used[next] = false;
    if (skipped < skips_allowed) {
      used[next] = true;
      search(next + 1, skipped + 1);
      used[next] = false;
    }
  };
  search(0, 0);
  return best;
}

std::vector<size_t> free_positions(const NodeResources& r, const std::vector<uint32_t>& busy) {
  std::vector<size_t> out;
  for (size_t i = 0; i < r.gpus.size(); ++i) {
    if (std::find(busy.begin(), busy.end(), r.gpus[i].index) == busy.end()) out.push_back(i);
  }
  return out;
}

bool links_complete(const NodeResources& r) {
  return r.links.size() == r.gpus.size() * r.gpus.size();
}

std::string gpu_word(int64_t index) { return "gpu" + std::to_string(index); }

// "node-a gpu0 gpu1 + node-b gpu0": the GPUs of ranks [first, first + count), by node.
std::string describe_members(const std::vector<PlacedRank>& ranks, size_t first, int64_t count) {
  std::string out, node;
  for (int64_t t = 0; t < count; ++t) {
    const PlacedRank& r = ranks[first + static_cast<size_t>(t)];
    if (r.node_name != node) {
      out += (node.empty() ? "" : " + ") + r.node_name;
      node = r.node_name;
    }
    out += " " + gpu_word(r.gpu);
  }
  return out;
}

// What a link means for an all-reduce.
std::string link_meaning(const GpuLink& l) {
  switch (l.kind) {
    case LinkKind::kPix:
    case LinkKind::kPxb:
      return "PCIe switches";
    case LinkKind::kPhb:
    case LinkKind::kNode:
      return "PCIe through the CPU's host bridge";
    case LinkKind::kSys:
      return "PCIe and the link between CPU sockets";
    default:
      break;
  }
  return "a link NVML could not identify";
}

}  // namespace

// ---- topology ------------------------------------------------------------------------------

std::vector<std::vector<uint32_t>> nvlink_islands(const NodeResources& r) {
  const size_t n = r.gpus.size();
  std::vector<std::vector<uint32_t>> out;
  if (n == 0) return out;
  if (n > 64 || !links_complete(r)) {
    for (const GpuDevice& g : r.gpus) out.push_back({g.index});
    return out;
  }
  std::vector<uint64_t> adj(n, 0);
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) {
      if (a != b && is_nvlink(r, a, b)) adj[a] |= 1ull << b;
    }
  }
  // Bron-Kerbosch with pivoting: every maximal clique of the NVLink graph.
  std::vector<uint64_t> cliques;
  std::function<void(uint64_t, uint64_t, uint64_t)> bk = [&](uint64_t R, uint64_t P, uint64_t X) {
    if (P == 0 && X == 0) {
      cliques.push_back(R);
      return;
    }
    const uint64_t px = P | X;
    const int pivot = __builtin_ctzll(px);
    uint64_t candidates = P & ~adj[static_cast<size_t>(pivot)];
    while (candidates) {
      const int v = __builtin_ctzll(candidates);
      candidates &= candidates - 1;
      const uint64_t bit = 1ull << v;
      bk(R | bit, P & adj[static_cast<size_t>(v)], X & adj[static_cast<size_t>(v)]);
      P &= ~bit;
      X |= bit;
    }
  };
  const uint64_t all = n == 64 ? ~0ull : (1ull << n) - 1;
  bk(0, all, 0);
  for (uint64_t c : cliques) {
    std::vector<uint32_t> island;
    for (size_t i = 0; i < n; ++i) {
      if (c & (1ull << i)) island.push_back(r.gpus[i].index);
    }
    std::sort(island.begin(), island.end());
    out.push_back(std::move(island));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.size() != b.size() ? a.size() > b.size() : a < b;
  });
  return out;
}

std::vector<NvlinkGroups> nvlink_tp_sizes(const NodeResources& r,
                                          const std::vector<uint32_t>& busy) {
  std::vector<NvlinkGroups> out;
  if (!links_complete(r)) return out;
  const std::vector<size_t> free = free_positions(r, busy);
  for (size_t t = 1; t <= free.size(); ++t) {
    int64_t groups = 0;
    for (size_t c = free.size() / t; c >= 1; --c) {
      auto picked = pick_groups(r, free, t, c);
      if (!picked.empty() && score_selection(r, picked).front().worst.kind <= LinkKind::kNvlink) {
        groups = static_cast<int64_t>(c);
        break;
      }
    }
    if (groups > 0) out.push_back({static_cast<int64_t>(t), groups});
  }
  return out;
}

// ---- placement ------------------------------------------------------------------------------

namespace {

struct NodeSlots {
  const ClusterNode* node = nullptr;
  std::vector<size_t> free;  // positions
};

PlacedRank gpu_slot(const ClusterNode& n, size_t position) {
  const GpuDevice& g = n.node.resources.gpus[position];
  PlacedRank p;
  p.node_id = n.node.node_id;
  p.node_name = node_label(n.node);
  p.gpu = g.index;
  p.gpu_name = g.name;
  p.memory = {g.memory_total, g.memory_used};
  return p;
}

// Fills in `groups` (links) and `warnings` once every rank is placed.
void describe_groups(Placement& pl, int64_t tp, int64_t pp, const std::vector<ClusterNode>& nodes) {
  std::map<std::string, const NodeResources*> by_id;
  for (const ClusterNode& n : nodes) by_id[n.node.node_id] = &n.node.resources;
  for (int64_t s = 0; s < pp; ++s) {
    TpGroupLinks g;
    g.stage = s;
    const size_t first = static_cast<size_t>(s * tp);
    std::set<std::string> node_names;
    for (int64_t t = 0; t < tp; ++t) node_names.insert(pl.ranks[first + t].node_name);
    g.cross_node = node_names.size() > 1;
    if (pl.cpu) {
      g.worst = GpuLink{LinkKind::kSelf, 0};  // CPU collectives: no GPU link to judge
    } else {
      // Consecutive pairs first (a ring crosses those), then every pair.
      std::vector<std::pair<size_t, size_t>> pairs;
      for (int64_t t = 0; t + 1 < tp; ++t) pairs.push_back({first + t, first + t + 1});
      for (int64_t a = 0; a < tp; ++a) {
        for (int64_t b = a + 2; b < tp; ++b) pairs.push_back({first + a, first + b});
      }
      for (auto [a, b] : pairs) {
        const PlacedRank& ra = pl.ranks[a];
        const PlacedRank& rb = pl.ranks[b];
        if (ra.node_id != rb.node_id) continue;
        const NodeResources& r = *by_id.at(ra.node_id);
        size_t pa = 0, pb = 0;
        for (size_t i = 0; i < r.gpus.size(); ++i) {
          if (r.gpus[i].index == ra.gpu) pa = i;
          if (r.gpus[i].index == rb.gpu) pb = i;
        }
        const GpuLink l = links_complete(r) ? gpu_link(r, pa, pb) : GpuLink{};
        if (g.gpu_a < 0 || worse_link(l, g.worst)) {
          g.worst = l;
          g.gpu_a = ra.gpu;
          g.gpu_b = rb.gpu;
        }
      }
    }
    if (tp > 1 && !g.on_nvlink()) {
      std::string w = "stage " + std::to_string(s) + "'s tensor-parallel group (" +
                      describe_members(pl.ranks, first, tp) + ")";
      if (g.cross_node) {
        std::string list;
        for (const auto& name : node_names) list += (list.empty() ? "" : " and ") + name;
        w += " spans nodes " + list + ": its all-reduces run over the network";
      } else {
        w += " is not one NVLink island: " + gpu_word(g.gpu_a) + "-" + gpu_word(g.gpu_b) +
             " are joined by " + link_name(g.worst) + ", so its all-reduces cross " +
             link_meaning(g.worst);
      }
      pl.warnings.push_back(w);
    }
    pl.groups.push_back(g);
  }
}

// CPU ranks: the nodes with the fewest running actors first (a second replica of a model goes
// to another node), then the most CPUs.
Placement place_cpu(int64_t tp, int64_t pp, std::vector<const ClusterNode*> alive) {
  std::stable_sort(alive.begin(), alive.end(), [](const ClusterNode* a, const ClusterNode* b) {
    if (a->actors != b->actors) return a->actors < b->actors;
    return a->node.resources.cpus > b->node.resources.cpus;
  });
  Placement pl;
  pl.cpu = true;
  const int64_t used_nodes = std::min<int64_t>(static_cast<int64_t>(alive.size()), pp);
  for (int64_t s = 0; s < pp; ++s) {
    const ClusterNode& n = *alive[static_cast<size_t>(s * used_nodes / pp)];
    for (int64_t t = 0; t < tp; ++t) {
      PlacedRank p;
      p.node_id = n.node.node_id;
      p.node_name = node_label(n.node);
      pl.ranks.push_back(p);
    }
  }
  return pl;
}

}  // namespace

Expected<Placement> place_ranks(int64_t tp, int64_t pp, const std::vector<ClusterNode>& nodes,
                                bool cpu) {
  if (tp < 1 || pp < 1) return invalid_argument("-tp and -pp must be at least 1");
  std::vector<const ClusterNode*> alive;
  size_t gpus = 0;
  std::string draining;  // `tessera drain`: alive, but no new ranks go there
  for (const ClusterNode& n : nodes) {
    if (n.node.alive && n.node.draining)
      draining += (draining.empty() ? "" : ", ") + node_label(n.node);
    if (!n.node.takes_actors()) continue;
    alive.push_back(&n);
    gpus += n.node.resources.gpus.size();
  }
  if (alive.empty()) {
    return failed_precondition(
        "the cluster has no live node to place ranks on" +
        (draining.empty() ? "" : " (draining: " + draining + "; `tessera drain NODE --undo`)"));
  }
  Placement pl;
  if (cpu || gpus == 0) {
    pl = place_cpu(tp, pp, alive);
    describe_groups(pl, tp, pp, nodes);
    return pl;
  }
  const size_t world = static_cast<size_t>(tp * pp);
  std::vector<NodeSlots> slots;
  size_t total_free = 0;
  for (const ClusterNode* n : alive) {
    NodeSlots ns{n, free_positions(n->node.resources, n->busy_gpus)};
    total_free += ns.free.size();
    slots.push_back(std::move(ns));
  }
  if (total_free < world) {
    std::string detail;
    for (const NodeSlots& ns : slots) {
      const NodeResources& r = ns.node->node.resources;
      detail += (detail.empty() ? "" : "; ") + node_label(ns.node->node) + ": " +
                std::to_string(ns.free.size()) + " of " + std::to_string(r.gpus.size()) + " free";
      std::string busy;
      for (const GpuDevice& g : r.gpus) {
        if (std::find(ns.node->busy_gpus.begin(), ns.node->busy_gpus.end(), g.index) ==
            ns.node->busy_gpus.end()) {
          continue;
        }
        busy += " " + gpu_word(g.index);
        if (g.memory_total > 0) {
          busy += " (" + format_gib(g.memory_total - std::min(g.memory_used, g.memory_total)) +
                  " free)";
        }
      }
      if (!busy.empty()) detail += " (busy:" + busy + ")";
    }
    if (!draining.empty()) detail += "; draining, so not used: " + draining;
    // NCCL refuses two ranks on one GPU; the driver's ipc collectives do not (model_session's
    // plan_session shares the GPUs then), which is how a one-GPU machine runs -tp 2.
    return resource_exhausted(
        "-tp " + std::to_string(tp) + " -pp " + std::to_string(pp) + " needs " +
        std::to_string(world) + " GPUs but the cluster has " + std::to_string(total_free) +
        " free (" + detail +
        "): lower -tp or -pp, stop the actors holding GPUs, add nodes, lower "
        "--gpu-memory-utilization (a busy GPU takes another rank when its free memory holds "
        "that share of it), or share GPUs within the plan: serve, generate and bench take "
        "--collectives ipc (ranks share a GPU through CUDA IPC: for testing tensor parallelism, "
        "not for speed)");
  }
  pl.ranks.resize(world);
  auto assign = [&](const ClusterNode& n, int64_t stage, const std::vector<size_t>& group) {
    for (size_t t = 0; t < group.size(); ++t) {
      pl.ranks[static_cast<size_t>(stage * tp) + t] = gpu_slot(n, group[t]);
    }
  };

  // One node for everything when one can: the best TP groups, then the most free GPUs.
  const NodeSlots* best = nullptr;
  std::vector<std::vector<size_t>> best_groups;
  SelectionScore best_score;
  for (const NodeSlots& ns : slots) {
    if (ns.free.size() < world) continue;
    const NodeResources& r = ns.node->node.resources;
    if (!links_complete(r)) continue;
    auto groups = pick_groups(r, ns.free, static_cast<size_t>(tp), static_cast<size_t>(pp));
    if (groups.size() != static_cast<size_t>(pp)) continue;
    SelectionScore s = score_selection(r, groups);
    if (best == nullptr || better_selection(s, best_score) ||
        (!better_selection(best_score, s) && ns.free.size() > best->free.size())) {
      best = &ns;
      best_groups = std::move(groups);
      best_score = std::move(s);
    }
  }
  if (best != nullptr) {
    for (int64_t s = 0; s < pp; ++s) assign(*best->node, s, best_groups[static_cast<size_t>(s)]);
    describe_groups(pl, tp, pp, nodes);
    return pl;
  }

  // Stages over nodes, most free GPUs first, each taking the whole TP groups it has.
  std::vector<NodeSlots*> order;
  for (NodeSlots& ns : slots) order.push_back(&ns);
  std::stable_sort(order.begin(), order.end(), [](const NodeSlots* a, const NodeSlots* b) {
    return a->free.size() > b->free.size();
  });
  int64_t stage = 0;
  for (NodeSlots* ns : order) {
    const NodeResources& r = ns->node->node.resources;
    const size_t take =
        std::min(ns->free.size() / static_cast<size_t>(tp), static_cast<size_t>(pp - stage));
    if (take == 0) continue;
    std::vector<std::vector<size_t>> groups;
    if (links_complete(r)) groups = pick_groups(r, ns->free, static_cast<size_t>(tp), take);
    if (groups.empty()) {  // no link matrix: in index order
      for (size_t g = 0; g < take; ++g) {
        groups.emplace_back(ns->free.begin() + static_cast<long>(g * tp),
                            ns->free.begin() + static_cast<long>((g + 1) * tp));
      }
    }
    for (const auto& g : groups) {
      assign(*ns->node, stage++, g);
      for (size_t p : g) ns->free.erase(std::find(ns->free.begin(), ns->free.end(), p));
    }
    if (stage == pp) break;
  }
  // What remains: TP groups across nodes, from the leftover GPUs in the same node order.
  std::vector<std::pair<const ClusterNode*, size_t>> rest;
  for (NodeSlots* ns : order) {
    for (size_t p : ns->free) rest.push_back({ns->node, p});
  }
  size_t next = 0;
  for (; stage < pp; ++stage) {
    for (int64_t t = 0; t < tp; ++t, ++next) {
      pl.ranks[static_cast<size_t>(stage * tp + t)] =
          gpu_slot(*rest[next].first, rest[next].second);
    }
  }
  describe_groups(pl, tp, pp, nodes);
  return pl;
}

std::string format_stages(const Placement& pl, int64_t tp, int64_t pp) {
  std::string out;
  for (int64_t s = 0; s < pp; ++s) {
    const size_t first = static_cast<size_t>(s * tp);
    std::string line = "stage " + std::to_string(s) + ":";
    if (pl.cpu) {
      line += " " + pl.ranks[first].node_name + " " + std::to_string(tp) + " CPU actor" +
              (tp > 1 ? "s" : "");
    } else {
      line += " " + describe_members(pl.ranks, first, tp);
      if (static_cast<size_t>(s) < pl.groups.size()) {
        const TpGroupLinks& g = pl.groups[static_cast<size_t>(s)];
        if (g.cross_node) {
          line += " [network]";
        } else if (tp > 1) {
          line += " [" + link_name(g.worst) + "]";
        }
      }
    }
    out += line + "\n";
  }
  return out;
}

// ---- choosing a plan ------------------------------------------------------------------------

namespace {

struct Candidate {
  int64_t tp = 1;
  int64_t pp = 1;
};

std::string shape_flags(int64_t tp, int64_t pp) {
  return "-tp " + std::to_string(tp) + " -pp " + std::to_string(pp);
}

std::vector<std::string> rank_labels(const Placement& pl) {
  std::vector<std::string> out;
  for (const PlacedRank& r : pl.ranks) {
    out.push_back(r.node_name + " " + (r.gpu >= 0 ? gpu_word(r.gpu) : std::string("cpu")));
  }
  return out;
}

struct Context {
  const ModelConfig& config;
  const std::vector<ClusterNode>& nodes;
  std::vector<int64_t> partition;
  bool expert_parallel;
  DType dtype;
  QuantConfig quant;  // the run's: what the weights take on each rank
  bool cpu;
  EngineSpec memory;  // resolve_lengths: max_model_len and max_num_batched_tokens filled in
};

// Plans, places and sizes one (T, P); `fit` holds memory_status (without suggestions).
Expected<ClusterPlan> evaluate(const Context& cx, int64_t tp, int64_t pp) {
  ParallelConfig shape;
  shape.tp_size = static_cast<int>(tp);
  shape.pp_size = static_cast<int>(pp);
  shape.layer_partition = cx.partition;
  shape.expert_parallel = cx.expert_parallel;
  ClusterPlan out;
  TESSERA_ASSIGN_OR_RETURN(out.plan, make_parallel_plan(cx.config, shape, cx.dtype, cx.quant));
  TESSERA_ASSIGN_OR_RETURN(out.placement, place_ranks(tp, pp, cx.nodes, cx.cpu));
  std::vector<std::optional<GpuMemory>> gpus;
  for (const PlacedRank& r : out.placement.ranks) {
    gpus.push_back(r.gpu >= 0 ? std::optional<GpuMemory>(r.memory) : std::nullopt);
  }
  out.memory = estimate_memory(cx.config, out.plan, gpus, cx.memory);
  out.fit = memory_status(out.memory, rank_labels(out.placement));
  return out;
}

bool has_headroom(const ClusterPlan& p) {
  if (p.placement.cpu) return p.memory.fits;  // CPU ranks hold one sequence by design
  return p.memory.fits && p.memory.kv_tokens >= kAutoMinSequences * p.memory.engine.max_model_len;
}

// Why a candidate was passed over, in a few words.
std::string why_not(const Expected<ClusterPlan>& e) {
  if (!e) return e.status().message();
  const MemoryPlan& m = e->memory;
  const RankMemory& r = m.ranks.at(static_cast<size_t>(m.limiting_rank));
  if (r.weights + r.activations >= r.budget) {
    return "weights " + format_gib(r.weights) + " + activations " + format_gib(r.activations) +
           " leave no KV room in a " + format_gib(r.budget) + " budget";
  }
  return "KV room for " + format_count(m.kv_tokens) + " tokens, under " +
         std::to_string(kAutoMinSequences) + " x --max-model-len " +
         std::to_string(m.engine.max_model_len);
}

// Every (T, P) the request allows, fewest GPUs first.
std::vector<Candidate> candidates(const Context& cx, std::optional<int64_t> tp,
                                  std::optional<int64_t> pp, int64_t max_world) {
  std::vector<int64_t> tps =
      tp ? std::vector<int64_t>{*tp}
         : valid_tensor_parallel_sizes(cx.config, max_world, cx.expert_parallel);
  std::vector<Candidate> out;
  for (int64_t t : tps) {
    if (pp) {
      out.push_back({t, *pp});
      continue;
    }
    for (int64_t p = 1; p <= cx.config.num_layers && t * p <= max_world; ++p) out.push_back({t, p});
    if (tp && t > max_world) out.push_back({t, 1});  // placing it says what is missing
  }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    return a.tp * a.pp != b.tp * b.pp ? a.tp * a.pp < b.tp * b.pp : a.tp > b.tp;
  });
  return out;
}

int64_t free_gpus(const std::vector<ClusterNode>& nodes) {
  int64_t n = 0;
  for (const ClusterNode& c : nodes) {
    if (c.node.takes_actors()) {
      n += static_cast<int64_t>(free_positions(c.node.resources, c.busy_gpus).size());
    }
  }
  return n;
}

std::string group_links_summary(const ClusterPlan& p) {
  if (p.placement.cpu) return "CPU actors";
  if (p.plan.tp == 1) return "no tensor parallelism";
  for (const TpGroupLinks& g : p.placement.groups) {
    if (!g.on_nvlink()) return "TP groups not all on NVLink";
  }
  return "TP groups on NVLink (" + link_name(p.placement.groups.front().worst) + ")";
}

}  // namespace

std::vector<ClusterNode> with_shared_gpus(std::vector<ClusterNode> nodes, double utilization) {
  for (ClusterNode& n : nodes) {
    std::erase_if(n.busy_gpus, [&](uint32_t index) {
      for (const GpuDevice& g : n.node.resources.gpus) {
        if (g.index != index || g.memory_total == 0) continue;
        const uint64_t free = g.memory_total - std::min(g.memory_used, g.memory_total);
        return static_cast<double>(free) >= utilization * static_cast<double>(g.memory_total);
      }
      return false;
    });
  }
  return nodes;
}

Expected<ClusterPlan> plan_on_cluster(const ModelConfig& config, const EngineSpec& spec,
                                      const std::vector<ClusterNode>& given) {
  TESSERA_RETURN_IF_ERROR(validate(spec));
  const std::vector<ClusterNode> nodes = with_shared_gpus(given, spec.gpu_memory_utilization);
  bool any_gpu = false;
  for (const ClusterNode& n : nodes)
    any_gpu |= n.node.takes_actors() && !n.node.resources.gpus.empty();
  bool cpu = spec.device == Device::kCpu || (spec.device == Device::kAuto && !any_gpu);
  if (spec.device == Device::kCuda && !any_gpu) {
    return failed_precondition("--device cuda: the cluster has no GPUs");
  }
  TESSERA_ASSIGN_OR_RETURN(DType dtype, resolve_dtype(spec.dtype, config.torch_dtype, !cpu));
  TESSERA_ASSIGN_OR_RETURN(EngineSpec memory, resolve_lengths(spec, config));
  TESSERA_ASSIGN_OR_RETURN(QuantConfig quant,
                           resolve_quantization(spec.quantization, config.quant));
  std::optional<int64_t> tp, pp;
  if (!spec.tensor_parallel_size.is_auto()) tp = spec.tp();
  if (spec.pp() != 0) pp = spec.pp();  // unset: the partition's stages, or 1
  const std::vector<int64_t>& partition = spec.pipeline_layer_partition;
  Context cx{config, nodes, partition, spec.enable_expert_parallel, dtype, quant, cpu, memory};
  // CPU actors are not counted: auto keeps them to one rank per fixed size.
  const int64_t max_world = cpu ? tp.value_or(1) * pp.value_or(1) : free_gpus(nodes);

  ClusterPlan chosen;
  if (tp && pp) {
    TESSERA_ASSIGN_OR_RETURN(chosen, evaluate(cx, *tp, *pp));
  } else {
    if (tp) {
      TESSERA_RETURN_IF_ERROR(check_tensor_parallel(config, *tp, spec.enable_expert_parallel));
    }
    // Every candidate, in preference order: fewest stages, then the smallest TP group.
    std::vector<Candidate> order = candidates(cx, tp, pp, std::max<int64_t>(max_world, 1));
    std::stable_sort(order.begin(), order.end(), [](const Candidate& a, const Candidate& b) {
      return a.pp != b.pp ? a.pp < b.pp : a.tp < b.tp;
    });
    std::vector<Expected<ClusterPlan>> evals;
    for (const Candidate& c : order) evals.push_back(evaluate(cx, c.tp, c.pp));
    auto on_nvlink = [](const Expected<ClusterPlan>& e) {
      return e && e->placement.warnings.empty();
    };
    // The first candidate (in `order`, or by fewest GPUs) that passes `ok`.
    auto first = [&](auto ok, bool by_world) -> std::optional<size_t> {
      std::optional<size_t> best;
      for (size_t i = 0; i < evals.size(); ++i) {
        if (!ok(evals[i])) continue;
        if (!by_world) return i;
        if (!best || evals[i]->plan.world < evals[*best]->plan.world) best = i;
      }
      return best;
    };
    const std::string room = "KV room for " + std::to_string(kAutoMinSequences) +
                             " sequences of --max-model-len " +
                             std::to_string(memory.max_model_len);
    std::optional<size_t> pick;
    std::string why;
    if ((pick = first([&](const auto& e) { return on_nvlink(e) && has_headroom(*e); }, false))) {
      why =
          "the fewest pipeline stages, then the smallest TP group, that keeps TP on NVLink "
          "and holds the model with " +
          room;
    } else if ((pick = first([&](const auto& e) { return e && has_headroom(*e); }, true))) {
      why = "no plan keeps TP on NVLink with " + room + "; the fewest GPUs that do";
    } else if ((pick =
                    first([&](const auto& e) { return on_nvlink(e) && e->memory.fits; }, false)) ||
               (pick = first([&](const auto& e) { return e && e->memory.fits; }, true))) {
      why = "no plan on this cluster leaves " + room + "; the first that fits one sequence";
    } else {
      for (size_t i = 0; i < evals.size(); ++i) {
        if (evals[i] && (!pick || evals[i]->memory.kv_tokens > evals[*pick]->memory.kv_tokens)) {
          pick = i;
        }
      }
      if (!pick) {
        return evals.empty() ? resource_exhausted("no -tp/-pp to try on this cluster")
                             : evals.front().status();
      }
      why = "no plan on this cluster fits; the one with the most KV room";
    }
    chosen = *evals[*pick];
    // Why the candidate before it (the nearest that was passed over) would not do.
    std::string passed;
    for (size_t i = *pick; i-- > 0;) {
      if (evals[i] && !evals[i]->placement.warnings.empty()) continue;
      passed = " (" + shape_flags(order[i].tp, order[i].pp) + ": " + why_not(evals[i]) + ")";
      break;
    }
    const std::string asked =
        std::string(tp ? "" : "-tp auto") + (tp || pp ? "" : " ") + (pp ? "" : "-pp auto");
    chosen.choice = asked + ": chose " + shape_flags(chosen.plan.tp, chosen.plan.pp) + ", " + why +
                    passed + "; " + group_links_summary(chosen);
  }

  chosen.warnings = chosen.placement.warnings;
  if (cpu && (spec.dtype == "half" || spec.dtype == "float16" || spec.dtype == "bfloat16")) {
    // The CPU backend computes in float32 whatever the flag says (actors/model/cpu_model.cpp):
    // a user who asked for half precision is told, not given float32 silently. The driver
    // logs the plan's warnings once (plan_session); `tessera plan` prints them.
    chosen.warnings.push_back("--dtype " + spec.dtype +
                              ": the CPU backend computes in float32; bfloat16 and float16 "
                              "apply on the GPU (--device cuda)");
  }
  if (chosen.placement.cpu) {
    // CPU ranks live in host memory: say when a node's ranks need more than it has available.
    std::map<std::string, uint64_t> need;
    for (size_t r = 0; r < chosen.placement.ranks.size(); ++r) {
      need[chosen.placement.ranks[r].node_id] +=
          chosen.memory.ranks[r].weights + chosen.memory.ranks[r].kv_bytes;
    }
    for (const ClusterNode& n : nodes) {
      auto it = need.find(n.node.node_id);
      const uint64_t available = n.node.resources.memory_available;
      if (it == need.end() || available == 0 || it->second <= available) continue;
      chosen.warnings.push_back("node " + node_label(n.node) + ": its CPU ranks need " +
                                format_gib(it->second) + " for weights and KV cache but it has " +
                                format_gib(available) + " of memory available");
    }
  }
  const int64_t world = chosen.plan.world;
  if (!chosen.placement.warnings.empty()) {
    // The same GPUs with smaller TP groups that stay on NVLink.
    for (int64_t t = chosen.plan.tp - 1; t >= 1; --t) {
      if (world % t != 0 || !partition.empty()) continue;
      Expected<ClusterPlan> e = evaluate(cx, t, world / t);
      if (!e || !e->placement.warnings.empty() || !e->memory.fits) continue;
      chosen.better = ParallelConfig{static_cast<int>(t), static_cast<int>(world / t)};
      std::string stages = format_stages(e->placement, t, world / t);
      stages.pop_back();  // the last '\n'
      for (size_t i = 0; (i = stages.find('\n', i)) != std::string::npos;)
        stages.replace(i, 1, "; ");
      chosen.warnings.push_back("better: " + shape_flags(t, world / t) +
                                " keeps every tensor-parallel group on NVLink (" + stages +
                                ") and fits with " + format_count(e->memory.kv_tokens) +
                                " KV tokens");
      break;
    }
  }
  if (!chosen.fit && !cpu) {
    // A concrete -tp/-pp that fits on this cluster, when one does.
    std::string hint =
        "; no -tp/-pp fits on this cluster's " + std::to_string(max_world) + " free GPUs";
    for (const Candidate& c : candidates(cx, std::nullopt, std::nullopt, max_world)) {
      if (c.tp == chosen.plan.tp && c.pp == chosen.plan.pp) continue;
      Expected<ClusterPlan> e = evaluate(cx, c.tp, c.pp);
      if (e && e->memory.fits) {
        hint = "; on this cluster " + shape_flags(c.tp, c.pp) + " fits (" +
               format_count(e->memory.kv_tokens) + " KV tokens)";
        break;
      }
    }
    chosen.fit = Status(chosen.fit.code(), chosen.fit.message() + hint);
  }
  TESSERA_ASSIGN_OR_RETURN(chosen.engine,
                           resolve_engine_spec(spec, config, chosen.plan.tp, chosen.plan.pp,
                                               chosen.plan.stage_layers,
                                               cpu ? Device::kCpu : Device::kCuda));
  return chosen;
}

size_t ReplicaPlans::fitting() const {
  if (!failure.is_ok()) return plans.size();
  return plans.size() - (plans.empty() || plans.back().fit.is_ok() ? 0 : 1);
}

ReplicaPlans plan_replicas(const ModelConfig& config, const EngineSpec& spec,
                           std::vector<ClusterNode> nodes, int64_t replicas) {
  ReplicaPlans out;
  const bool automatic = replicas == 0;
  std::set<std::string> taken;  // nodes holding CPU ranks of a replica planned here
  for (int64_t r = 0; automatic ? r < kMaxParallelSize : r < replicas; ++r) {
    auto plan = plan_on_cluster(config, spec, nodes);
    if (!plan) {
      out.failure = plan.status();
      if (automatic && !out.plans.empty()) out.failure = Status::ok();
      return out;
    }
    const ClusterPlan& p = *plan;
    if (automatic && p.placement.cpu) {
      // CPU ranks always place; auto gives each replica nodes of its own.
      bool shared = false;
      for (const PlacedRank& rank : p.placement.ranks) shared |= taken.contains(rank.node_id);
      if (shared && !out.plans.empty()) return out;
    }
    if (automatic && !p.fit && !out.plans.empty()) return out;
    out.plans.push_back(std::move(*plan));
    const ClusterPlan& kept = out.plans.back();
    if (!kept.fit) return out;
    // What this replica holds, as the next one's plan sees it: its GPUs busy, with the memory
    // its budget takes in use (another replica shares one when the rest holds its budget).
    for (size_t i = 0; i < kept.placement.ranks.size(); ++i) {
      const PlacedRank& rank = kept.placement.ranks[i];
      taken.insert(rank.node_id);
      for (ClusterNode& n : nodes) {
        if (n.node.node_id != rank.node_id) continue;
        ++n.actors;
        if (rank.gpu < 0) continue;
        n.busy_gpus.push_back(static_cast<uint32_t>(rank.gpu));
        for (GpuDevice& g : n.node.resources.gpus) {
          if (static_cast<int64_t>(g.index) != rank.gpu) continue;
          g.memory_used = std::min(g.memory_total, g.memory_used + kept.memory.ranks.at(i).budget);
        }
      }
    }
  }
  return out;
}

}  // namespace tessera
