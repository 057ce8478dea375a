// `tessera drain`: take a node out of service (Ray's `ray drain-node`).
//
//   tessera drain NODE [--undo] [--wait [SECONDS]] [--address HEAD:PORT]
//
// The head marks the node draining (ClusterClient::drain): `tessera status` shows it, planning
// puts no new ranks there, and the head refuses to open leases or spawn actors on it. What runs
// there keeps running until its owner lets it go (`tessera serve` moves its replicas off);
// --wait waits for that, so the node's daemon can then be stopped with nothing lost.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "driver/client.h"

namespace CLI {
class App;
}

namespace tessera {

// How long --wait waits without a value.
inline constexpr int kDrainWaitSeconds = 600;

struct DrainOptions {
  std::string node;       // a node id or name, as `tessera status` prints them
  bool undo = false;      // clear the mark instead
  int wait_seconds = -1;  // --wait [SECONDS]: wait until no actor runs there; < 0 = do not wait
  std::string address;    // head HOST:PORT; "" = the head started on this machine
  std::string temp_dir;   // the root it was started with
  std::string cluster_token_file;  // else $TESSERA_CLUSTER_TOKEN or this machine's
};

// The node's actors that have not died, as its daemon lists them.
Expected<std::vector<ActorView>> live_actors(ClusterClient& cluster, const NodeView& node);

// Runs the loop until no live actor is left on the draining node `node_id`, polling every
// `poll`; calls `progress` with the live actors every `progress_every` while some run.
// Returns the node as last listed: alive with no actor left, or dead (it left the cluster, and
// its actors with it). DEADLINE_EXCEEDED naming the node, how many actors still run and their
// owners after `timeout`; FAILED_PRECONDITION when the node stops draining meanwhile
// (`tessera drain --undo`).
struct DrainWait {
  std::chrono::milliseconds timeout{kDrainWaitSeconds * 1000};
  std::chrono::milliseconds poll{500};
  std::chrono::milliseconds progress_every{5000};
  std::function<void(const std::vector<ActorView>& live, std::chrono::seconds waited)> progress;
};
Expected<NodeView> wait_drained(EventLoop& loop, ClusterClient& cluster, const std::string& node_id,
                                const DrainWait& wait);

// Adds `drain` to `app` with its flags bound to `options` (--address defaults to
// $TESSERA_ADDRESS). The caller runs drain_command when the subcommand was parsed.
CLI::App* add_drain_subcommand(CLI::App& app, DrainOptions& options);

// Marks (or unmarks) the node and prints one line saying so and how many actors still run there;
// with --wait, a progress line every 5 s and one line once it is drained. Returns the exit code:
// 0 done, 1 failed (unknown node, no head, timed out: the reason on stderr prefixed
// "tessera drain: ").
int drain_command(const DrainOptions& options);

}  // namespace tessera
