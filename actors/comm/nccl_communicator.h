// Communicators over NCCL for the cuda backend (built with CUDA only): device buffers,
// stream-ordered, capturable in CUDA graphs. Rank 0 makes the unique id; the driver hands it to
// every rank over RPC. Initialisation is non-blocking with a deadline, so a rank that never
// joins fails the others' start-up in bounded time instead of hanging them.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/comm/communicator.h"
#include "common/status.h"

namespace tessera::comm {

// A fresh ncclUniqueId as bytes (rank 0 calls it).
Expected<std::string> make_nccl_id();

// Joins the NCCL communicator of `peers.size()` ranks as `rank`, bounded by `timeout`; on
// timeout or error every rank's message names the ranks (actor, node, GPU) it was waiting with.
Expected<std::unique_ptr<Communicator>> nccl_join(const std::string& id, int rank,
                                                  std::vector<RankInfo> peers,
                                                  std::chrono::milliseconds timeout);

// The group of `world`'s ranks with the same `color`, ordered by `key` (ncclCommSplit). Every
// rank of `world` calls it (collectively). `world` must be an NCCL communicator.
Expected<std::unique_ptr<Communicator>> nccl_split(Communicator& world, int color, int key,
                                                   std::vector<RankInfo> members,
                                                   std::chrono::milliseconds timeout);

}  // namespace tessera::comm
