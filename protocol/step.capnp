@0x8ee2c2d9bc680cbb;
# What the driver sends an actor to load its share of a model and to run each step, and what
# comes back. Every struct mirrors one C++ value type in common/ (common/sampling_params.h,
# common/load_spec.h, common/step.h); protocol/convert.h is the one place that converts them.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

struct SamplingParams {
  temperature @0 :Float32 = 1.0;
  topP @1 :Float32 = 1.0;
  topK @2 :Int32 = -1;
  minP @3 :Float32;
  hasSeed @4 :Bool;
  seed @5 :UInt64;
  repetitionPenalty @6 :Float32 = 1.0;
  presencePenalty @7 :Float32;
  frequencyPenalty @8 :Float32;
  logprobs @9 :Int32 = -1;
  maxTokens @10 :Int32 = 16;
  ignoreEos @11 :Bool;
  stopTokenIds @12 :List(Int32);
  stop @13 :List(Text);
  skipSpecialTokens @14 :Bool = true;
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
}

struct CommSpec {
  backend @0 :Text;
  ranks @1 :List(RankInfo);
  secret @2 :Data;
  ncclId @3 :Data;
  initTimeoutMs @4 :UInt32 = 120000;
  ipcHandles @5 :List(Data);   # every rank's, by rank ("ipc"; "nccl" with the custom all-reduce)
  customAllReduceMaxBytes @6 :UInt64;  # "nccl": TP all-reduces up to this size use the custom one
}

struct LoadSpec {
  modelDir @0 :Text;
  dtype @1 :Text;
  device @2 :Text;
  blockSize @3 :Int64;
  maxModelLen @4 :Int64;
  maxNumSeqs @5 :Int64;
  maxNumBatchedTokens @6 :Int64;
  gpuMemoryUtilization @7 :Float64;
  enforceEager @8 :Bool;
  returnLogits @9 :Bool;
  threads @10 :Int32;
  parallel @11 :ParallelConfig;
  comm @12 :CommSpec;
  stepRing @13 :Text;
  stepRingReader @14 :UInt32;
  outputRing @15 :Text;
  kvCacheDtype @16 :Text = "auto";  # --kv-cache-dtype: auto | fp8 | fp8_e4m3
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
}
