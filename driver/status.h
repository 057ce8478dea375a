// `tessera status`: what a cluster has and runs, gathered through its head.
#pragma once

#include <string>
#include <vector>

#include "driver/client.h"

namespace CLI {
class App;
}

namespace tessera {

struct NodeStatus {
  NodeView node;
  std::vector<ActorView> actors;  // live and recently dead
  ObjectStoreView object_store;
  std::string error;  // why actors/object store could not be read, else empty
};

struct ClusterStatus {
  std::string head_address;
  std::string head_id;
  std::vector<NodeStatus> nodes;  // head first; dead nodes last
};

// The head a cluster command (status, drain) talks to and the token it proves: --address, else
// the head recorded in this machine's cluster root (--temp-dir); --cluster-token-file, else
// $TESSERA_CLUSTER_TOKEN or the root's token. Errors say which of the two is missing.
struct HeadTarget {
  std::string address;
  std::string token;
};
Expected<HeadTarget> find_head(const std::string& address_flag, const std::string& temp_dir,
                               const std::string& token_file);
// The three flags find_head reads, as every cluster command (status, topo, plan, drain) takes
// them: --address (or $TESSERA_ADDRESS), --temp-dir, --cluster-token-file.
void add_head_options(CLI::App* cmd, std::string& address, std::string& temp_dir,
                      std::string& token_file);

// Asks the head for its members and each live member for its actors and shared memory.
Expected<ClusterStatus> collect_status(EventLoop& loop, const std::string& head_address,
                                       const std::string& token);

// Human-readable report: nodes, GPUs with memory, the GPU link matrix, actors.
std::string render_status(const ClusterStatus& status);
// The same as JSON (for scripts and tests).
std::string render_status_json(const ClusterStatus& status);

// `tessera status [--address HEAD:PORT] [--json]`.
struct StatusOptions {
  std::string address;             // head HOST:PORT; "" = the head started on this machine
  std::string temp_dir;            // the root it was started with
  std::string cluster_token_file;  // else $TESSERA_CLUSTER_TOKEN or this machine's
  bool json = false;
};

// Adds `status` to `app` with its flags bound to `options` (--address defaults to
// $TESSERA_ADDRESS). The caller runs status_command when the subcommand was parsed.
CLI::App* add_status_subcommand(CLI::App& app, StatusOptions& options);

// Prints the report (render_status, or render_status_json with --json) to stdout; returns the
// exit code (0 ok, 1 failed: the reason on stderr prefixed "tessera status: ").
int status_command(const StatusOptions& options);

}  // namespace tessera
