// `tessera doctor`'s collective check: all-reduces of a known pattern through a joined group,
// timed, and their result checked on every rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "actors/comm/communicator.h"
#include "common/status.h"

namespace tessera::comm {

struct CommCheckResult {
  uint64_t bytes = 0;     // per all-reduce
  int iterations = 0;     // timed (after one warm-up)
  double median_us = 0;   // one all-reduce, as this rank saw it
  double busbw_gbps = 0;  // nccl-tests' bus bandwidth: bytes * 2 (n - 1) / n / time
};

// Runs `iterations` + 1 all-reduces of `bytes` (fp32, at least one element) through `group`:
// rank r contributes r + 1 + i % 7 at element i, so every element's sum is known. `device`:
// the buffer lives on the current CUDA device and the work is ordered on a stream of its own
// (nccl, ipc); else host memory (tcp). DATA_LOSS naming the first wrong element when any sum
// is off; the communicator's error (naming the peer) when one fails.
Expected<CommCheckResult> run_comm_check(Communicator& group, uint64_t bytes, int iterations,
                                         bool device);

// One ordered pair of the P2P check.
struct P2pCopy {
  int src = 0, dst = 0;      // CUDA ordinals in this process
  bool peer_access = false;  // cudaDeviceCanAccessPeer: copies go directly, not through host
  bool ok = false;           // the copy arrived intact
  double gbps = 0;           // cudaMemcpyPeerAsync's bandwidth over the timed copies
  std::string error;         // why not ok
};

// `tessera doctor`'s P2P check in an actor that sees several GPUs: for every ordered pair, the
// peer access CUDA advertises, then `bytes` copied with cudaMemcpyPeerAsync (one warm-up, five
// timed) and read back against the pattern written. A pair whose copy is wrong or fails is
// reported (ok = false), not returned as an error. FAILED_PRECONDITION without CUDA or with
// fewer than two devices.
Expected<std::vector<P2pCopy>> run_p2p_check(uint64_t bytes);

}  // namespace tessera::comm
