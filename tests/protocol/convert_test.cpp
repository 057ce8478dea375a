// Every field of every value type survives the trip to Cap'n Proto and back.
#include "protocol/convert.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

namespace tessera {
namespace {

template <typename Proto, typename T>
T round_trip(const T& value) {
  capnp::MallocMessageBuilder message;
  auto root = message.initRoot<Proto>();
  to_proto(value, root);
  return from_proto(root.asReader());
}

SamplingParams unusual_sampling() {
  SamplingParams s;
  s.temperature = 0.7f;
  s.top_p = 0.9f;
  s.top_k = 40;
  s.min_p = 0.05f;
  s.seed = 12345678901234ull;
  s.repetition_penalty = 1.3f;
  s.presence_penalty = -0.5f;
  s.frequency_penalty = 1.5f;
  s.logprobs = 5;
  s.max_tokens = 77;
  s.ignore_eos = true;
  s.stop_token_ids = {2, 128009};
  s.stop = {"\n\n", "END"};
  s.skip_special_tokens = false;
  return s;
}

void expect_equal(const SamplingParams& a, const SamplingParams& b) {
  EXPECT_EQ(a.temperature, b.temperature);
  EXPECT_EQ(a.top_p, b.top_p);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(a.min_p, b.min_p);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.repetition_penalty, b.repetition_penalty);
  EXPECT_EQ(a.presence_penalty, b.presence_penalty);
  EXPECT_EQ(a.frequency_penalty, b.frequency_penalty);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.max_tokens, b.max_tokens);
  EXPECT_EQ(a.ignore_eos, b.ignore_eos);
  EXPECT_EQ(a.stop_token_ids, b.stop_token_ids);
  EXPECT_EQ(a.stop, b.stop);
  EXPECT_EQ(a.skip_special_tokens, b.skip_special_tokens);
}

TEST(ConvertTest, SamplingParamsEveryFieldAndTheDefaults) {
  expect_equal(round_trip<proto::SamplingParams>(unusual_sampling()), unusual_sampling());
  // The defaults are written once, in SamplingParams: to_proto writes every field, so the
  // defaults survive the trip, and the wire form has none of its own (an unset proto reads as
  // zeros, not as SamplingParams{}).
  expect_equal(round_trip<proto::SamplingParams>(SamplingParams{}), SamplingParams{});
  capnp::MallocMessageBuilder message;
  const SamplingParams unset = from_proto(message.initRoot<proto::SamplingParams>().asReader());
  EXPECT_EQ(unset.temperature, 0.0f);
  EXPECT_EQ(unset.top_p, 0.0f);
  EXPECT_EQ(unset.top_k, 0);
  EXPECT_EQ(unset.repetition_penalty, 0.0f);
  EXPECT_EQ(unset.logprobs, 0);
  EXPECT_EQ(unset.max_tokens, 0);
  EXPECT_FALSE(unset.skip_special_tokens);
  SamplingParams unseeded;
  unseeded.seed.reset();
  EXPECT_FALSE(round_trip<proto::SamplingParams>(unseeded).seed.has_value());
}

TEST(ConvertTest, StepInputKeepsEverySequenceField) {
  StepInput in;
  in.step_id = 99;
  SeqStep first;
  first.request_id = 7;
  first.tokens = {1, 2, 3};
  first.prefix_tokens = {9, 8, 7, 6};
  first.start_position = 4;
  first.new_blocks = {4, 5};
  first.sample = true;
  first.first = true;
  first.prompt_len = 3;
  first.sampling = unusual_sampling();
  SeqStep decode;
  decode.request_id = 8;
  decode.tokens = {42};
  decode.start_position = 1000;
  decode.new_blocks = {};
  decode.sample = true;
  in.seqs = {first, decode};
  in.finished = {3, 4, 1ull << 40};
  StepInput out = round_trip<proto::StepInput>(in);
  EXPECT_EQ(out.step_id, 99u);
  ASSERT_EQ(out.seqs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(out.seqs[i].request_id, in.seqs[i].request_id);
    EXPECT_EQ(out.seqs[i].tokens, in.seqs[i].tokens);
    EXPECT_EQ(out.seqs[i].start_position, in.seqs[i].start_position);
    EXPECT_EQ(out.seqs[i].new_blocks, in.seqs[i].new_blocks);
    EXPECT_EQ(out.seqs[i].sample, in.seqs[i].sample);
    EXPECT_EQ(out.seqs[i].first, in.seqs[i].first);
  }
  EXPECT_EQ(out.seqs[0].prompt_len, 3);
  EXPECT_EQ(out.seqs[0].prefix_tokens, in.seqs[0].prefix_tokens);
  expect_equal(out.seqs[0].sampling, unusual_sampling());
  EXPECT_EQ(out.finished, in.finished);
}

// The flat encoding the shared-memory rings carry: a step of many sequences (a batch of 1024
// decodes, 4 first steps with long cached prefixes) decodes whole; a truncated one is an error.
TEST(ConvertTest, BigStepsRoundTripThroughTheFlatEncoding) {
  StepInput in;
  in.step_id = 7;
  for (uint64_t i = 0; i < 1024; ++i) {
    SeqStep s;
    s.request_id = i;
    s.tokens = {static_cast<int32_t>(i)};
    s.start_position = 100 + static_cast<int64_t>(i);
    s.sample = true;
    if (i < 4) {
      s.first = true;
      s.prompt_len = 3000;
      s.prefix_tokens.assign(2999, 5);
      s.new_blocks.assign(200, 3);
    }
    in.seqs.push_back(std::move(s));
  }
  in.finished = {1, 2, 3};
  auto bytes = encode(in);
  auto out = decode_step_input(bytes);
  ASSERT_TRUE(out) << out.status().to_string();
  ASSERT_EQ(out->seqs.size(), 1024u);
  EXPECT_EQ(out->seqs[1023].start_position, 1123);
  EXPECT_EQ(out->seqs[0].prefix_tokens.size(), 2999u);
  EXPECT_EQ(out->seqs[3].new_blocks.size(), 200u);
  bytes.resize(bytes.size() / 2 / 8 * 8);
  EXPECT_FALSE(decode_step_input(bytes));
}

TEST(ConvertTest, StepOutputKeepsSamplesLogitsTimesAndErrors) {
  StepOutput in;
  in.step_id = 5;
  in.outputs = {{7, {12, -0.25f, {{12, -0.25f}, {3, -1.5f}}}}, {8, {99, 0.0f, {}}}};
  in.logits = {0.5f, -1.0f, 3.25f};
  in.actor_micros = 1234;
  in.gpu_micros = 999;
  in.error = "rank 1 ran out of memory";
  StepOutput out = round_trip<proto::StepOutput>(in);
  EXPECT_EQ(out.step_id, 5u);
  ASSERT_EQ(out.outputs.size(), 2u);
  EXPECT_EQ(out.outputs[0].request_id, 7u);
  EXPECT_EQ(out.outputs[0].sample.token, 12);
  EXPECT_EQ(out.outputs[0].sample.logprob, -0.25f);
  EXPECT_EQ(out.outputs[0].sample.top_logprobs, in.outputs[0].sample.top_logprobs);
  EXPECT_EQ(out.outputs[1].sample.token, 99);
  EXPECT_EQ(out.logits, in.logits);
  EXPECT_EQ(out.actor_micros, 1234u);
  EXPECT_EQ(out.gpu_micros, 999u);
  EXPECT_EQ(out.error, in.error);
}

// Every field of the engine spec set away from its default: a field the wire forgets fails here.
EngineSpec every_engine_field() {
  EngineSpec e;
  e.model = "/models/llama";
  e.dtype = "bfloat16";
  e.device = Device::kCuda;
  e.tensor_parallel_size = ParallelSize{2};
  e.pipeline_parallel_size = ParallelSize{3};
  e.pipeline_layer_partition = {10, 12, 10};
  e.max_model_len = 4096;
  e.gpu_memory_utilization = 0.85;
  e.max_num_seqs = 128;
  e.max_num_batched_tokens = 8192;
  e.block_size = 32;
  e.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  e.enforce_eager = true;
  e.enable_prefix_caching = false;
  e.async_scheduling = true;
  e.collectives = Collectives::kIpc;
  e.disable_custom_all_reduce = true;
  e.nccl_init_timeout_s = 77;
  e.return_logits = true;
  e.resolved = true;
  e.quantization = QuantMethod::kGptq;
  e.load_format = LoadFormat::kDummy;
  return e;
}

TEST(ConvertTest, EngineSpecEveryFieldAndTheDefaults) {
  const EngineSpec full = every_engine_field();
  EXPECT_TRUE(round_trip<proto::EngineSpec>(full) == full);
  const EngineSpec defaults;
  EXPECT_FALSE(full == defaults);
  EXPECT_TRUE(round_trip<proto::EngineSpec>(defaults) == defaults);
  // -pp not given and -pp auto stay apart.
  EngineSpec automatic;
  automatic.tensor_parallel_size = ParallelSize::automatic();
  automatic.pipeline_parallel_size = ParallelSize::automatic();
  const EngineSpec back = round_trip<proto::EngineSpec>(automatic);
  EXPECT_TRUE(back.tensor_parallel_size.is_auto());
  ASSERT_TRUE(back.pipeline_parallel_size.has_value());
  EXPECT_TRUE(back.pipeline_parallel_size->is_auto());
}

TEST(ConvertTest, LoadSpecEveryField) {
  LoadSpec in;
  in.engine = every_engine_field();
  in.gpu_shares = 2;
  in.threads = 3;
  in.parallel.tp_size = 2;
  in.parallel.pp_size = 3;
  in.parallel.tp_rank = 1;
  in.parallel.pp_rank = 2;
  in.parallel.layer_partition = {10, 12, 10};
  in.comm.backend = CommBackend::kNccl;
  in.comm.ranks = {{0, "a-0", "n-0", 0, "10.0.0.1:1"}, {1, "a-1", "n-1", 3, "10.0.0.2:2"}};
  in.comm.secret = std::string("s\0cret", 6);
  in.comm.nccl_id = std::string(128, '\x7f');
  in.comm.ipc_handles = {std::string(64, 'a'), std::string("b\0c", 3)};
  in.comm.custom_all_reduce_max_bytes = 3ull << 30;
  in.step_ring = "/tessera-1-2-ring-steps";
  in.step_ring_reader = 3;
  in.output_ring = "/tessera-1-2-ring-out-a-1";
  LoadSpec out = round_trip<proto::LoadSpec>(in);
  EXPECT_TRUE(out.engine == in.engine);
  EXPECT_EQ(out.gpu_shares, 2);
  EXPECT_EQ(out.threads, in.threads);
  EXPECT_EQ(out.parallel.tp_size, 2);
  EXPECT_EQ(out.parallel.pp_size, 3);
  EXPECT_EQ(out.parallel.tp_rank, 1);
  EXPECT_EQ(out.parallel.pp_rank, 2);
  EXPECT_EQ(out.parallel.layer_partition, in.parallel.layer_partition);
  EXPECT_EQ(out.comm.backend, CommBackend::kNccl);
  ASSERT_EQ(out.comm.ranks.size(), 2u);
  EXPECT_EQ(out.comm.ranks[1].rank, 1);
  EXPECT_EQ(out.comm.ranks[1].actor_id, "a-1");
  EXPECT_EQ(out.comm.ranks[1].node_id, "n-1");
  EXPECT_EQ(out.comm.ranks[1].gpu, 3);
  EXPECT_EQ(out.comm.ranks[1].address, "10.0.0.2:2");
  EXPECT_EQ(out.comm.secret, in.comm.secret);
  EXPECT_EQ(out.comm.nccl_id, in.comm.nccl_id);
  EXPECT_EQ(out.comm.ipc_handles, in.comm.ipc_handles);
  EXPECT_EQ(out.comm.custom_all_reduce_max_bytes, in.comm.custom_all_reduce_max_bytes);
  EXPECT_EQ(out.step_ring, in.step_ring);
  EXPECT_EQ(out.step_ring_reader, 3u);
  EXPECT_EQ(out.output_ring, in.output_ring);
}

TEST(ConvertTest, EveryCommBackend) {
  for (CommBackend b :
       {CommBackend::kNone, CommBackend::kTcp, CommBackend::kNccl, CommBackend::kIpc}) {
    LoadSpec in;
    in.comm.backend = b;
    EXPECT_EQ(round_trip<proto::LoadSpec>(in).comm.backend, b) << comm_backend_name(b);
  }
}

TEST(ConvertTest, ModelInfoEveryField) {
  ModelInfo in;
  in.architecture = "Qwen3ForCausalLM";
  in.vocab_size = 151936;
  in.num_layers = 36;
  in.layer_begin = 18;
  in.layer_end = 36;
  in.kv_blocks = 12345;
  in.block_size = 16;
  in.max_model_len = 8192;
  in.max_num_seqs = 256;
  in.max_num_batched_tokens = 8192;
  in.weight_bytes = 1ull << 34;
  in.kv_cache_bytes = 1ull << 35;
  in.backend = "cuda";
  in.dtype = "BF16";
  in.device_name = "NVIDIA H200";
  in.quantization = "awq (4-bit, group 128)";
  ModelInfo out = round_trip<proto::ModelInfo>(in);
  EXPECT_EQ(out.architecture, in.architecture);
  EXPECT_EQ(out.vocab_size, in.vocab_size);
  EXPECT_EQ(out.num_layers, in.num_layers);
  EXPECT_EQ(out.layer_begin, in.layer_begin);
  EXPECT_EQ(out.layer_end, in.layer_end);
  EXPECT_EQ(out.kv_blocks, in.kv_blocks);
  EXPECT_EQ(out.block_size, in.block_size);
  EXPECT_EQ(out.max_model_len, in.max_model_len);
  EXPECT_EQ(out.max_num_seqs, in.max_num_seqs);
  EXPECT_EQ(out.max_num_batched_tokens, in.max_num_batched_tokens);
  EXPECT_EQ(out.weight_bytes, in.weight_bytes);
  EXPECT_EQ(out.kv_cache_bytes, in.kv_cache_bytes);
  EXPECT_EQ(out.backend, in.backend);
  EXPECT_EQ(out.dtype, in.dtype);
  EXPECT_EQ(out.device_name, in.device_name);
  EXPECT_EQ(out.quantization, in.quantization);
}

}  // namespace
}  // namespace tessera
