#include "common/engine_spec.h"

#include <algorithm>
#include <cstdio>

#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/load_spec.h"

namespace tessera {

Expected<Device> parse_device(std::string_view text) {
  if (text == "auto") return Device::kAuto;
  if (text == "cuda") return Device::kCuda;
  if (text == "cpu") return Device::kCpu;
  return invalid_argument("--device '" + std::string(text) + "' is not one of auto, cuda, cpu");
}

const char* device_name(Device device) {
  switch (device) {
    case Device::kCuda:
      return "cuda";
    case Device::kCpu:
      return "cpu";
    case Device::kAuto:
      break;
  }
  return "auto";
}

Expected<Collectives> parse_collectives(std::string_view text) {
  if (text == "auto") return Collectives::kAuto;
  if (text == "tcp") return Collectives::kTcp;
  if (text == "nccl") return Collectives::kNccl;
  if (text == "ipc") return Collectives::kIpc;
  return invalid_argument("--collectives '" + std::string(text) +
                          "' is not one of auto, tcp, nccl, ipc");
}

const char* collectives_name(Collectives collectives) {
  switch (collectives) {
    case Collectives::kTcp:
      return "tcp";
    case Collectives::kNccl:
      return "nccl";
    case Collectives::kIpc:
      return "ipc";
    case Collectives::kAuto:
      break;
  }
  return "auto";
}

Expected<LoadFormat> parse_load_format(std::string_view text) {
  if (text == "auto") return LoadFormat::kAuto;
  if (text == "dummy") return LoadFormat::kDummy;
  return invalid_argument("--load-format '" + std::string(text) + "' is not one of auto, dummy");
}

const char* load_format_name(LoadFormat format) {
  return format == LoadFormat::kDummy ? "dummy" : "auto";
}

namespace {

// A positive decimal of at most 9 digits, or nullopt.
std::optional<int64_t> positive(std::string_view text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  int64_t v = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return std::nullopt;
    v = v * 10 + (ch - '0');
  }
  if (v < 1) return std::nullopt;
  return v;
}

std::string format_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

Expected<ParallelSize> ParallelSize::parse(std::string_view text, std::string_view flag) {
  if (text == "auto") return automatic();
  auto v = positive(text);
  if (!v) {
    return invalid_argument(std::string(flag) + " must be a positive integer or auto, got '" +
                            std::string(text) + "'");
  }
  if (*v > kMaxParallelSize) {
    return invalid_argument("-tp and -pp must be at most " + std::to_string(kMaxParallelSize) +
                            ", got " + std::to_string(*v));
  }
  return ParallelSize{*v};
}

std::string ParallelSize::to_string() const {
  return is_auto() ? "auto" : std::to_string(ranks);
}

Expected<std::vector<int64_t>> parse_layer_partition(std::string_view text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view item = text.substr(at, comma - at);
    auto n = positive(item);
    if (!n) {
      return invalid_argument("--pipeline-layer-partition '" + std::string(text) +
                              "': each entry must be a layer count >= 1, got '" +
                              std::string(item) + "'");
    }
    out.push_back(*n);
    at = comma + 1;
  }
  return out;
}

ParallelConfig EngineSpec::shape() const {
  ParallelConfig p;
  p.tp_size = static_cast<int>(tp());
  p.pp_size = static_cast<int>(pp());
  p.layer_partition = pipeline_layer_partition;
  p.expert_parallel = enable_expert_parallel;
  return p;
}

int64_t EngineSpec::pp() const {
  if (pipeline_parallel_size) return pipeline_parallel_size->ranks;
  return pipeline_layer_partition.empty() ? 1
                                          : static_cast<int64_t>(pipeline_layer_partition.size());
}

Status validate(const EngineSpec& s) {
  if (s.model.empty()) return invalid_argument("--model: give a Hugging Face model directory");
  const std::vector<std::string> dtypes = {"auto",    "bfloat16", "float16",
                                           "half",    "float32",  "float"};
  if (std::find(dtypes.begin(), dtypes.end(), s.dtype) == dtypes.end()) {
    return invalid_argument("--dtype '" + s.dtype +
                            "' is not one of auto, bfloat16, float16 (half), float32 (float)");
  }
  for (const ParallelSize* size : {&s.tensor_parallel_size, s.pipeline_parallel_size
                                                                ? &*s.pipeline_parallel_size
                                                                : nullptr}) {
    if (size != nullptr && (size->ranks < 0 || size->ranks > kMaxParallelSize)) {
      return invalid_argument("-tp and -pp must be at most " + std::to_string(kMaxParallelSize) +
                              ", got " + std::to_string(size->ranks));
    }
  }
  for (int64_t layers : s.pipeline_layer_partition) {
    if (layers < 1) {
      return invalid_argument("--pipeline-layer-partition: each entry must be a layer count >= 1");
    }
  }
  if (s.max_model_len < 0) {
    return invalid_argument("--max-model-len must be positive, got " +
                            std::to_string(s.max_model_len));
  }
  if (!(s.gpu_memory_utilization > 0.0 && s.gpu_memory_utilization <= 1.0)) {
    return invalid_argument("--gpu-memory-utilization must be in (0, 1], got " +
                            format_double(s.gpu_memory_utilization));
  }
  if (s.max_num_seqs < 1 || s.max_num_seqs > kMaxNumSeqsLimit) {
    return invalid_argument("--max-num-seqs must be between 1 and " +
                            std::to_string(kMaxNumSeqsLimit) + ", got " +
                            std::to_string(s.max_num_seqs));
  }
  if (s.max_num_batched_tokens != 0 && s.max_num_batched_tokens < kMinBatchedTokens) {
    return invalid_argument("--max-num-batched-tokens must be at least " +
                            std::to_string(kMinBatchedTokens) + " (or 0 for the default), got " +
                            std::to_string(s.max_num_batched_tokens));
  }
  // What the attention kernels take (kernels/cuda/attention.h, kernels/cpu).
  if (s.block_size < 1 || s.block_size > 256) {
    return invalid_argument("--block-size must be between 1 and 256 tokens, got " +
                            std::to_string(s.block_size));
  }
  if (s.nccl_init_timeout_s < 1) return invalid_argument("--nccl-init-timeout must be >= 1 s");
  if (s.num_gpu_blocks_override < 0) {
    return invalid_argument(
        "--num-gpu-blocks-override must be 0 (no cap) or a number of blocks, "
        "got " +
        std::to_string(s.num_gpu_blocks_override));
  }
  return Status::ok();
}

Expected<int64_t> resolve_max_model_len(int64_t requested, const ModelConfig& config) {
  if (requested > config.max_position_embeddings) {
    return invalid_argument("--max-model-len " + std::to_string(requested) +
                            " exceeds the model's max_position_embeddings (" +
                            std::to_string(config.max_position_embeddings) + ")");
  }
  return requested > 0 ? requested : config.max_position_embeddings;
}

int64_t resolve_max_num_batched_tokens(int64_t requested, int64_t tokens) {
  if (requested > 0) return requested;
  return std::min(std::max(tokens, kDefaultBatchedTokensFloor), kDefaultBatchedTokensCeiling);
}

Expected<EngineSpec> resolve_lengths(EngineSpec spec, const ModelConfig& config) {
  TESSERA_ASSIGN_OR_RETURN(spec.max_model_len, resolve_max_model_len(spec.max_model_len, config));
  spec.max_num_batched_tokens =
      resolve_max_num_batched_tokens(spec.max_num_batched_tokens, spec.max_model_len);
  // A capped cache must hold one whole sequence, unless every layer slides: then a sequence
  // holds only its window's blocks (the engine's block manager frees the rest).
  const int64_t cap = spec.num_gpu_blocks_override;
  if (cap > 0 && config.kv_cache_window() == 0 && cap * spec.block_size < spec.max_model_len) {
    return invalid_argument("--num-gpu-blocks-override " + std::to_string(cap) + " holds " +
                            std::to_string(cap * spec.block_size) +
                            " tokens, less than one sequence of --max-model-len " +
                            std::to_string(spec.max_model_len));
  }
  return spec;
}

Expected<EngineSpec> resolve_engine_spec(EngineSpec spec, const ModelConfig& config, int64_t tp,
                                         int64_t pp, std::vector<int64_t> stage_layers,
                                         Device device) {
  TESSERA_RETURN_IF_ERROR(validate(spec));
  if (device == Device::kAuto) return internal_error("resolve_engine_spec: the device is auto");
  TESSERA_ASSIGN_OR_RETURN(DType dtype,
                           resolve_dtype(spec.dtype, config.torch_dtype, device == Device::kCuda));
  spec.dtype = dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
  TESSERA_ASSIGN_OR_RETURN(QuantConfig quant,
                           resolve_quantization(spec.quantization, config.quant));
  spec.quantization = quant.method;
  spec.device = device;
  spec.tensor_parallel_size = ParallelSize{tp};
  spec.pipeline_parallel_size = ParallelSize{pp};
  spec.pipeline_layer_partition = std::move(stage_layers);
  TESSERA_ASSIGN_OR_RETURN(spec, resolve_lengths(std::move(spec), config));
  spec.resolved = true;
  return spec;
}

Status check_resolved(const EngineSpec& s) {
  if (!s.resolved || s.device == Device::kAuto || s.dtype == "auto" || s.max_model_len < 1 ||
      s.max_num_batched_tokens < 1 || s.tensor_parallel_size.is_auto() ||
      s.quantization == QuantMethod::kAuto || !s.pipeline_parallel_size ||
      s.pipeline_parallel_size->is_auto()) {
    return invalid_argument(
        "the engine spec this actor was given is not resolved (device " +
        std::string(device_name(s.device)) + ", dtype " + s.dtype + ", max_model_len " +
        std::to_string(s.max_model_len) + ", quantization " +
        quant_method_name(s.quantization) + "): the driver resolves it before it loads a model");
  }
  return validate(s);
}

Expected<LoadSpec> load_spec_for_rank(EngineSpec engine, const ParallelConfig& parallel,
                                      Device device) {
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(engine.model));
  TESSERA_ASSIGN_OR_RETURN(auto stages, stage_layers(config.num_layers, parallel.pp_size,
                                                     parallel.layer_partition));
  std::vector<int64_t> layers;
  for (const auto& [begin, end] : stages) layers.push_back(end - begin);
  LoadSpec spec;
  TESSERA_ASSIGN_OR_RETURN(spec.engine,
                           resolve_engine_spec(std::move(engine), config, parallel.tp_size,
                                               parallel.pp_size, layers, device));
  spec.parallel = parallel;
  spec.parallel.layer_partition = layers;
  spec.parallel.expert_parallel = spec.engine.enable_expert_parallel;
  return spec;
}

DType run_dtype(const EngineSpec& spec) {
  if (spec.dtype == "float16" || spec.dtype == "half") return DType::kF16;
  if (spec.dtype == "float32" || spec.dtype == "float") return DType::kF32;
  return DType::kBF16;
}

}  // namespace tessera
