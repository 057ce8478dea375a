// Where one rank of a worker group runs: its node and GPU as the driver placed it and, once it is
// started, its actor and collective endpoint. One type from the worker group's placement
// (driver/worker_group.h) through the LoadSpec's CommSpec to every Communicator's peers, whose
// error messages name it (comm::describe_peer).
#pragma once

#include <string>

namespace tessera {

struct RankInfo {
  // The world rank (pp_rank * tp_size + tp_rank); in a Communicator's peers, the rank in that
  // group.
  int rank = 0;
  std::string actor_id;  // empty until its actor is started
  std::string node_id;
  int gpu = -1;         // node GPU index; -1 for a CPU actor
  std::string address;  // its collective endpoint ("10.0.0.2:41022"), when it has one
};

}  // namespace tessera
