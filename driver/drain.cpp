#include "driver/drain.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <set>

#include "driver/cli/cli_help.h"
#include "driver/status.h"

namespace tessera {

namespace {

// "node-b": the name `tessera status` prints, or the id when the node has none.
std::string name_of(const NodeView& n) { return n.name.empty() ? n.node_id : n.name; }

std::string still_run(size_t actors) {
  return actors == 1 ? "1 actor still runs on it"
                     : std::to_string(actors) + " actors still run on it";
}

// "serve-1f2e, bench": the owners (lease names) of `actors`, each once.
std::string owners_of(const std::vector<ActorView>& actors) {
  std::set<std::string> owners;
  for (const ActorView& a : actors) owners.insert(a.owner.empty() ? "(unnamed)" : a.owner);
  std::string out;
  for (const std::string& o : owners) out += (out.empty() ? "" : ", ") + o;
  return out;
}

// The node of this id as the head lists it now (dead ones included). One the head forgot is
// returned dead.
Expected<NodeView> listed(ClusterClient& cluster, const std::string& node_id) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<NodeView> nodes, cluster.nodes(/*include_dead=*/true));
  for (NodeView& n : nodes) {
    if (n.node_id == node_id) return std::move(n);
  }
  NodeView gone;
  gone.node_id = node_id;
  gone.death_reason = "the head no longer lists it";
  return gone;
}

}  // namespace

Expected<std::vector<ActorView>> live_actors(ClusterClient& cluster, const NodeView& node) {
  TESSERA_ASSIGN_OR_RETURN(NodeHandle handle, cluster.node(node.node_id));
  TESSERA_ASSIGN_OR_RETURN(std::vector<ActorView> actors, handle.actors());
  std::erase_if(actors, [](const ActorView& a) { return a.state == "dead"; });
  return actors;
}

Expected<NodeView> wait_drained(EventLoop& loop, ClusterClient& cluster, const std::string& node_id,
                                const DrainWait& wait) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point next_progress = start + wait.progress_every;
  for (;;) {
    TESSERA_ASSIGN_OR_RETURN(NodeView node, listed(cluster, node_id));
    if (!node.alive) return node;
    if (!node.draining) {
      return failed_precondition("node " + name_of(node) +
                                 " is no longer draining (`tessera drain --undo` ran meanwhile)");
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<ActorView> live, live_actors(cluster, node));
    if (live.empty()) return node;
    const Clock::time_point now = Clock::now();
    if (now - start >= wait.timeout) {
      return deadline_exceeded(
          "node " + name_of(node) + " still runs " + std::to_string(live.size()) + " actor" +
          (live.size() == 1 ? "" : "s") + " after " +
          std::to_string(std::chrono::duration_cast<std::chrono::seconds>(wait.timeout).count()) +
          " s (owned by " + owners_of(live) +
          "); they go when their owners let them go (a `tessera serve` moves its replicas off, "
          "other drivers end with their job); `tessera drain " +
          name_of(node) + " --wait` waits again");
    }
    if (now >= next_progress) {
      if (wait.progress) {
        wait.progress(live, std::chrono::duration_cast<std::chrono::seconds>(now - start));
      }
      next_progress += wait.progress_every;
    }
    loop.run_for(std::min(wait.poll, std::chrono::duration_cast<std::chrono::milliseconds>(
                                         start + wait.timeout - now)));
  }
}

CLI::App* add_drain_subcommand(CLI::App& app, DrainOptions& o) {
  auto* cmd = app.add_subcommand(
      "drain", "Take a node out of service: no new actors go there (`--undo` takes it back)");
  cmd->add_option("node", o.node, "The node's id or name, as `tessera status` prints them")
      ->required();
  auto* undo = cmd->add_flag("--undo", o.undo, "Clear the mark: new actors may go there again");
  cmd->add_option("--wait", o.wait_seconds,
                  "Wait until no actor runs on the node (up to SECONDS, default " +
                      std::to_string(kDrainWaitSeconds) + ")")
      ->expected(0, 1)
      ->default_str(std::to_string(kDrainWaitSeconds))
      ->type_name("[SECONDS]")
      ->check(CLI::NonNegativeNumber)
      ->excludes(undo);
  add_head_options(cmd, o.address, o.temp_dir, o.cluster_token_file);
  add_examples(cmd, {"tessera drain node-b --wait", "tessera drain node-b --undo"});
  return cmd;
}

int drain_command(const DrainOptions& o) {
  auto fail = [](const Status& st) {
    std::cerr << "tessera drain: " << st.message() << "\n";
    return 1;
  };
  auto head = find_head(o.address, o.temp_dir, o.cluster_token_file);
  if (!head) return fail(head.status());
  EventLoop loop;
  auto cluster = ClusterClient::connect(loop, head->address, head->token);
  if (!cluster) return fail(cluster.status());
  auto node = (*cluster)->drain(o.node, o.undo);
  if (!node) return fail(node.status());
  const std::string name = name_of(*node);
  // The mark is set either way; a node whose actors cannot be listed just goes uncounted.
  auto live = live_actors(**cluster, *node);
  const std::string count =
      live ? still_run(live->size())
           : "its actors could not be listed (" + live.status().message() + ")";
  std::cout << "node " << name << " (" << node->node_id << ") ";
  if (o.undo) {
    std::cout << "is no longer draining: new actors may go there again; " << count << std::endl;
    return 0;
  }
  std::cout << "is draining: no new actors go there; " << count << std::endl;
  if (o.wait_seconds < 0) return 0;

  DrainWait wait;
  wait.timeout = std::chrono::seconds(o.wait_seconds);
  wait.progress = [&](const std::vector<ActorView>& actors, std::chrono::seconds waited) {
    std::cout << "node " << name << ": " << still_run(actors.size()) << " (owned by "
              << owners_of(actors) << "), waited " << waited.count() << " s of " << o.wait_seconds
              << std::endl;
  };
  auto end = wait_drained(loop, **cluster, node->node_id, wait);
  if (!end) return fail(end.status());
  if (!end->alive) {
    std::cout << "node " << name << " left the cluster while draining ("
              << (end->death_reason.empty() ? "no reason given" : end->death_reason)
              << "): no actors left" << std::endl;
    return 0;
  }
  std::cout << "node " << name
            << " drained: no actors left; stop its daemon with `tessera stop` on that machine"
            << std::endl;
  return 0;
}

}  // namespace tessera
