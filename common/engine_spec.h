// The engine's configuration: one type from the flag (or, later, a Python keyword) to the GPU.
//
// EngineSpec holds what the user asked for, under vLLM's names; each default is written here,
// once, as the member's initializer. Its life has two states:
//   - as given: the CLI binds its flags straight into it (the parallel sizes are parsed at the
//     flag into ParallelSize), and validate() checks every bound that needs no model, in one
//     place;
//   - resolved: the driver's planner (driver/plan) calls resolve_engine_spec() once with the
//     model and the plan it chose, which fills in everything "auto" or 0 meant: the dtype, the
//     device, the parallel sizes and layer partition, max_model_len and max_num_batched_tokens.
// The actors receive the resolved spec in their LoadSpec (common/load_spec.h, sent as
// protocol/step.capnp's EngineSpec) and only check that it is one (check_resolved); the driver's
// scheduler sizes itself from what the actors report (ModelInfo), not from a second copy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/checkpoint/quantization.h"
#include "common/kv_cache_dtype.h"
#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

struct ModelConfig;
struct ParallelConfig;

// --device: where the ranks run. A resolved spec holds kCuda or kCpu.
enum class Device : uint8_t { kAuto, kCuda, kCpu };
// "auto" | "cuda" | "cpu"; anything else is INVALID_ARGUMENT naming the flag and the choices.
Expected<Device> parse_device(std::string_view text);
const char* device_name(Device device);

// --collectives: how the ranks of a group talk. kAuto: tcp for CPU ranks, ipc when two ranks
// share a GPU, nccl otherwise (the driver picks it from the placement).
enum class Collectives : uint8_t { kAuto, kTcp, kNccl, kIpc };
Expected<Collectives> parse_collectives(std::string_view text);
const char* collectives_name(Collectives collectives);

// --load-format (vLLM's): kAuto reads the checkpoint's safetensors; kDummy initialises every
// weight randomly on the GPU from config.json alone (no tensor read from disk), to measure a
// real shape that no disk here holds. Dummy runs unquantized on the CUDA backend.
enum class LoadFormat : uint8_t { kAuto, kDummy };
Expected<LoadFormat> parse_load_format(std::string_view text);  // "auto" | "dummy"
const char* load_format_name(LoadFormat format);

// -tp / -pp as given: a number of ranks, or auto (the planner picks the fewest that fit).
struct ParallelSize {
  int64_t ranks = 1;  // 0 = auto

  static ParallelSize automatic() { return ParallelSize{0}; }
  bool is_auto() const { return ranks == 0; }
  // "auto" or 1..kMaxParallelSize; INVALID_ARGUMENT naming `flag` and the text otherwise.
  static Expected<ParallelSize> parse(std::string_view text, std::string_view flag);
  std::string to_string() const;  // "auto" or the number
  friend bool operator==(const ParallelSize&, const ParallelSize&) = default;
};

inline constexpr int64_t kMaxParallelSize = 1024;

// --pipeline-layer-partition "10,12,10": layers per stage, each >= 1; INVALID_ARGUMENT quoting
// the text and the bad entry.
Expected<std::vector<int64_t>> parse_layer_partition(std::string_view text);
inline constexpr int64_t kMaxNumSeqsLimit = 65536;
inline constexpr int64_t kMinBatchedTokens = 16;
// --max-num-batched-tokens 0 (the default) resolves to the context length, within these.
inline constexpr int64_t kDefaultBatchedTokensFloor = 2048;
inline constexpr int64_t kDefaultBatchedTokensCeiling = 16384;

struct EngineSpec {
  // ---- the model
  std::string model;            // --model: a Hugging Face model directory
  std::string dtype = "auto";   // --dtype: auto | bfloat16 | float16 | half | float32 | float;
                                // resolved: bfloat16 | float16 | float32
  Device device = Device::kAuto;  // --device
  // --quantization; kAuto: the checkpoint's quantization_config. Resolved: kNone, kAwq, kGptq
  // or kFp8 (resolve_quantization with the checkpoint's gives the whole QuantConfig).
  QuantMethod quantization = QuantMethod::kAuto;
  LoadFormat load_format = LoadFormat::kAuto;  // --load-format

  // ---- parallelism
  ParallelSize tensor_parallel_size;  // -tp, --tensor-parallel-size
  // -pp, --pipeline-parallel-size; unset: the partition's number of stages, or 1.
  std::optional<ParallelSize> pipeline_parallel_size;
  std::vector<int64_t> pipeline_layer_partition;  // layers per stage; empty = even
  // --enable-expert-parallel: whole experts per tensor-parallel rank, tokens sent to them by
  // all-to-all (ParallelConfig::expert_parallel); off: every expert split over the ranks.
  bool enable_expert_parallel = false;

  // ---- memory and batching
  int64_t max_model_len = 0;  // 0 = the model's max_position_embeddings
  double gpu_memory_utilization = 0.9;  // of each GPU, whoever shares it (see LoadSpec)
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 0;  // 0 = resolve_max_num_batched_tokens(0, max_model_len)
  int64_t block_size = 16;             // tokens per KV cache block
  // vLLM's --num-gpu-blocks-override: at most this many KV blocks (0 = what the memory holds);
  // caps the cache to study eviction and routing (the memory figures still size the rest).
  int64_t num_gpu_blocks_override = 0;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  bool enforce_eager = false;  // no CUDA graphs

  // ---- scheduling
  bool enable_prefix_caching = true;
  bool async_scheduling = false;  // pipeline parallel size 1

  // ---- how the ranks talk
  Collectives collectives = Collectives::kAuto;
  bool disable_custom_all_reduce = false;  // nccl: NCCL for every all-reduce
  uint32_t nccl_init_timeout_s = 120;      // every rank joins the collectives within this

  // ---- tests
  bool return_logits = false;  // steps hand back the sampled rows' logits

  // Set by resolve_engine_spec only: every value above is concrete.
  bool resolved = false;

  // The parallel sizes (resolved; as given otherwise, 0 for auto).
  int64_t tp() const { return tensor_parallel_size.ranks; }
  int64_t pp() const;
  // The rank layout the spec asks for: tp() x pp(), the partition and expert parallelism, for
  // rank (0, 0) (the sizes 0 where still auto). The one place a ParallelConfig is made from it.
  ParallelConfig shape() const;

  friend bool operator==(const EngineSpec&, const EngineSpec&) = default;
};

// OK when the values make sense before any model is read; INVALID_ARGUMENT naming the flag and
// the value otherwise. Every bound of the spec is here.
Status validate(const EngineSpec& spec);

// The spec with everything made concrete, for `config` run as the planner chose: `tp` x `pp`
// ranks, `stage_layers` layers per stage, on `device` (kCuda or kCpu). Resolves dtype (auto:
// the checkpoint's; a float32 checkpoint runs in bfloat16 on the GPU), max_model_len (the
// model's when 0; no more than max_position_embeddings) and max_num_batched_tokens. Errors
// name the flag.
Expected<EngineSpec> resolve_engine_spec(EngineSpec spec, const ModelConfig& config,
                                         int64_t tp, int64_t pp,
                                         std::vector<int64_t> stage_layers, Device device);

// The spec with its lengths made concrete for `config` (max_model_len, max_num_batched_tokens;
// resolve_engine_spec's first half): what the planner sizes memory with before it has chosen
// the parallel sizes.
Expected<EngineSpec> resolve_lengths(EngineSpec spec, const ModelConfig& config);

// What the actor checks of the spec it is given: resolved, and within validate()'s bounds.
Status check_resolved(const EngineSpec& spec);

// The dtype a resolved spec runs in (kBF16, kF16 or kF32).
DType run_dtype(const EngineSpec& spec);

// The spec's --max-model-len for `config` (0 = max_position_embeddings), INVALID_ARGUMENT past
// it (a sliding window shorter than the context is fine: ModelConfig::attention_window); and its
// step budget: `requested`, or when it is 0 the `tokens` a step should hold (the context
// length), raised to kDefaultBatchedTokensFloor and capped at kDefaultBatchedTokensCeiling.
Expected<int64_t> resolve_max_model_len(int64_t requested, const ModelConfig& config);
int64_t resolve_max_num_batched_tokens(int64_t requested, int64_t tokens);

}  // namespace tessera
