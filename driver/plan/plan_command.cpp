#include "driver/plan/plan_command.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/checkpoint/model_config.h"
#include "common/session.h"
#include "protocol/auth.h"

namespace tessera {

// ---- the model flags -------------------------------------------------------------------------

namespace {

// Parses the flag's text with `parse` into the spec at once; a bad value is CLI11's usage error.
template <typename T, typename Parse>
void set_parsed(T& field, const std::string& text, Parse parse) {
  Expected<T> value = parse(text);
  if (!value) throw CLI::ValidationError(value.status().message());
  field = *value;
}

}  // namespace

void add_parallel_size_options(CLI::App* cmd, EngineSpec& e) {
  cmd->add_option_function<std::string>(
         "--tensor-parallel-size",
         [&e](const std::string& t) {
           set_parsed(e.tensor_parallel_size, t, [](const std::string& text) {
             return ParallelSize::parse(text, "-tp/--tensor-parallel-size");
           });
         },
         "-tp: GPUs per pipeline stage, splitting each layer (1; auto = the fewest that fit)")
      ->type_name("N|auto");
  cmd->add_option_function<std::string>(
         "--pipeline-parallel-size",
         [&e](const std::string& t) {
           ParallelSize size;
           set_parsed(size, t, [](const std::string& text) {
             return ParallelSize::parse(text, "-pp/--pipeline-parallel-size");
           });
           e.pipeline_parallel_size = size;
         },
         "-pp: pipeline stages, splitting the layers (1, or as many as "
         "--pipeline-layer-partition lists; auto)")
      ->type_name("N|auto");
}

void add_model_options(CLI::App* cmd, EngineSpec& e) {
  cmd->add_option("--model", e.model, "Hugging Face model directory")->required();
  add_parallel_size_options(cmd, e);
  cmd->add_option_function<std::string>(
         "--pipeline-layer-partition",
         [&e](const std::string& t) {
           set_parsed(e.pipeline_layer_partition, t, parse_layer_partition);
         },
         "Layers per stage, e.g. 10,12,10 (default: even)")
      ->type_name("LIST");
  cmd->add_flag("--enable-expert-parallel", e.enable_expert_parallel,
                "Mixture-of-experts models: whole experts on each tensor-parallel rank (CPU: "
                "tokens sent to them by all-to-all; CUDA: each rank runs its experts, the "
                "all-reduce sums them) (default: every expert split over the ranks)");
  cmd->add_option("--dtype", e.dtype, "auto|bfloat16|float16|half|float32 (float32: cpu only)");
  cmd->add_option_function<std::string>(
         "--quantization,-q",
         [&e](const std::string& t) { set_parsed(e.quantization, t, parse_quant_method); },
         "awq|awq_marlin|gptq|gptq_marlin|fp8|none: how the linear layers are stored (default: "
         "the checkpoint's quantization_config; fp8 on a plain checkpoint quantizes at load)")
      ->type_name("METHOD");
  cmd->add_option_function<std::string>(
         "--device", [&e](const std::string& t) { set_parsed(e.device, t, parse_device); },
         "auto (GPUs when there are any)|cuda|cpu")
      ->type_name("DEVICE");
  cmd->add_option("--max-model-len", e.max_model_len,
                  "Context length (default: the model's max_position_embeddings)");
  cmd->add_option("--gpu-memory-utilization", e.gpu_memory_utilization,
                  "Fraction of each GPU's memory to use")
      ->capture_default_str();
  cmd->add_option("--num-gpu-blocks-override", e.num_gpu_blocks_override,
                  "At most this many KV cache blocks, whatever the memory holds (0: no cap; for "
                  "studying eviction and routing, as vLLM's)")
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", e.max_num_seqs, "Most sequences in a step")
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", e.max_num_batched_tokens,
                  "Most tokens in a step (default: max-model-len, at least " +
                      std::to_string(kDefaultBatchedTokensFloor) + " and at most " +
                      std::to_string(kDefaultBatchedTokensCeiling) + ")");
  cmd->add_option("--block-size", e.block_size, "Tokens per KV cache block")->capture_default_str();
  cmd->add_option_function<std::string>(
         "--load-format",
         [&e](const std::string& t) { set_parsed(e.load_format, t, parse_load_format); },
         "auto (the safetensors) | dummy: random weights made on the GPU from config.json "
         "alone, to benchmark a shape no disk holds (CUDA; AWQ, GPTQ and FP8 configs too)")
      ->type_name("FORMAT");
  cmd->add_flag("--enforce-eager", e.enforce_eager,
                "Do not capture CUDA graphs (no memory kept for them)");
  cmd->add_option_function<std::string>(
         "--kv-cache-dtype",
         [&e](const std::string& t) { set_parsed(e.kv_cache_dtype, t, parse_kv_cache_dtype); },
         "auto (the model's dtype) | fp8 | fp8_e4m3: FP8 halves the cache's memory and the "
         "bytes attention reads, for ~6% relative error per cached value")
      ->type_name("DTYPE");
  // vLLM's tutorials pass it for models whose Python code ships beside the weights; Tessera
  // runs none, so it changes nothing: taken, and noted (trust_remote_code_note).
  cmd->add_flag("--trust-remote-code")
      ->description("Accepted as vLLM takes it; Tessera executes no code from the model directory");
}

std::string trust_remote_code_note(const CLI::App& app) {
  for (const CLI::App* sub : app.get_subcommands()) {
    const CLI::Option* flag = sub->get_option_no_throw("--trust-remote-code");
    if (flag != nullptr && flag->count() > 0) {
      return "--trust-remote-code: Tessera executes no code from the model directory (it reads "
             "config.json, generation_config.json, the safetensors weights and the tokenizer "
             "files only)";
    }
    if (std::string note = trust_remote_code_note(*sub); !note.empty()) return note;
  }
  return "";
}

std::vector<std::string> positional_model_argv(std::vector<std::string> args) {
  // The subcommands that load a model, as the words that name them (bench serve is a client).
  static const std::vector<std::vector<std::string>> kModelCommands = {{"serve"},
                                                                       {"generate"},
                                                                       {"plan"},
                                                                       {"bench", "latency"},
                                                                       {"bench", "throughput"},
                                                                       {"bench", "report"},
                                                                       {"bench", "control-plane"}};
  // tessera's own flags may come first; --log-level is the one that takes a separate value.
  size_t at = 1;
  while (at < args.size() && args[at].rfind('-', 0) == 0) at += args[at] == "--log-level" ? 2 : 1;
  for (const auto& words : kModelCommands) {
    if (at + words.size() >= args.size() ||
        !std::equal(words.begin(), words.end(), args.begin() + static_cast<long>(at))) {
      continue;
    }
    const size_t next = at + words.size();
    if (!args[next].empty() && args[next][0] != '-') {
      args.insert(args.begin() + static_cast<long>(next), "--model");
    }
    break;
  }
  return args;
}

void add_data_parallel_option(CLI::App* cmd, ParallelSize& replicas) {
  cmd->add_option_function<std::string>(
         "--data-parallel-size",
         [&replicas](const std::string& text) {
           auto size = ParallelSize::parse(text, "-dp/--data-parallel-size");
           if (!size) throw CLI::ValidationError(size.status().message());
           replicas = *size;
         },
         "-dp: replicas of the model's T x P plan, each with its own scheduler and KV cache, "
         "placed where the ones before left room; auto: as many as fit, and one more on each "
         "node that joins while there is room (1)")
      ->type_name("N|auto");
}

ParallelFlagArgv::ParallelFlagArgv(int argc, const char* const* argv) {
  bool rest = false;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && !rest) {
      if (a == "--") {
        rest = true;
      } else if (a == "-tp" || a.rfind("-tp=", 0) == 0) {
        a = "--tensor-parallel-size" + a.substr(3);
      } else if (a == "-pp" || a.rfind("-pp=", 0) == 0) {
        a = "--pipeline-parallel-size" + a.substr(3);
      } else if (a == "-dp" || a.rfind("-dp=", 0) == 0) {
        a = "--data-parallel-size" + a.substr(3);
      }
    }
    args_.push_back(std::move(a));
  }
  for (const std::string& a : args_) pointers_.push_back(a.c_str());
}

// ---- nodes ------------------------------------------------------------------------------------

std::vector<ClusterNode> cluster_nodes(const ClusterStatus& status) {
  std::vector<ClusterNode> out;
  for (const NodeStatus& ns : status.nodes) {
    if (!ns.node.alive) continue;
    ClusterNode n{ns.node, {}};
    for (const ActorView& a : ns.actors) {
      if (a.state == "dead") continue;
      ++n.actors;
      for (uint32_t g : a.gpus) {
        if (std::find(n.busy_gpus.begin(), n.busy_gpus.end(), g) == n.busy_gpus.end()) {
          n.busy_gpus.push_back(g);
        }
      }
    }
    std::sort(n.busy_gpus.begin(), n.busy_gpus.end());
    out.push_back(std::move(n));
  }
  return out;
}

std::vector<ClusterNode> synthetic_nodes(int64_t nodes, int64_t gpus_per_node,
                                         uint64_t gpu_memory) {
  std::vector<ClusterNode> out;
  for (int64_t i = 0; i < nodes; ++i) {
    ClusterNode n;
    n.node.node_id = "node-" + std::to_string(i);
    n.node.name = n.node.node_id;
    n.node.alive = true;
    n.node.is_head = i == 0;
    NodeResources& r = n.node.resources;
    r.hostname = n.node.name;
    for (int64_t g = 0; g < gpus_per_node; ++g) {
      GpuDevice d;
      d.index = static_cast<uint32_t>(g);
      d.name = "GPU";
      d.memory_total = gpu_memory;
      r.gpus.push_back(d);
    }
    for (int64_t a = 0; a < gpus_per_node; ++a) {
      for (int64_t b = 0; b < gpus_per_node; ++b) {
        r.links.push_back(a == b ? GpuLink{LinkKind::kSelf, 0} : GpuLink{LinkKind::kNvlink, 18});
      }
    }
    out.push_back(std::move(n));
  }
  return out;
}

namespace {

Expected<GpuLink> parse_link(const std::string& s) {
  if (s == "X") return GpuLink{LinkKind::kSelf, 0};
  if (s == "PIX") return GpuLink{LinkKind::kPix, 0};
  if (s == "PXB") return GpuLink{LinkKind::kPxb, 0};
  if (s == "PHB") return GpuLink{LinkKind::kPhb, 0};
  if (s == "NODE") return GpuLink{LinkKind::kNode, 0};
  if (s == "SYS") return GpuLink{LinkKind::kSys, 0};
  if (s == "N/A") return GpuLink{LinkKind::kUnknown, 0};
  if (s.size() > 2 && s.rfind("NV", 0) == 0 &&
      s.find_first_not_of("0123456789", 2) == std::string::npos && s.size() < 6) {
    return GpuLink{LinkKind::kNvlink, static_cast<uint32_t>(std::stoul(s.substr(2)))};
  }
  return invalid_argument("unknown link '" + s + "' (X, NV#, PIX, PXB, PHB, NODE, SYS or N/A)");
}

std::string gpu_list(const std::vector<uint32_t>& gpus) {
  std::string out;
  for (uint32_t g : gpus) out += (out.empty() ? "gpu" : " gpu") + std::to_string(g);
  return out;
}

}  // namespace

std::string topology_json(const std::string& head_address, const std::vector<ClusterNode>& nodes) {
  using nlohmann::json;
  json out_nodes = json::array();
  for (const ClusterNode& cn : nodes) {
    const NodeView& n = cn.node;
    const NodeResources& r = n.resources;
    json gpus = json::array();
    for (const GpuDevice& g : r.gpus) {
      const bool busy =
          std::find(cn.busy_gpus.begin(), cn.busy_gpus.end(), g.index) != cn.busy_gpus.end();
      gpus.push_back({{"index", g.index},
                      {"name", g.name},
                      {"uuid", g.uuid},
                      {"pci_bus_id", g.pci_bus_id},
                      {"memory_total", g.memory_total},
                      {"memory_used", g.memory_used},
                      {"busy", busy}});
    }
    json links = json::array();
    const size_t count = r.gpus.size();
    for (size_t i = 0; i < count; ++i) {
      json row = json::array();
      for (size_t j = 0; j < count && i * count + j < r.links.size(); ++j) {
        row.push_back(link_name(r.links[i * count + j]));
      }
      links.push_back(row);
    }
    json sizes = json::array();
    for (const NvlinkGroups& g : nvlink_tp_sizes(r, cn.busy_gpus)) {
      sizes.push_back({{"tp", g.tp}, {"groups", g.groups}});
    }
    out_nodes.push_back({{"node_id", n.node_id},
                         {"name", n.name},
                         {"address", n.address},
                         {"is_head", n.is_head},
                         {"alive", n.alive},
                         {"draining", n.draining},
                         {"cpus", r.cpus},
                         {"memory_total", r.memory_total},
                         {"memory_available", r.memory_available},
                         {"gpu_note", r.gpu_note},
                         {"gpus", gpus},
                         {"links", links},
                         {"nvlink_islands", nvlink_islands(r)},
                         {"nvlink_tp_sizes", sizes}});
  }
  json out = {{"head_address", head_address}, {"nodes", out_nodes}};
  return out.dump(2) + "\n";
}

Expected<std::vector<ClusterNode>> parse_topology_json(const std::string& text,
                                                       const std::string& file) {
  using nlohmann::json;
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("nodes") ||
      !doc["nodes"].is_array()) {
    return invalid_argument(file +
                            ": not a `tessera topo --json` (or `status --json`) file: it "
                            "needs an object with a \"nodes\" array");
  }
  std::vector<ClusterNode> out;
  try {
    size_t i = 0;
    for (const json& jn : doc["nodes"]) {
      const std::string where = file + ": nodes[" + std::to_string(i++) + "]";
      ClusterNode cn;
      NodeView& n = cn.node;
      n.node_id = jn.value("node_id", "");
      n.name = jn.value("name", "");
      n.address = jn.value("address", "");
      n.is_head = jn.value("is_head", false);
      n.alive = jn.value("alive", true);
      if (!n.alive) continue;
      n.draining = jn.value("draining", false);
      if (n.node_id.empty()) n.node_id = n.name.empty() ? "node-" + std::to_string(i - 1) : n.name;
      NodeResources& r = n.resources;
      r.hostname = n.name;
      r.cpus = jn.value("cpus", 0u);
      r.memory_total = jn.value("memory_total", uint64_t{0});
      r.memory_available = jn.value("memory_available", uint64_t{0});
      r.gpu_note = jn.value("gpu_note", "");
      for (const json& jg : jn.value("gpus", json::array())) {
        GpuDevice g;
        g.index = jg.at("index").get<uint32_t>();
        g.name = jg.value("name", "");
        g.uuid = jg.value("uuid", "");
        g.pci_bus_id = jg.value("pci_bus_id", "");
        g.memory_total = jg.at("memory_total").get<uint64_t>();
        g.memory_used = jg.value("memory_used", uint64_t{0});
        if (jg.value("busy", false)) cn.busy_gpus.push_back(g.index);
        r.gpus.push_back(g);
      }
      const json links = jn.value("links", json::array());
      if (links.size() != r.gpus.size()) {
        return invalid_argument(where + ": \"links\" has " + std::to_string(links.size()) +
                                " rows for " + std::to_string(r.gpus.size()) + " GPUs");
      }
      for (const json& row : links) {
        if (!row.is_array() || row.size() != r.gpus.size()) {
          return invalid_argument(where + ": every \"links\" row needs " +
                                  std::to_string(r.gpus.size()) + " entries");
        }
        for (const json& cell : row) {
          auto link = parse_link(cell.get<std::string>());
          if (!link) return link.status().with_context(where);
          r.links.push_back(*link);
        }
      }
      // `tessera status --json`: the GPUs of live actors are busy.
      for (const json& a : jn.value("actors", json::array())) {
        if (a.value("state", "") == "dead") continue;
        for (const json& g : a.value("gpus", json::array())) {
          const uint32_t idx = g.get<uint32_t>();
          if (std::find(cn.busy_gpus.begin(), cn.busy_gpus.end(), idx) == cn.busy_gpus.end()) {
            cn.busy_gpus.push_back(idx);
          }
        }
      }
      std::sort(cn.busy_gpus.begin(), cn.busy_gpus.end());
      out.push_back(std::move(cn));
    }
  } catch (const json::exception& e) {
    return invalid_argument(file + ": " + e.what());
  }
  if (out.empty()) return invalid_argument(file + ": no live node in \"nodes\"");
  return out;
}

std::string render_topology(const std::string& head_address,
                            const std::vector<ClusterNode>& nodes) {
  std::ostringstream o;
  o << "Cluster at " << head_address << ": " << nodes.size() << " node"
    << (nodes.size() == 1 ? "" : "s") << "\n";
  for (const ClusterNode& cn : nodes) {
    const NodeView& n = cn.node;
    const NodeResources& r = n.resources;
    o << "\nNode " << n.node_id;
    if (!n.name.empty() && n.name != n.node_id) o << " (" << n.name << ")";
    o << (n.is_head ? " [head]" : "") << (n.draining ? " [draining: no new ranks]" : "");
    if (r.gpus.empty()) {
      o << ": no GPUs" << (r.gpu_note.empty() ? "" : " (" + r.gpu_note + ")")
        << "; ranks here run as CPU actors\n";
      continue;
    }
    o << ": " << r.gpus.size() << " GPU" << (r.gpus.size() == 1 ? "" : "s");
    if (!r.gpus.front().name.empty()) o << " " << r.gpus.front().name;
    o << ", " << format_gib(r.gpus.front().memory_total) << " each";
    if (!cn.busy_gpus.empty()) {
      o << "; busy: " << gpu_list(cn.busy_gpus);
    }
    o << "\n";
    if (r.links.size() != r.gpus.size() * r.gpus.size()) {
      o << "  link matrix unknown\n";
      continue;
    }
    std::istringstream matrix(format_link_matrix(r));
    for (std::string line; std::getline(matrix, line);) o << "  " << line << "\n";
    std::string islands;
    for (const auto& island : nvlink_islands(r)) {
      if (island.size() < 2) continue;
      islands += (islands.empty() ? "" : " | ") + gpu_list(island);
    }
    o << "  NVLink islands: " << (islands.empty() ? "none" : islands) << "\n";
    std::string sizes;
    for (const NvlinkGroups& g : nvlink_tp_sizes(r, cn.busy_gpus)) {
      sizes += (sizes.empty() ? "" : ", ") + std::to_string(g.tp) + " (" +
               std::to_string(g.groups) + " group" + (g.groups == 1 ? "" : "s") + ")";
    }
    o << "  TP sizes on NVLink" << (cn.busy_gpus.empty() ? "" : " (free GPUs)") << ": "
      << (sizes.empty() ? "none free" : sizes) << "\n";
  }
  return o.str();
}

// ---- the report -------------------------------------------------------------------------------

namespace {

std::string shape_flags(int64_t tp, int64_t pp) {
  return "-tp " + std::to_string(tp) + " -pp " + std::to_string(pp);
}

std::string range(int64_t begin, int64_t end) {
  return end - begin == 1 ? std::to_string(begin)
                          : std::to_string(begin) + "-" + std::to_string(end - 1);
}

std::string table(const std::vector<std::vector<std::string>>& rows, const std::string& indent) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = indent;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line.append(width[c] - row[c].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace

std::string render_cluster_plan(const ModelConfig& c, const ClusterPlan& cp) {
  const ParallelPlan& p = cp.plan;
  // cp.engine is resolved: its method is concrete and agrees with the checkpoint.
  const Expected<QuantConfig> resolved = resolve_quantization(cp.engine.quantization, c.quant);
  const QuantConfig quant = resolved ? *resolved : QuantConfig{};
  const MemoryPlan& m = cp.memory;
  std::string o;
  o +=
      std::string("Model: ") + architecture_name(c.arch) + ", " + std::to_string(c.num_layers) +
      " layers, hidden " + std::to_string(c.hidden_size) + ", " + std::to_string(c.num_heads) +
      " heads (" + std::to_string(c.num_kv_heads) + " KV, head_dim " + std::to_string(c.head_dim) +
      "), intermediate " + std::to_string(c.intermediate_size) + ", vocab " +
      std::to_string(c.vocab_size) + (c.tie_word_embeddings ? " (tied)" : "") + "; weights " +
      format_gib(model_weight_bytes(c, p.dtype, quant)) + " in " + run_dtype_name(p.dtype) +
      (quant.method == QuantMethod::kNone ? std::string() : ", linear layers " + quant.describe()) +
      "\n";
  if (!cp.choice.empty()) o += cp.choice + "\n";
  o += "Plan: " + shape_flags(p.tp, p.pp) + " = " + std::to_string(p.world) + " rank" +
       (p.world > 1 ? "s" : "") + "\n";
  std::string stages;
  for (size_t s = 0; s < p.stage_layers.size(); ++s) {
    const LayerPlan& r = p.at(static_cast<int64_t>(s), 0).shard;
    stages += (s ? ", " : "") + std::to_string(p.stage_layers[s]) + " (" +
              range(r.layer_begin, r.layer_end) + ")";
  }
  o += "  layers per stage: " + stages + "\n";
  o += "  attention heads: " + std::to_string(c.num_heads / p.tp) + " per rank; " +
       describe_kv_heads(c, p) + "\n";
  o += "  MLP: intermediate " + std::to_string(c.intermediate_size / p.tp) + " per rank\n";
  const bool moe = c.moe.enabled();
  const bool ep = moe && p.ranks.front().shard.parallel.expert_parallel;
  if (moe) {
    int64_t sparse = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) sparse += c.moe.sparse_layer(l) ? 1 : 0;
    o += "  experts: " + std::to_string(c.moe.num_experts) + " per MoE layer (" +
         std::to_string(sparse) + " of " + std::to_string(c.num_layers) + " layers), top " +
         std::to_string(c.moe.top_k) + " per token; " +
         (ep ? "expert parallel: whole experts per rank (the Ranks table), tokens sent to them "
               "by all-to-all"
             : "each expert split over the " + std::to_string(p.tp) +
                   " tensor-parallel ranks (moe intermediate " +
                   std::to_string(c.moe.expert_intermediate / p.tp) +
                   " per rank; --enable-expert-parallel places whole experts instead)") +
         "\n";
  }
  o += "  vocab: " + std::to_string(c.vocab_size) +
       (p.padded_vocab == c.vocab_size ? std::string(" (no padding)")
                                       : " padded to " + std::to_string(p.padded_vocab) +
                                             " (a multiple of -tp " + std::to_string(p.tp) + ")") +
       ", " + std::to_string(p.padded_vocab / p.tp) + " rows per rank\n";
  o += "Placement:\n";
  std::string placed = format_stages(cp.placement, p.tp, p.pp);
  for (size_t i = 0, j; i < placed.size(); i = j + 1) {
    j = placed.find('\n', i);
    o += "  " + placed.substr(i, j - i) + "\n";
  }
  std::vector<std::vector<std::string>> rows = {{"rank", "tp", "pp", "where", "layers", "heads",
                                                 "kv heads", "mlp cols", "vocab rows", "weights"}};
  if (moe) rows[0].insert(rows[0].end(), {"experts", "expert weights"});
  const bool gpu = !cp.placement.cpu;
  if (gpu) {
    rows[0].insert(rows[0].end(), {"activations", "in use", "KV cache", "KV tokens"});
  }
  // A plan always sizes every placed rank (plan_on_cluster, plan_session); a table that
  // disagrees is a bug, refused here rather than read past its end.
  if (cp.placement.ranks.size() != p.ranks.size() || m.ranks.size() != p.ranks.size()) {
    return o + "(internal error: " + std::to_string(p.ranks.size()) + " ranks, " +
           std::to_string(cp.placement.ranks.size()) + " placed, " +
           std::to_string(m.ranks.size()) + " sized)\n";
  }
  for (const RankPlan& r : p.ranks) {
    const LayerPlan& s = r.shard;
    const PlacedRank& pl = cp.placement.ranks[static_cast<size_t>(r.rank())];
    const RankMemory& rm = m.ranks[static_cast<size_t>(r.rank())];
    std::vector<std::string> row = {
        std::to_string(r.rank()),
        std::to_string(s.parallel.tp_rank),
        std::to_string(s.parallel.pp_rank),
        pl.node_name + " " + (pl.gpu >= 0 ? "gpu" + std::to_string(pl.gpu) : "cpu"),
        range(s.layer_begin, s.layer_end),
        range(s.head_begin, s.head_begin + s.heads),
        range(s.kv_head_begin, s.kv_head_begin + s.kv_heads),
        range(s.intermediate_begin, s.intermediate_begin + s.intermediate),
        range(s.vocab_begin, s.vocab_begin + s.vocab_shard),
        format_gib(r.weight_bytes)};
    if (moe) {
      // The bytes of the experts this rank holds, in every MoE layer of its stage.
      LayerPlan experts_only = s;
      std::erase_if(experts_only.weights, [](const WeightShard& w) {
        return w.spec.kind != WeightKind::kExpertGate && w.spec.kind != WeightKind::kExpertUp &&
               w.spec.kind != WeightKind::kExpertDown;
      });
      row.insert(row.end(), {range(s.expert_begin, s.expert_begin + s.experts) +
                                 (ep ? "" : " (1/" + std::to_string(p.tp) + " each)"),
                             format_gib(experts_only.weight_bytes(p.dtype, quant))});
    }
    if (gpu) {
      row.insert(row.end(), {format_gib(rm.activations), format_gib(rm.in_use),
                             format_gib(rm.kv_bytes), format_count(rm.kv_tokens)});
    }
    rows.push_back(std::move(row));
  }
  o += "Ranks:\n" + table(rows, "  ");
  char line[256];
  if (gpu) {
    const RankMemory& lim = m.ranks[static_cast<size_t>(m.limiting_rank)];
    const PlacedRank& at = cp.placement.ranks[static_cast<size_t>(m.limiting_rank)];
    const auto sharing = std::count_if(
        cp.placement.ranks.begin(), cp.placement.ranks.end(),
        [&](const PlacedRank& r) { return r.node_id == at.node_id && r.gpu == at.gpu; });
    std::snprintf(line, sizeof(line),
                  "Memory per GPU: --gpu-memory-utilization %.2f x %s = %s for weights, "
                  "activations and the KV cache%s\n",
                  m.engine.gpu_memory_utilization, format_gib(lim.total).c_str(),
                  format_gib(lim.budget).c_str(),
                  sharing > 1 ? (" (per rank: each GPU shared by " + std::to_string(sharing) +
                                 " ranks, each sized to its share)")
                                    .c_str()
                              : "");
    o += line;
    std::snprintf(line, sizeof(line),
                  "KV cache: %s tokens (the fewest of any rank: rank %lld, %s bytes/token); max "
                  "concurrency %.2fx at --max-model-len %lld\n",
                  format_count(m.kv_tokens).c_str(), static_cast<long long>(m.limiting_rank),
                  format_count(static_cast<int64_t>(lim.kv_bytes_per_token)).c_str(),
                  m.max_concurrency, static_cast<long long>(m.engine.max_model_len));
    o += line;
  } else {
    o += "CPU actors: each rank keeps the KV cache of one --max-model-len " +
         std::to_string(m.engine.max_model_len) + " sequence in host memory\n";
  }
  for (const std::string& w : cp.warnings) {
    o += (w.rfind("better:", 0) == 0 ? "" : "warning: ") + w + "\n";
  }
  if (cp.fit) {
    o += "Fits.\n";
  } else {
    o += "Does not fit: " + cp.fit.message() + "\n";
  }
  return o;
}

// ---- the commands ---------------------------------------------------------------------------

CLI::App* add_topo_subcommand(CLI::App& app, TopoOptions& o) {
  auto* cmd = app.add_subcommand("topo", "Show each node's GPU links and the TP sizes on NVLink");
  add_head_options(cmd, o.address, o.temp_dir, o.cluster_token_file);
  cmd->add_flag("--json", o.json, "Print JSON (tessera plan --cluster-file reads it)");
  return cmd;
}

CLI::App* add_plan_subcommand(CLI::App& app, PlanOptions& o) {
  auto* cmd = app.add_subcommand(
      "plan", "Plan tensor x pipeline parallelism for a model on a cluster; starts nothing");
  add_model_options(cmd, o.engine);
  add_head_options(cmd, o.address, o.temp_dir, o.cluster_token_file);
  cmd->add_option("--cluster-file", o.cluster_file,
                  "Plan on the nodes of a `tessera topo --json` (or `status --json`) file");
  cmd->add_option("--gpus", o.gpus,
                  "Plan without a cluster for N GPUs per node, all on NVLink (0 = CPU ranks)");
  cmd->add_option("--nodes", o.nodes, "With --gpus: that many nodes (1)");
  cmd->add_option("--gpu-memory", o.gpu_memory_gib,
                  "GiB per GPU with --gpus (default: this machine's GPUs')");
  add_data_parallel_option(cmd, o.data_parallel_size);
  return cmd;
}

namespace {

// Connects to the cluster the options name (or the local head); `explicit_address` says whether
// a failure is the user's cluster being down (fatal) or no local cluster (fall back).
struct LiveCluster {
  std::string address;
  std::vector<ClusterNode> nodes;
};

Expected<LiveCluster> connect_cluster(const std::string& address_flag, const std::string& temp_dir,
                                      const std::string& token_file) {
  TESSERA_ASSIGN_OR_RETURN(HeadTarget head, find_head(address_flag, temp_dir, token_file));
  EventLoop loop;
  auto status = collect_status(loop, head.address, head.token);
  if (!status) return status.status();
  return LiveCluster{head.address, cluster_nodes(*status)};
}

Expected<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint64_t gib_bytes(double gib) { return static_cast<uint64_t>(std::llround(gib * (1ull << 30))); }

// The nodes plan_command plans on and one line saying where they come from.
Expected<std::pair<std::vector<ClusterNode>, std::string>> find_nodes(const PlanOptions& o) {
  using Result = std::pair<std::vector<ClusterNode>, std::string>;
  if (o.gpu_memory_gib < 0) return invalid_argument("--gpu-memory must be positive");
  if (!o.cluster_file.empty()) {
    TESSERA_ASSIGN_OR_RETURN(std::string text, read_file(o.cluster_file));
    TESSERA_ASSIGN_OR_RETURN(auto nodes, parse_topology_json(text, o.cluster_file));
    return Result{std::move(nodes), "Cluster from " + o.cluster_file};
  }
  auto this_machine = [&]() {
    return o.describe_this_machine ? o.describe_this_machine() : NodeResources{};
  };
  if (o.gpus >= 0) {
    if (o.nodes < 1) return invalid_argument("--nodes must be at least 1");
    uint64_t memory = gib_bytes(o.gpu_memory_gib);
    if (o.gpus > 0 && memory == 0) {
      NodeResources here = this_machine();
      if (here.gpus.empty()) {
        return invalid_argument("--gpus " + std::to_string(o.gpus) +
                                " needs --gpu-memory GiB: this machine has no GPU to copy it from");
      }
      memory = here.gpus.front().memory_total;
    }
    std::string what = o.gpus == 0 ? "CPU ranks"
                                   : std::to_string(o.gpus) + " GPU" + (o.gpus > 1 ? "s" : "") +
                                         " of " + format_gib(memory) +
                                         (o.gpus > 1 ? " on NVLink (NV18, assumed)" : "");
    return Result{synthetic_nodes(o.nodes, o.gpus, memory),
                  "No cluster: planning for " +
                      (o.nodes > 1 ? std::to_string(o.nodes) + " nodes of " : std::string()) +
                      what + " (--gpus, --nodes, --gpu-memory)"};
  }
  auto live = connect_cluster(o.address, o.temp_dir, o.cluster_token_file);
  if (live) {
    size_t gpus = 0, busy = 0, draining = 0;
    for (const ClusterNode& n : live->nodes) {
      gpus += n.node.resources.gpus.size();
      busy += n.busy_gpus.size();
      draining += n.node.draining ? 1 : 0;
    }
    return Result{std::move(live->nodes),
                  "Cluster at " + live->address + ": " + std::to_string(live->nodes.size()) +
                      " node(s), " + std::to_string(gpus) + " GPU(s), " + std::to_string(busy) +
                      " busy" +
                      (draining ? ", " + std::to_string(draining) + " draining (not used)" : "")};
  }
  if (!o.address.empty()) return live.status();
  // No cluster: this machine as one node.
  ClusterNode here;
  here.node.resources = this_machine();
  here.node.name =
      here.node.resources.hostname.empty() ? "localhost" : here.node.resources.hostname;
  here.node.node_id = here.node.name;
  here.node.alive = true;
  here.node.is_head = true;
  if (o.gpu_memory_gib > 0) {
    for (GpuDevice& g : here.node.resources.gpus) {
      g.memory_total = gib_bytes(o.gpu_memory_gib);
      g.memory_used = 0;
    }
  }
  const size_t gpus = here.node.resources.gpus.size();
  std::string line = "No cluster running: planning for this machine (" + here.node.name + ", " +
                     (gpus == 0 ? std::string("no GPUs: CPU ranks")
                                : std::to_string(gpus) + " GPU" + (gpus > 1 ? "s" : "")) +
                     "); --address, --cluster-file or --gpus N plan for others";
  if (live.status().code() != Code::kNotFound) {
    line += "\n(the head recorded on this machine did not answer: " + live.status().message() + ")";
  }
  return Result{{std::move(here)}, line};
}

}  // namespace

int topo_command(const TopoOptions& o) {
  auto live = connect_cluster(o.address, o.temp_dir, o.cluster_token_file);
  if (!live) {
    std::cerr << "tessera topo: " << live.status().message() << "\n";
    return 1;
  }
  std::cout << (o.json ? topology_json(live->address, live->nodes)
                       : render_topology(live->address, live->nodes));
  return 0;
}

namespace {

// `tessera plan -dp N|auto`: each replica's report, then how many fit.
int plan_replicas_command(const PlanOptions& o, const ModelConfig& config,
                          const std::vector<ClusterNode>& nodes, const std::string& where) {
  const ParallelSize& dp = o.data_parallel_size;
  const ReplicaPlans r = plan_replicas(config, o.engine, nodes, dp.ranks);
  std::cout << where << "\n";
  for (size_t i = 0; i < r.plans.size(); ++i) {
    std::cout << "\nReplica " << i << (dp.is_auto() ? "" : " of " + dp.to_string()) << ":\n"
              << render_cluster_plan(config, r.plans[i]);
  }
  const size_t fit = r.fitting();
  if (dp.is_auto() && fit > 0) {
    std::cout << "\n-dp auto: " << fit << " replica" << (fit == 1 ? "" : "s")
              << " fit now; a node that joins a running `tessera serve -dp auto` gets one more "
                 "when it has room.\n";
    return 0;
  }
  if (fit == static_cast<size_t>(dp.ranks)) {
    std::cout << "\nAll " << fit << " replicas fit.\n";
    return 0;
  }
  const std::string why = !r.failure.is_ok() ? r.failure.message() : r.plans.back().fit.message();
  std::cout << "\n-dp " << dp.to_string() << " does not fit: " << fit << " replica"
            << (fit == 1 ? "" : "s") << " fit; replica " << fit << ": " << why << "\n";
  return 1;
}

}  // namespace

int plan_command(const PlanOptions& o) {
  auto config = load_model_config(o.engine.model);
  if (!config) {
    std::cerr << "tessera plan: " << config.status().message() << "\n";
    return 1;
  }
  auto nodes = find_nodes(o);
  if (!nodes) {
    std::cerr << "tessera plan: " << nodes.status().message() << "\n";
    return 1;
  }
  if (o.data_parallel_size.is_auto() || o.data_parallel_size.ranks > 1) {
    return plan_replicas_command(o, *config, nodes->first, nodes->second);
  }
  auto plan = plan_on_cluster(*config, o.engine, nodes->first);
  if (!plan) {
    std::cerr << "tessera plan: " << plan.status().message() << "\n";
    return 1;
  }
  // The report ends with "Fits." or "Does not fit: <why and the flag to change>".
  std::cout << nodes->second << "\n" << render_cluster_plan(*config, *plan);
  return plan->fit ? 0 : 1;
}

}  // namespace tessera
