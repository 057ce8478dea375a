@0x8ee2c2d9bc680cbb;
# What the driver sends an actor to load its share of a model and to run each step, and what
# comes back. Every struct mirrors one C++ value type in common/ (common/sampling_params.h,
# common/load_spec.h, common/step.h); protocol/convert.h is the one place that converts them.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

# Every field is written by protocol/convert.cpp; the defaults live in common/sampling_params.h
# only, so none is repeated here (a zero on the wire is the value sent, never "unset").
struct SamplingParams {
  temperature @0 :Float32;
  topP @1 :Float32;
  topK @2 :Int32;
  minP @3 :Float32;
  hasSeed @4 :Bool;
  seed @5 :UInt64;
  repetitionPenalty @6 :Float32;
  presencePenalty @7 :Float32;
  frequencyPenalty @8 :Float32;
  logprobs @9 :Int32;
  maxTokens @10 :Int32;
  ignoreEos @11 :Bool;
  stopTokenIds @12 :List(Int32);
  stop @13 :List(Text);
  skipSpecialTokens @14 :Bool;
}

struct SeqStep {
  requestId @0 :UInt64;
  tokens @1 :List(Int32);
  startPosition @2 :Int64;
  newBlocks @3 :List(UInt32);
  sample @4 :Bool;
  first @5 :Bool;
  promptLen @6 :Int64;
  sampling @7 :SamplingParams;
  prefixTokens @8 :List(Int32);  # first only: positions [0, startPosition), already cached
}

struct StepInput {
  stepId @0 :UInt64;
  seqs @1 :List(SeqStep);
  finished @2 :List(UInt64);
}

struct TokenLogprob {
  token @0 :Int32;
  logprob @1 :Float32;
}

struct SeqOutput {
  requestId @0 :UInt64;
  token @1 :Int32;
  logprob @2 :Float32;
  top @3 :List(TokenLogprob);
}

struct StepOutput {
  stepId @0 :UInt64;
  outputs @1 :List(SeqOutput);
  logits @2 :List(Float32);
  actorMicros @3 :UInt32;
  gpuMicros @4 :UInt32;
  error @5 :Text;   # ring transport only: why the step failed on this rank ("" = it did not)
}

struct RankInfo {
  rank @0 :Int32;
  actorId @1 :Text;
  nodeId @2 :Text;
  gpu @3 :Int32 = -1;
  address @4 :Text;
}

struct ParallelConfig {
  tpSize @0 :Int32 = 1;
  ppSize @1 :Int32 = 1;
  tpRank @2 :Int32;
  ppRank @3 :Int32;
  layerPartition @4 :List(Int64);
  expertParallel @5 :Bool;
}

# common/load_spec.h's CommSpec. The ranks join within the EngineSpec's ncclInitTimeoutS.
struct CommSpec {
  enum Backend { none @0; tcp @1; nccl @2; ipc @3; }  # common/load_spec.h's CommBackend
  backend @0 :Backend;
  ranks @1 :List(RankInfo);
  secret @2 :Data;
  ncclId @3 :Data;
  ipcHandles @4 :List(Data);   # every rank's, by rank (ipc; nccl with the custom all-reduce)
  customAllReduceMaxBytes @5 :UInt64;  # nccl: TP all-reduces up to this size use the custom one
}

# common/engine_spec.h's EngineSpec, resolved by the driver before it reaches an actor.
struct EngineSpec {
  enum Device { auto @0; cuda @1; cpu @2; }
  enum Collectives { auto @0; tcp @1; nccl @2; ipc @3; }
  enum KvCacheDtype { auto @0; fp8E4m3 @1; }
  enum Quantization { auto @0; none @1; awq @2; gptq @3; fp8 @4; }  # QuantMethod
  enum LoadFormat { auto @0; dummy @1; }
  model @0 :Text;
  dtype @1 :Text;
  device @2 :Device;
  tensorParallelSize @3 :Int64;             # 0 = auto
  pipelineParallelSize @4 :Int64 = -1;      # -1 = not given, 0 = auto
  pipelineLayerPartition @5 :List(Int64);
  maxModelLen @6 :Int64;
  gpuMemoryUtilization @7 :Float64;
  maxNumSeqs @8 :Int64;
  maxNumBatchedTokens @9 :Int64;
  blockSize @10 :Int64;
  kvCacheDtype @11 :KvCacheDtype;
  enforceEager @12 :Bool;
  enablePrefixCaching @13 :Bool;
  asyncScheduling @14 :Bool;
  collectives @15 :Collectives;
  disableCustomAllReduce @16 :Bool;
  ncclInitTimeoutS @17 :UInt32;
  returnLogits @18 :Bool;
  resolved @19 :Bool;
  quantization @20 :Quantization;
  numGpuBlocksOverride @21 :Int64;          # 0 = what the memory holds
  enableExpertParallel @22 :Bool;
  loadFormat @23 :LoadFormat;
}

struct LoadSpec {
  engine @0 :EngineSpec;
  gpuShares @1 :Int32 = 1;
  threads @2 :Int32;
  parallel @3 :ParallelConfig;
  comm @4 :CommSpec;
  stepRing @5 :Text;
  stepRingReader @6 :UInt32;
  outputRing @7 :Text;
}

# common/expert_load.h's ExpertLoad.
struct ExpertLoad {
  numExperts @0 :Int64;
  layers @1 :List(Int64);
  tokens @2 :List(UInt64);   # [layers x numExperts]
  steps @3 :UInt64;
}

struct ModelInfo {
  architecture @0 :Text;
  vocabSize @1 :Int64;
  numLayers @2 :Int64;
  layerBegin @3 :Int64;
  layerEnd @4 :Int64;
  kvBlocks @5 :Int64;
  blockSize @6 :Int64;
  maxModelLen @7 :Int64;
  maxNumSeqs @8 :Int64;
  maxNumBatchedTokens @9 :Int64;
  weightBytes @10 :UInt64;
  kvCacheBytes @11 :UInt64;
  backend @12 :Text;
  dtype @13 :Text;
  deviceName @14 :Text;
  kvCacheDtype @15 :Text;
  quantization @16 :Text;
}
