@0x8ee2c2d9bc680cbb;
# What the driver sends an actor each step, and what comes back. The driver's scheduler owns
# the KV-cache blocks; the actor owns the per-request sampling state (RNG, token history).
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

struct SamplingParams {
  temperature @0 :Float32 = 1.0;      # 0 = greedy
  topK @1 :Int32 = -1;                # -1 = off
  topP @2 :Float32 = 1.0;
  minP @3 :Float32 = 0.0;
  seed @4 :UInt64;
  hasSeed @5 :Bool;
  repetitionPenalty @6 :Float32 = 1.0;
  presencePenalty @7 :Float32 = 0.0;
  frequencyPenalty @8 :Float32 = 0.0;
  logprobs @9 :Int32 = -1;            # -1 = off, else top-N alternatives
}

struct SeqStep {
  requestId @0 :UInt64;
  tokens @1 :List(Int32);        # this step's new tokens: a prompt chunk, or the last sampled token
  startPosition @2 :UInt32;      # position of tokens[0] in the sequence
  blockTable @3 :List(UInt32);   # KV blocks of the whole sequence so far, in order
  sample @4 :Bool;               # sample a token after this chunk (last prefill chunk or decode)
  first @5 :Bool;                # first step of the request: promptIds and sampling are set
  promptIds @6 :List(Int32);
  sampling @7 :SamplingParams;
}

struct StepInput {
  seqs @0 :List(SeqStep);
  finished @1 :List(UInt64);     # requests whose state the actor may drop
}

struct TokenLogprob {
  token @0 :Int32;
  logprob @1 :Float32;
}

struct SeqOutput {
  requestId @0 :UInt64;
  token @1 :Int32;
  logprob @2 :Float32;           # of `token`, when logprobs were asked for
  top @3 :List(TokenLogprob);    # top-N alternatives, best first
}

struct StepOutput {
  outputs @0 :List(SeqOutput);   # one per SeqStep with sample = true, in order
  logits @1 :List(Float32);      # only when StepInput asked for raw logits (tests, parity)
  actorMicros @2 :UInt32;        # time the actor spent in this step
  gpuMicros @3 :UInt32;          # of which the forward pass on the GPU (0 on the cpu backend)
}

struct LoadSpec {
  modelDir @0 :Text;
  dtype @1 :Text;                # "auto" | "bfloat16" | "float16" | "float32"
  kvBlocks @2 :UInt32;           # 0 = enough for maxModelLen tokens of one sequence
  blockSize @3 :UInt32 = 16;
  maxModelLen @4 :UInt32;        # 0 = min(the model's max_position_embeddings, 8192)
  returnLogits @5 :Bool;         # include the sampled rows' logits in StepOutput (tests)
  device @6 :Text;               # "auto" (cuda when the actor sees a GPU) | "cuda" | "cpu"
  gpuMemoryUtilization @7 :Float32 = 0.9;  # fraction of the GPU's memory the actor may use
  enforceEager @8 :Bool;         # no CUDA graphs
  maxNumSeqs @9 :UInt32 = 256;   # largest batch the driver will send
  maxNumBatchedTokens @10 :UInt32;  # largest step in tokens; 0 = max(maxModelLen, 2048)
}

struct ModelInfo {
  architecture @0 :Text;
  vocabSize @1 :UInt32;
  numLayers @2 :UInt32;
  kvBlocks @3 :UInt32;
  blockSize @4 :UInt32;
  maxModelLen @5 :UInt32;
  weightBytes @6 :UInt64;
  backend @7 :Text;              # "cpu" or "cuda"
  dtype @8 :Text;                # what the model computes in: "BF16", "F16", "F32"
  deviceName @9 :Text;           # "NVIDIA H200"; empty on the cpu backend
  kvCacheBytes @10 :UInt64;
  maxNumSeqs @11 :UInt32;
  maxNumBatchedTokens @12 :UInt32;  # the largest step the actor takes (the scheduler's budget)
}
