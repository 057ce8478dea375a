// How an actor loads its share of a model, and what it reports back: one type each, from the
// driver to the actor's runner (protocol/convert.h carries them over the wire). The engine's
// configuration is the resolved EngineSpec (common/engine_spec.h); what is added here is this
// rank's own: its place in the group, its collectives, its rings.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/checkpoint/layer_plan.h"
#include "common/engine_spec.h"
#include "common/rank_info.h"

namespace tessera {

// How the ranks of a group talk: kNone (one rank, nothing to talk about), kTcp (the cpu
// backend), kNccl or kIpc (the cuda backend: NCCL across GPUs; the custom all-reduce through
// CUDA-IPC buffers on one node, which also lets two ranks share one GPU). The driver picks it
// from --collectives (common/engine_spec.h's Collectives) and the placement.
enum class CommBackend : uint8_t { kNone, kTcp, kNccl, kIpc };

// "tcp", "nccl", "ipc" (as --collectives and the actors' prepareComm name them); "" for kNone.
constexpr const char* comm_backend_name(CommBackend backend) {
  switch (backend) {
    case CommBackend::kTcp:
      return "tcp";
    case CommBackend::kNccl:
      return "nccl";
    case CommBackend::kIpc:
      return "ipc";
    case CommBackend::kNone:
      break;
  }
  return "";
}

// What a rank needs to join its groups' collectives. A rank that has not joined within its
// LoadSpec's engine.nccl_init_timeout_s (--nccl-init-timeout, for every backend) fails start-up.
struct CommSpec {
  CommBackend backend = CommBackend::kNone;
  std::vector<RankInfo> ranks;           // by world rank
  std::string secret;                    // authenticates the ranks' connections (tcp)
  std::string nccl_id;                   // ncclUniqueId bytes made by rank 0 (nccl)
  std::vector<std::string> ipc_handles;  // every rank's CUDA-IPC buffers, by world rank (ipc;
                                         // nccl with the custom all-reduce)
  // nccl: a tensor-parallel all-reduce of at most this many bytes goes through the custom
  // all-reduce over the IPC buffers, larger ones through NCCL (0: NCCL only).
  uint64_t custom_all_reduce_max_bytes = 0;
};

struct LoadSpec {
  EngineSpec engine;  // resolved (check_resolved): the model, dtype, device, lengths, memory
  // Ranks of the group on this rank's GPU (two when --collectives ipc puts two on one GPU): they
  // split engine.gpu_memory_utilization of it between them.
  int gpu_shares = 1;
  int threads = 0;  // cpu backend threads (0 = hardware concurrency)
  ParallelConfig parallel;
  CommSpec comm;
  // Steps arrive through the node's shared-memory ring when set (local actors), over RPC
  // otherwise.
  std::string step_ring;  // segment name of the driver's step ring
  uint32_t step_ring_reader = 0;
  std::string output_ring;  // segment name of this actor's output ring (it writes)
};

// The LoadSpec of one rank loaded outside a worker group (tests, tools): `engine` resolved for
// `parallel` (the group's tp x pp and this rank's place, even stages unless its layer_partition
// says otherwise) on `device`, reading the model's config.json. A worker group's ranks get theirs
// from the driver's planner instead.
Expected<LoadSpec> load_spec_for_rank(EngineSpec engine, const ParallelConfig& parallel,
                                      Device device);

// What a rank reports after loading (kv_blocks: how many fit) and after its cache is allocated.
struct ModelInfo {
  std::string architecture;
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t layer_begin = 0;  // this rank's layers
  int64_t layer_end = 0;
  int64_t kv_blocks = 0;
  int64_t block_size = 0;
  int64_t max_model_len = 0;
  int64_t max_num_seqs = 0;
  int64_t max_num_batched_tokens = 0;  // the largest step the actor takes (the scheduler's budget)
  uint64_t weight_bytes = 0;           // this rank's
  uint64_t kv_cache_bytes = 0;
  std::string backend;         // "cpu" | "cuda"
  std::string dtype;           // what the model computes in: "BF16", "F16", "F32"
  std::string kv_cache_dtype;  // what its KV cache stores: the dtype's name, or "F8_E4M3"
  std::string quantization;    // its linear layers: "none" or QuantConfig::describe()
  std::string device_name;     // "NVIDIA H200"; empty on the cpu backend
};

}  // namespace tessera
