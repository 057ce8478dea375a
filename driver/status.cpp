#include "driver/status.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/session.h"
#include "driver/cli/cli_help.h"
#include "protocol/auth.h"

namespace tessera {

Expected<ClusterStatus> collect_status(EventLoop& loop, const std::string& head_address,
                                       const std::string& token) {
  auto cluster = ClusterClient::connect(loop, head_address, token);
  if (!cluster) return cluster.status();
  auto nodes = (*cluster)->nodes(/*include_dead=*/true);
  if (!nodes) return nodes.status();
  ClusterStatus out;
  out.head_address = head_address;
  out.head_id = (*cluster)->head_id();
  std::vector<NodeStatus> dead;
  for (auto& n : *nodes) {
    NodeStatus ns;
    ns.node = n;
    if (n.alive) {
      auto handle = (*cluster)->node(n.node_id);
      if (!handle) {
        ns.error = handle.status().message();
      } else {
        if (auto info = handle->info()) {
          // Fresh GPU memory readings; the drain mark is the head's (the node does not know it).
          ns.node = *info;
          ns.node.draining = n.draining;
        }
        if (auto actors = handle->actors()) {
          ns.actors = *actors;
        } else {
          ns.error = actors.status().message();
        }
        if (auto store = handle->object_store()) ns.object_store = *store;
      }
      out.nodes.push_back(std::move(ns));
    } else {
      dead.push_back(std::move(ns));
    }
  }
  for (auto& d : dead) out.nodes.push_back(std::move(d));
  return out;
}

namespace {

std::string gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(bytes) / (1ull << 30));
  return buf;
}

std::string join(const std::vector<uint32_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out.empty() ? "-" : out;
}

std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

}  // namespace

std::string render_status(const ClusterStatus& status) {
  std::ostringstream o;
  size_t alive = 0, draining = 0;
  for (const auto& n : status.nodes) {
    alive += n.node.alive ? 1 : 0;
    draining += n.node.alive && n.node.draining ? 1 : 0;
  }
  o << "Cluster at " << status.head_address << " (head " << status.head_id << "): " << alive
    << " node(s) alive";
  if (draining > 0) o << " (" << draining << " draining)";
  if (alive != status.nodes.size()) o << ", " << status.nodes.size() - alive << " dead";
  o << "\n";
  for (const auto& ns : status.nodes) {
    const NodeView& n = ns.node;
    const NodeResources& r = n.resources;
    const char* state = !n.alive ? "DEAD" : (n.draining ? "draining" : "alive");
    o << "\nNode " << n.node_id << " (" << n.name << ")" << (n.is_head ? " [head]" : "") << "  "
      << n.address << "  " << state << "  pid " << n.pid << "\n";
    if (!n.alive) {
      o << "  died: " << n.death_reason << "\n";
      continue;
    }
    if (n.draining) {
      o << "  draining: no new actors go there (`tessera drain " << n.name
        << " --undo` takes it back)\n";
    }
    o << "  CPUs " << r.cpus << ", memory " << gib(r.memory_available) << " GiB free of "
      << gib(r.memory_total) << " GiB\n";
    if (r.gpus.empty()) {
      o << "  GPUs: none" << (r.gpu_note.empty() ? "" : " (" + r.gpu_note + ")") << "\n";
    } else {
      o << "  GPUs: " << r.gpus.size() << " (driver " << r.driver_version << ")\n";
      for (const auto& g : r.gpus) {
        o << "    GPU" << g.index << "  " << pad(g.name, 22) << gib(g.memory_used) << " / "
          << gib(g.memory_total) << " GiB used   " << g.pci_bus_id << "  " << g.uuid << "\n";
      }
      o << "  GPU links:\n";
      std::istringstream matrix(format_link_matrix(r));
      for (std::string line; std::getline(matrix, line);) o << "    " << line << "\n";
    }
    if (ns.object_store.capacity > 0) {
      o << "  object store: " << ns.object_store.objects << " object(s), "
        << gib(ns.object_store.used) << " of " << gib(ns.object_store.capacity) << " GiB\n";
    }
    if (!ns.error.empty()) o << "  (could not read actors: " << ns.error << ")\n";
    if (ns.actors.empty()) {
      o << "  actors: none\n";
      continue;
    }
    o << "  actors:\n    " << pad("ACTOR", 12) << pad("OWNER", 16) << pad("PID", 9) << pad("GPU", 6)
      << pad("STATE", 8) << "ADDRESS / EXIT\n";
    for (const auto& a : ns.actors) {
      std::string tail = a.state == "dead" ? a.death_reason : a.address;
      o << "    " << pad(a.actor_id, 12) << pad(a.owner, 16) << pad(std::to_string(a.pid), 9)
        << pad(join(a.gpus), 6) << pad(a.state, 8) << tail << "\n";
    }
  }
  return o.str();
}

std::string render_status_json(const ClusterStatus& status) {
  using nlohmann::json;
  json nodes = json::array();
  for (const auto& ns : status.nodes) {
    const NodeView& n = ns.node;
    json gpus = json::array();
    for (const auto& g : n.resources.gpus) {
      gpus.push_back({{"index", g.index},
                      {"name", g.name},
                      {"uuid", g.uuid},
                      {"pci_bus_id", g.pci_bus_id},
                      {"memory_total", g.memory_total},
                      {"memory_used", g.memory_used}});
    }
    json links = json::array();
    size_t count = n.resources.gpus.size();
    for (size_t i = 0; i < count; ++i) {
      json row = json::array();
      for (size_t j = 0; j < count && i * count + j < n.resources.links.size(); ++j) {
        row.push_back(link_name(n.resources.links[i * count + j]));
      }
      links.push_back(row);
    }
    json actors = json::array();
    for (const auto& a : ns.actors) {
      actors.push_back({{"actor_id", a.actor_id},
                        {"owner", a.owner},
                        {"name", a.name},
                        {"pid", a.pid},
                        {"gpus", a.gpus},
                        {"state", a.state},
                        {"address", a.address},
                        {"log_path", a.log_path},
                        {"exit_code", a.exit_code},
                        {"term_signal", a.term_signal},
                        {"death_reason", a.death_reason}});
    }
    nodes.push_back({{"node_id", n.node_id},
                     {"name", n.name},
                     {"address", n.address},
                     {"is_head", n.is_head},
                     {"alive", n.alive},
                     {"draining", n.draining},
                     {"death_reason", n.death_reason},
                     {"pid", n.pid},
                     {"session_dir", n.session_dir},
                     {"cpus", n.resources.cpus},
                     {"memory_total", n.resources.memory_total},
                     {"memory_available", n.resources.memory_available},
                     {"driver_version", n.resources.driver_version},
                     {"gpu_note", n.resources.gpu_note},
                     {"gpus", gpus},
                     {"links", links},
                     {"object_store",
                      {{"capacity", ns.object_store.capacity},
                       {"used", ns.object_store.used},
                       {"objects", ns.object_store.objects}}},
                     {"actors", actors},
                     {"error", ns.error}});
  }
  json out = {{"head_address", status.head_address}, {"head_id", status.head_id}, {"nodes", nodes}};
  return out.dump(2) + "\n";
}

void add_head_options(CLI::App* cmd, std::string& address, std::string& temp_dir,
                      std::string& token_file) {
  cmd->add_option("--address", address,
                  "Head HOST:PORT (default: $TESSERA_ADDRESS, else this machine's cluster)")
      ->envname("TESSERA_ADDRESS");
  cmd->add_option("--temp-dir", temp_dir, "The root the head was started with");
  cmd->add_option("--cluster-token-file", token_file,
                  "The cluster token (default: $TESSERA_CLUSTER_TOKEN or this machine's)");
}

CLI::App* add_status_subcommand(CLI::App& app, StatusOptions& options) {
  auto* status_cmd = app.add_subcommand("status", "Show the cluster: nodes, GPUs, actors");
  add_head_options(status_cmd, options.address, options.temp_dir, options.cluster_token_file);
  status_cmd->add_flag("--json", options.json, "Print JSON");
  add_examples(status_cmd, {"tessera status", "tessera status --address 10.0.0.1:6380 --json"});
  return status_cmd;
}

Expected<HeadTarget> find_head(const std::string& address_flag, const std::string& temp_dir,
                               const std::string& token_file) {
  auto root = find_cluster_root(temp_dir);
  HeadTarget target{address_flag, ""};
  if (target.address.empty()) {
    auto found = root ? read_head_address(*root) : Expected<std::string>(root.status());
    if (!found) return found.status();
    target.address = *found;
  }
  auto token = auth::resolve_cluster_token(token_file, root ? *root : std::string());
  if (!token) return token.status();
  target.token = *token;
  return target;
}

int status_command(const StatusOptions& options) {
  const std::string& address_flag = options.address;
  auto head = find_head(address_flag, options.temp_dir, options.cluster_token_file);
  if (!head) {
    std::cerr << "tessera status: " << head.status().message() << "\n";
    const char* env = std::getenv("TESSERA_ADDRESS");
    if (address_flag.empty() || env == nullptr || address_flag != env) return 1;
    // Given an address, only the token can be missing. The address came from the environment:
    // after `tessera stop` it names a cluster that is gone, the likelier reason than a token
    // missing for a live one.
    std::cerr << "  (the address " << address_flag
              << " comes from $TESSERA_ADDRESS: if that cluster "
              << "was stopped, unset TESSERA_ADDRESS or start one with `tessera start --head`)\n";
    return 1;
  }
  EventLoop loop;
  auto status = collect_status(loop, head->address, head->token);
  if (!status) {
    std::cerr << "tessera status: " << status.status().message() << "\n";
    return 1;
  }
  std::cout << (options.json ? render_status_json(*status) : render_status(*status));
  return 0;
}

}  // namespace tessera
