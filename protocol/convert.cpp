#include "protocol/convert.h"

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>
#include <string>

namespace tessera {

namespace {

kj::ArrayPtr<const kj::byte> bytes_of(const std::string& s) {
  return kj::arrayPtr(reinterpret_cast<const kj::byte*>(s.data()), s.size());
}

std::string string_of(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
}

template <typename T, typename List>
void fill_list(const std::vector<T>& in, List out) {
  for (size_t i = 0; i < in.size(); ++i) out.set(static_cast<unsigned>(i), in[i]);
}

template <typename T, typename List>
std::vector<T> read_list(List in) {
  std::vector<T> out;
  out.reserve(in.size());
  for (auto v : in) out.push_back(static_cast<T>(v));
  return out;
}

}  // namespace

void to_proto(const SamplingParams& in, proto::SamplingParams::Builder out) {
  out.setTemperature(in.temperature);
  out.setTopP(in.top_p);
  out.setTopK(in.top_k);
  out.setMinP(in.min_p);
  out.setHasSeed(in.seed.has_value());
  out.setSeed(in.seed.value_or(0));
  out.setRepetitionPenalty(in.repetition_penalty);
  out.setPresencePenalty(in.presence_penalty);
  out.setFrequencyPenalty(in.frequency_penalty);
  out.setLogprobs(in.logprobs);
  out.setMaxTokens(in.max_tokens);
  out.setIgnoreEos(in.ignore_eos);
  fill_list(in.stop_token_ids,
            out.initStopTokenIds(static_cast<unsigned>(in.stop_token_ids.size())));
  auto stop = out.initStop(static_cast<unsigned>(in.stop.size()));
  for (size_t i = 0; i < in.stop.size(); ++i) stop.set(static_cast<unsigned>(i), in.stop[i]);
  out.setSkipSpecialTokens(in.skip_special_tokens);
}

SamplingParams from_proto(proto::SamplingParams::Reader in) {
  SamplingParams s;
  s.temperature = in.getTemperature();
  s.top_p = in.getTopP();
  s.top_k = in.getTopK();
  s.min_p = in.getMinP();
  if (in.getHasSeed()) s.seed = in.getSeed();
  s.repetition_penalty = in.getRepetitionPenalty();
  s.presence_penalty = in.getPresencePenalty();
  s.frequency_penalty = in.getFrequencyPenalty();
  s.logprobs = in.getLogprobs();
  s.max_tokens = in.getMaxTokens();
  s.ignore_eos = in.getIgnoreEos();
  s.stop_token_ids = read_list<int32_t>(in.getStopTokenIds());
  for (auto t : in.getStop()) s.stop.emplace_back(t.cStr());
  s.skip_special_tokens = in.getSkipSpecialTokens();
  return s;
}

void to_proto(const StepInput& in, proto::StepInput::Builder out) {
  out.setStepId(in.step_id);
  auto seqs = out.initSeqs(static_cast<unsigned>(in.seqs.size()));
  for (size_t i = 0; i < in.seqs.size(); ++i) {
    const SeqStep& s = in.seqs[i];
    auto b = seqs[static_cast<unsigned>(i)];
    b.setRequestId(s.request_id);
    fill_list(s.tokens, b.initTokens(static_cast<unsigned>(s.tokens.size())));
    b.setStartPosition(s.start_position);
    fill_list(s.new_blocks, b.initNewBlocks(static_cast<unsigned>(s.new_blocks.size())));
    b.setSample(s.sample);
    b.setFirst(s.first);
    if (s.first) {
      b.setPromptLen(s.prompt_len);
      to_proto(s.sampling, b.initSampling());
      fill_list(s.prefix_tokens, b.initPrefixTokens(static_cast<unsigned>(s.prefix_tokens.size())));
    }
  }
  fill_list(in.finished, out.initFinished(static_cast<unsigned>(in.finished.size())));
}

StepInput from_proto(proto::StepInput::Reader in) {
  StepInput step;
  step.step_id = in.getStepId();
  auto seqs = in.getSeqs();
  step.seqs.reserve(seqs.size());
  for (auto b : seqs) {
    SeqStep s;
    s.request_id = b.getRequestId();
    s.tokens = read_list<int32_t>(b.getTokens());
    s.start_position = b.getStartPosition();
    s.new_blocks = read_list<uint32_t>(b.getNewBlocks());
    s.sample = b.getSample();
    s.first = b.getFirst();
    if (s.first) {
      s.prompt_len = b.getPromptLen();
      s.sampling = from_proto(b.getSampling());
      s.prefix_tokens = read_list<int32_t>(b.getPrefixTokens());
    }
    step.seqs.push_back(std::move(s));
  }
  step.finished = read_list<uint64_t>(in.getFinished());
  return step;
}

void to_proto(const StepOutput& in, proto::StepOutput::Builder out) {
  out.setStepId(in.step_id);
  auto list = out.initOutputs(static_cast<unsigned>(in.outputs.size()));
  for (size_t i = 0; i < in.outputs.size(); ++i) {
    const SeqOutput& o = in.outputs[i];
    auto b = list[static_cast<unsigned>(i)];
    b.setRequestId(o.request_id);
    b.setToken(o.sample.token);
    b.setLogprob(o.sample.logprob);
    auto top = b.initTop(static_cast<unsigned>(o.sample.top_logprobs.size()));
    for (size_t j = 0; j < o.sample.top_logprobs.size(); ++j) {
      top[static_cast<unsigned>(j)].setToken(o.sample.top_logprobs[j].first);
      top[static_cast<unsigned>(j)].setLogprob(o.sample.top_logprobs[j].second);
    }
  }
  fill_list(in.logits, out.initLogits(static_cast<unsigned>(in.logits.size())));
  out.setActorMicros(in.actor_micros);
  out.setGpuMicros(in.gpu_micros);
  out.setError(in.error);
}

StepOutput from_proto(proto::StepOutput::Reader in) {
  StepOutput out;
  out.step_id = in.getStepId();
  out.outputs.reserve(in.getOutputs().size());
  for (auto b : in.getOutputs()) {
    SeqOutput o;
    o.request_id = b.getRequestId();
    o.sample.token = b.getToken();
    o.sample.logprob = b.getLogprob();
    for (auto t : b.getTop()) o.sample.top_logprobs.emplace_back(t.getToken(), t.getLogprob());
    out.outputs.push_back(std::move(o));
  }
  out.logits = read_list<float>(in.getLogits());
  out.actor_micros = in.getActorMicros();
  out.gpu_micros = in.getGpuMicros();
  out.error = in.getError().cStr();
  return out;
}

void to_proto(const RankInfo& in, proto::RankInfo::Builder out) {
  out.setRank(in.rank);
  out.setActorId(in.actor_id);
  out.setNodeId(in.node_id);
  out.setGpu(in.gpu);
  out.setAddress(in.address);
}

RankInfo from_proto(proto::RankInfo::Reader in) {
  RankInfo r;
  r.rank = in.getRank();
  r.actor_id = in.getActorId().cStr();
  r.node_id = in.getNodeId().cStr();
  r.gpu = in.getGpu();
  r.address = in.getAddress().cStr();
  return r;
}

// The wire's enums follow common/engine_spec.h's, common/kv_cache_dtype.h's and
// common/load_spec.h's order.
static_assert(static_cast<int>(proto::EngineSpec::Device::CPU) == static_cast<int>(Device::kCpu));
static_assert(static_cast<int>(proto::EngineSpec::Device::CUDA) == static_cast<int>(Device::kCuda));
static_assert(static_cast<int>(proto::EngineSpec::Collectives::IPC) ==
              static_cast<int>(Collectives::kIpc));
static_assert(static_cast<int>(proto::EngineSpec::Collectives::NCCL) ==
              static_cast<int>(Collectives::kNccl));
static_assert(static_cast<int>(proto::EngineSpec::KvCacheDtype::FP8_E4M3) ==
              static_cast<int>(KvCacheDtype::kFp8E4M3));
static_assert(static_cast<int>(proto::EngineSpec::Quantization::NONE) ==
              static_cast<int>(QuantMethod::kNone));
static_assert(static_cast<int>(proto::EngineSpec::Quantization::FP8) ==
              static_cast<int>(QuantMethod::kFp8));
static_assert(static_cast<int>(proto::CommSpec::Backend::NONE) ==
              static_cast<int>(CommBackend::kNone));
static_assert(static_cast<int>(proto::CommSpec::Backend::TCP) ==
              static_cast<int>(CommBackend::kTcp));
static_assert(static_cast<int>(proto::CommSpec::Backend::NCCL) ==
              static_cast<int>(CommBackend::kNccl));
static_assert(static_cast<int>(proto::CommSpec::Backend::IPC) ==
              static_cast<int>(CommBackend::kIpc));

void to_proto(const EngineSpec& in, proto::EngineSpec::Builder out) {
  out.setModel(in.model);
  out.setDtype(in.dtype);
  out.setDevice(static_cast<proto::EngineSpec::Device>(in.device));
  out.setTensorParallelSize(in.tensor_parallel_size.ranks);
  out.setPipelineParallelSize(in.pipeline_parallel_size ? in.pipeline_parallel_size->ranks : -1);
  fill_list(in.pipeline_layer_partition,
            out.initPipelineLayerPartition(
                static_cast<unsigned>(in.pipeline_layer_partition.size())));
  out.setMaxModelLen(in.max_model_len);
  out.setGpuMemoryUtilization(in.gpu_memory_utilization);
  out.setMaxNumSeqs(in.max_num_seqs);
  out.setMaxNumBatchedTokens(in.max_num_batched_tokens);
  out.setBlockSize(in.block_size);
  out.setNumGpuBlocksOverride(in.num_gpu_blocks_override);
  out.setKvCacheDtype(static_cast<proto::EngineSpec::KvCacheDtype>(in.kv_cache_dtype));
  out.setEnforceEager(in.enforce_eager);
  out.setLoadFormat(static_cast<proto::EngineSpec::LoadFormat>(in.load_format));
  out.setEnableExpertParallel(in.enable_expert_parallel);
  out.setEnablePrefixCaching(in.enable_prefix_caching);
  out.setAsyncScheduling(in.async_scheduling);
  out.setCollectives(static_cast<proto::EngineSpec::Collectives>(in.collectives));
  out.setDisableCustomAllReduce(in.disable_custom_all_reduce);
  out.setNcclInitTimeoutS(in.nccl_init_timeout_s);
  out.setReturnLogits(in.return_logits);
  out.setResolved(in.resolved);
  out.setQuantization(static_cast<proto::EngineSpec::Quantization>(in.quantization));
}

EngineSpec from_proto(proto::EngineSpec::Reader in) {
  EngineSpec s;
  s.model = in.getModel().cStr();
  s.dtype = in.getDtype().cStr();
  s.device = static_cast<Device>(in.getDevice());
  s.tensor_parallel_size = ParallelSize{in.getTensorParallelSize()};
  if (in.getPipelineParallelSize() >= 0) {
    s.pipeline_parallel_size = ParallelSize{in.getPipelineParallelSize()};
  }
  s.pipeline_layer_partition = read_list<int64_t>(in.getPipelineLayerPartition());
  s.max_model_len = in.getMaxModelLen();
  s.gpu_memory_utilization = in.getGpuMemoryUtilization();
  s.max_num_seqs = in.getMaxNumSeqs();
  s.max_num_batched_tokens = in.getMaxNumBatchedTokens();
  s.block_size = in.getBlockSize();
  s.num_gpu_blocks_override = in.getNumGpuBlocksOverride();
  s.kv_cache_dtype = static_cast<KvCacheDtype>(in.getKvCacheDtype());
  s.enforce_eager = in.getEnforceEager();
  s.load_format = static_cast<LoadFormat>(in.getLoadFormat());
  s.enable_expert_parallel = in.getEnableExpertParallel();
  s.enable_prefix_caching = in.getEnablePrefixCaching();
  s.async_scheduling = in.getAsyncScheduling();
  s.collectives = static_cast<Collectives>(in.getCollectives());
  s.disable_custom_all_reduce = in.getDisableCustomAllReduce();
  s.nccl_init_timeout_s = in.getNcclInitTimeoutS();
  s.return_logits = in.getReturnLogits();
  s.resolved = in.getResolved();
  s.quantization = static_cast<QuantMethod>(in.getQuantization());
  return s;
}

void to_proto(const LoadSpec& in, proto::LoadSpec::Builder out) {
  to_proto(in.engine, out.initEngine());
  out.setGpuShares(in.gpu_shares);
  out.setThreads(in.threads);
  auto p = out.initParallel();
  p.setTpSize(in.parallel.tp_size);
  p.setPpSize(in.parallel.pp_size);
  p.setTpRank(in.parallel.tp_rank);
  p.setPpRank(in.parallel.pp_rank);
  p.setExpertParallel(in.parallel.expert_parallel);
  fill_list(in.parallel.layer_partition,
            p.initLayerPartition(static_cast<unsigned>(in.parallel.layer_partition.size())));
  auto c = out.initComm();
  c.setBackend(static_cast<proto::CommSpec::Backend>(in.comm.backend));
  auto ranks = c.initRanks(static_cast<unsigned>(in.comm.ranks.size()));
  for (size_t i = 0; i < in.comm.ranks.size(); ++i) {
    to_proto(in.comm.ranks[i], ranks[static_cast<unsigned>(i)]);
  }
  c.setSecret(bytes_of(in.comm.secret));
  c.setNcclId(bytes_of(in.comm.nccl_id));
  c.setCustomAllReduceMaxBytes(in.comm.custom_all_reduce_max_bytes);
  auto handles = c.initIpcHandles(static_cast<unsigned>(in.comm.ipc_handles.size()));
  for (size_t i = 0; i < in.comm.ipc_handles.size(); ++i) {
    handles.set(static_cast<unsigned>(i), bytes_of(in.comm.ipc_handles[i]));
  }
  out.setStepRing(in.step_ring);
  out.setStepRingReader(in.step_ring_reader);
  out.setOutputRing(in.output_ring);
}

LoadSpec from_proto(proto::LoadSpec::Reader in) {
  LoadSpec s;
  s.engine = from_proto(in.getEngine());
  s.gpu_shares = in.getGpuShares();
  s.threads = in.getThreads();
  auto p = in.getParallel();
  s.parallel.tp_size = p.getTpSize();
  s.parallel.pp_size = p.getPpSize();
  s.parallel.tp_rank = p.getTpRank();
  s.parallel.pp_rank = p.getPpRank();
  s.parallel.expert_parallel = p.getExpertParallel();
  s.parallel.layer_partition = read_list<int64_t>(p.getLayerPartition());
  auto c = in.getComm();
  s.comm.backend = static_cast<CommBackend>(c.getBackend());
  for (auto r : c.getRanks()) s.comm.ranks.push_back(from_proto(r));
  s.comm.secret = string_of(c.getSecret());
  s.comm.nccl_id = string_of(c.getNcclId());
  s.comm.custom_all_reduce_max_bytes = c.getCustomAllReduceMaxBytes();
  for (auto h : c.getIpcHandles()) s.comm.ipc_handles.push_back(string_of(h));
  s.step_ring = in.getStepRing().cStr();
  s.step_ring_reader = in.getStepRingReader();
  s.output_ring = in.getOutputRing().cStr();
  return s;
}

void to_proto(const ExpertLoad& in, proto::ExpertLoad::Builder out) {
  out.setNumExperts(in.num_experts);
  fill_list(in.layers, out.initLayers(static_cast<unsigned>(in.layers.size())));
  fill_list(in.tokens, out.initTokens(static_cast<unsigned>(in.tokens.size())));
  out.setSteps(in.steps);
}

ExpertLoad from_proto(proto::ExpertLoad::Reader in) {
  ExpertLoad s;
  s.num_experts = in.getNumExperts();
  s.layers = read_list<int64_t>(in.getLayers());
  s.tokens = read_list<uint64_t>(in.getTokens());
  s.steps = in.getSteps();
  return s;
}

void to_proto(const ModelInfo& in, proto::ModelInfo::Builder out) {
  out.setArchitecture(in.architecture);
  out.setVocabSize(in.vocab_size);
  out.setNumLayers(in.num_layers);
  out.setLayerBegin(in.layer_begin);
  out.setLayerEnd(in.layer_end);
  out.setKvBlocks(in.kv_blocks);
  out.setBlockSize(in.block_size);
  out.setMaxModelLen(in.max_model_len);
  out.setMaxNumSeqs(in.max_num_seqs);
  out.setMaxNumBatchedTokens(in.max_num_batched_tokens);
  out.setWeightBytes(in.weight_bytes);
  out.setKvCacheBytes(in.kv_cache_bytes);
  out.setBackend(in.backend);
  out.setDtype(in.dtype);
  out.setDeviceName(in.device_name);
  out.setKvCacheDtype(in.kv_cache_dtype);
  out.setQuantization(in.quantization);
}

ModelInfo from_proto(proto::ModelInfo::Reader in) {
  ModelInfo m;
  m.architecture = in.getArchitecture().cStr();
  m.vocab_size = in.getVocabSize();
  m.num_layers = in.getNumLayers();
  m.layer_begin = in.getLayerBegin();
  m.layer_end = in.getLayerEnd();
  m.kv_blocks = in.getKvBlocks();
  m.block_size = in.getBlockSize();
  m.max_model_len = in.getMaxModelLen();
  m.max_num_seqs = in.getMaxNumSeqs();
  m.max_num_batched_tokens = in.getMaxNumBatchedTokens();
  m.weight_bytes = in.getWeightBytes();
  m.kv_cache_bytes = in.getKvCacheBytes();
  m.backend = in.getBackend().cStr();
  m.dtype = in.getDtype().cStr();
  m.device_name = in.getDeviceName().cStr();
  m.kv_cache_dtype = in.getKvCacheDtype().cStr();
  m.quantization = in.getQuantization().cStr();
  return m;
}

namespace {

template <typename Proto, typename T>
std::vector<std::byte> encode_flat(const T& value) {
  capnp::MallocMessageBuilder message;
  to_proto(value, message.initRoot<Proto>());
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.begin(), bytes.size());
  return out;
}

template <typename Proto, typename T>
Expected<T> decode_flat(std::span<const std::byte> bytes, const char* what) {
  if (bytes.size() % sizeof(capnp::word) != 0) {
    return invalid_argument(std::string("a ") + what + " message of " +
                            std::to_string(bytes.size()) + " bytes is not whole words");
  }
  // Copy into aligned words (the ring's slot need not be 8-byte aligned for capnp's reader).
  auto words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  // The traversal limit bounds what a hostile message can make us read to a multiple of its
  // size; a list read twice (its size, then its items) counts twice, so the multiple is not 1.
  capnp::ReaderOptions limits;
  limits.traversalLimitInWords = 8 * words.size() + 1024;
  limits.nestingLimit = 16;
  T value;
  KJ_IF_MAYBE (e, kj::runCatchingExceptions([&]() {
                 capnp::FlatArrayMessageReader reader(words, limits);
                 value = from_proto(reader.getRoot<Proto>());
               })) {
    return invalid_argument(std::string("a corrupt ") + what +
                            " message: " + e->getDescription().cStr());
  }
  return value;
}

}  // namespace

std::vector<std::byte> encode(const StepInput& step) { return encode_flat<proto::StepInput>(step); }
std::vector<std::byte> encode(const StepOutput& output) {
  return encode_flat<proto::StepOutput>(output);
}
Expected<StepInput> decode_step_input(std::span<const std::byte> bytes) {
  return decode_flat<proto::StepInput, StepInput>(bytes, "step input");
}
Expected<StepOutput> decode_step_output(std::span<const std::byte> bytes) {
  return decode_flat<proto::StepOutput, StepOutput>(bytes, "step output");
}

}  // namespace tessera
