// `tessera status`: what a cluster has and runs, gathered through its head.
#pragma once

#include <string>
#include <vector>

#include "driver/client.h"

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

// Asks the head for its members and each live member for its actors and shared memory.
Expected<ClusterStatus> collect_status(EventLoop& loop, const std::string& head_address,
                                       const std::string& token);

// Human-readable report: nodes, GPUs with memory, the GPU link matrix, actors.
std::string render_status(const ClusterStatus& status);
// The same as JSON (for scripts and tests).
std::string render_status_json(const ClusterStatus& status);

}  // namespace tessera
