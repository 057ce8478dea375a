// The actor's request table: a step carries only what changed (new tokens, appended blocks, the
// sampling parameters once), the table rebuilds each request's whole state, and a malformed step
// is refused whole, naming what is wrong, with nothing of it applied.
#include "actors/model/requests.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

ModelInfo limits() {
  ModelInfo l;
  l.vocab_size = 100;
  l.block_size = 4;
  l.kv_blocks = 8;
  l.max_model_len = 24;
  l.max_num_seqs = 3;
  l.max_num_batched_tokens = 16;
  return l;
}

SeqStep first(uint64_t id, std::vector<int32_t> tokens, std::vector<uint32_t> blocks,
              int64_t prompt_len) {
  SeqStep s;
  s.request_id = id;
  s.tokens = std::move(tokens);
  s.new_blocks = std::move(blocks);
  s.first = true;
  s.sample = true;
  s.prompt_len = prompt_len;
  return s;
}

SeqStep next(uint64_t id, std::vector<int32_t> tokens, int64_t start,
             std::vector<uint32_t> blocks = {}) {
  SeqStep s;
  s.request_id = id;
  s.tokens = std::move(tokens);
  s.start_position = start;
  s.new_blocks = std::move(blocks);
  s.sample = true;
  return s;
}

StepInput step(std::vector<SeqStep> seqs, std::vector<uint64_t> finished = {}) {
  StepInput in;
  in.seqs = std::move(seqs);
  in.finished = std::move(finished);
  return in;
}

bool says(const Status& s, const std::string& part) {
  return s.message().find(part) != std::string::npos;
}

// Async scheduling: a decode step whose token is kSampledToken takes the token this actor
// sampled for the request in the step before: it joins the history and the forward batch. With
// no sample recorded (a rank that does not sample, or the token already consumed) the step is
// refused, nothing of it applied.
TEST(RequestTableTest, TheSampledTokenFillsAnAsyncDecodeStep) {
  RequestTable t(limits());
  ASSERT_TRUE(t.apply(step({first(1, {5, 6, 7}, {0}, 3)})));
  const StepInput ahead = step({next(1, {kSampledToken}, 3)});
  Status none = t.apply(ahead);
  EXPECT_EQ(none.code(), Code::kFailedPrecondition);
  EXPECT_TRUE(says(none, "async scheduling needs one rank")) << none.message();
  EXPECT_EQ(t.at(1).tokens.size(), 3u);
  t.record_sample(1, 42);
  ASSERT_TRUE(t.apply(ahead));
  EXPECT_EQ(t.at(1).tokens, (std::vector<int32_t>{5, 6, 7, 42}));
  EXPECT_EQ(std::vector<int32_t>(t.at(1).output().begin(), t.at(1).output().end()),
            (std::vector<int32_t>{42}));
  const StepBatch made = t.batch(ahead);
  const std::span<const ForwardSeq> batch = made.seqs();
  ASSERT_EQ(batch.size(), 1u);
  EXPECT_EQ(std::vector<int32_t>(batch[0].tokens.begin(), batch[0].tokens.end()),
            (std::vector<int32_t>{42}));
  EXPECT_EQ(batch[0].start_position, 3);
  // Consumed: the next step ahead needs a new sample.
  EXPECT_EQ(t.apply(step({next(1, {kSampledToken}, 4, {1})})).code(), Code::kFailedPrecondition);
  // Only as the one token of a decode step.
  t.record_sample(1, 43);
  EXPECT_EQ(t.apply(step({next(1, {kSampledToken, 8}, 4, {1})})).code(), Code::kInvalidArgument);
  ASSERT_TRUE(t.apply(step({next(1, {kSampledToken}, 4, {1})})));
  EXPECT_EQ(t.at(1).tokens.back(), 43);
}

// A step launched while the one that samples its token still runs: the token is a placeholder
// (the backend fills it in from that step's sample), recorded into the history when the sample
// comes back. Only one sample may be outstanding per placeholder; the next sample is kept for the
// step after.
TEST(RequestTableTest, APendingSampleLeavesAPlaceholderThatItsSampleFills) {
  RequestTable t(limits());
  ASSERT_TRUE(t.apply(step({first(1, {5, 6, 7}, {0}, 3), first(2, {9}, {1}, 1)})));
  t.expect_sample(1);
  t.expect_sample(2);
  EXPECT_TRUE(t.placeholders().empty());
  const StepInput ahead = step({next(2, {kSampledToken}, 1), next(1, {kSampledToken}, 3)});
  ASSERT_TRUE(t.apply(ahead));
  EXPECT_EQ(t.placeholders(), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(t.at(1).tokens, (std::vector<int32_t>{5, 6, 7, kSampledToken}));
  const StepBatch made = t.batch(ahead);
  const std::span<const ForwardSeq> batch = made.seqs();
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[1].tokens[0], kSampledToken);
  EXPECT_EQ(batch[1].start_position, 3);
  t.expect_sample(1);  // the step ahead samples too
  // Its sample is not back: a third step cannot take it.
  Status early = t.apply(step({next(1, {kSampledToken}, 4, {1})}));
  EXPECT_EQ(early.code(), Code::kFailedPrecondition);
  EXPECT_TRUE(says(early, "while 2 samples of it are pending")) << early.message();
  t.record_sample(1, 42);  // the first step's
  EXPECT_EQ(t.at(1).tokens, (std::vector<int32_t>{5, 6, 7, 42}));
  EXPECT_EQ(t.at(1).pending_samples, 1);
  EXPECT_FALSE(t.at(1).last_sampled);
  t.record_sample(1, 43);  // the second's: for the step after
  EXPECT_EQ(t.at(1).last_sampled, 43);
  ASSERT_TRUE(t.apply(step({next(1, {kSampledToken}, 4, {2})})));
  EXPECT_EQ(t.at(1).tokens, (std::vector<int32_t>{5, 6, 7, 42, 43}));
  EXPECT_TRUE(t.placeholders().empty());
  // A request forgotten while its sample is pending: the sample is dropped.
  t.record_sample(2, 11);
  EXPECT_EQ(t.at(2).tokens, (std::vector<int32_t>{9, 11}));
  ASSERT_TRUE(t.apply(step({}, {2})));
  t.record_sample(2, 12);
  EXPECT_EQ(t.size(), 1u);
}

// A tensor-parallel rank that does not sample never has the sample on the host: each
// kSampledToken is a placeholder, filled in by the backend from the sampling rank's samples.
TEST(RequestTableTest, ARankThatDoesNotSampleKeepsPlaceholders) {
  RequestTable t(limits());
  t.set_samples(false);
  ASSERT_TRUE(t.apply(step({first(1, {5, 6, 7}, {0}, 3)})));
  ASSERT_TRUE(t.apply(step({next(1, {kSampledToken}, 3)})));
  EXPECT_EQ(t.placeholders(), (std::vector<size_t>{0}));
  ASSERT_TRUE(t.apply(step({next(1, {kSampledToken}, 4, {1})})));
  EXPECT_EQ(t.at(1).tokens, (std::vector<int32_t>{5, 6, 7, kSampledToken, kSampledToken}));
  // Still only as the one token of a decode step.
  EXPECT_EQ(t.apply(step({next(1, {kSampledToken, 8}, 5)})).code(), Code::kInvalidArgument);
}

// A prefix-cache hit: the first step starts after the cached prefix, whose tokens join the
// history (penalties and the seeded sampler see the whole prompt) without being computed.
TEST(RequestTableTest, AFirstStepAfterACachedPrefixKeepsThePrefixInTheHistory) {
  RequestTable t(limits());
  SeqStep hit = first(1, {5, 6}, {3, 4}, 6);
  hit.prefix_tokens = {1, 2, 3, 4};
  hit.start_position = 4;
  StepInput s = step({hit});
  ASSERT_TRUE(t.apply(s).is_ok());
  const RequestState& r = t.at(1);
  EXPECT_EQ(r.tokens, (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(std::vector<int32_t>(r.prompt().begin(), r.prompt().end()),
            (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  const StepBatch made = t.batch(s);
  const std::span<const ForwardSeq> batch = made.seqs();
  EXPECT_EQ(batch[0].start_position, 4);
  EXPECT_EQ(batch[0].tokens.size(), 2u);
  ASSERT_TRUE(t.apply(step({next(1, {50}, 6)})).is_ok());
  EXPECT_EQ(t.at(1).output().size(), 1u);

  SeqStep wrong = first(2, {5}, {5}, 3);
  wrong.prefix_tokens = {1, 2};
  wrong.start_position = 3;
  EXPECT_TRUE(says(t.apply(step({wrong})), "starts after its cached prefix (2 tokens)"));
  SeqStep outside = first(2, {5}, {5}, 2);
  outside.prefix_tokens = {100};
  outside.start_position = 1;
  EXPECT_TRUE(says(t.apply(step({outside})), "prefix token id 100"));
}

TEST(RequestTableTest, DeltasRebuildTheWholeRequest) {
  RequestTable t(limits());
  // A prompt of 6 in two chunks, then two decoded tokens; a block appended when the 9th arrives.
  ASSERT_TRUE(t.apply(step({first(1, {1, 2, 3, 4}, {5, 2}, 6)})).is_ok());
  ASSERT_TRUE(t.apply(step({next(1, {5, 6}, 4)})).is_ok());
  ASSERT_TRUE(t.apply(step({next(1, {50}, 6)})).is_ok());
  ASSERT_TRUE(t.apply(step({next(1, {51}, 7)})).is_ok());
  StepInput s = step({next(1, {52}, 8, {7})});
  ASSERT_TRUE(t.apply(s).is_ok());
  const RequestState& r = t.at(1);
  EXPECT_EQ(r.blocks, (std::vector<uint32_t>{5, 2, 7}));
  EXPECT_EQ(std::vector<int32_t>(r.prompt().begin(), r.prompt().end()),
            (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(std::vector<int32_t>(r.output().begin(), r.output().end()),
            (std::vector<int32_t>{50, 51, 52}));
  const StepBatch made = t.batch(s);
  const std::span<const ForwardSeq> batch = made.seqs();
  ASSERT_EQ(batch.size(), 1u);
  EXPECT_EQ(batch[0].start_position, 8);
  EXPECT_EQ(batch[0].block_table.size(), 3u);
  EXPECT_EQ(batch[0].tokens.size(), 1u);
  EXPECT_TRUE(batch[0].want_logits);
  // Its row to sample, which the backends take with it.
  ASSERT_EQ(made.rows().size(), 1u);
  EXPECT_EQ(made.rows()[0].state, &t.at(made.rows()[0].request_id));
}

TEST(RequestTableTest, SeedsAreKeptOrDrawnOnce) {
  RequestTable t(limits());
  SeqStep a = first(1, {1}, {0}, 1);
  a.sampling.seed = 42;
  SeqStep b = first(2, {1}, {1}, 1);
  ASSERT_TRUE(t.apply(step({a, b})).is_ok());
  EXPECT_EQ(t.at(1).seed, 42u);
  const uint64_t drawn = t.at(2).seed;
  ASSERT_TRUE(t.apply(step({next(2, {3}, 1)})).is_ok());
  EXPECT_EQ(t.at(2).seed, drawn) << "a request keeps the seed it was given when it arrived";
}

TEST(RequestTableTest, FinishedAndRestartedRequestsAreForgotten) {
  RequestTable t(limits());
  ASSERT_TRUE(t.apply(step({first(1, {1, 2}, {0}, 2), first(2, {3}, {1}, 1)})).is_ok());
  ASSERT_TRUE(t.apply(step({next(2, {4}, 1)}, {1})).is_ok());
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.forgotten(), (std::vector<uint64_t>{1}));
  // Preempted and restarted: a first step again replaces the old state.
  ASSERT_TRUE(t.apply(step({first(2, {3, 4, 9}, {6}, 1)})).is_ok());
  EXPECT_EQ(t.forgotten(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(t.at(2).tokens, (std::vector<int32_t>{3, 4, 9}));
  EXPECT_EQ(t.at(2).blocks, (std::vector<uint32_t>{6}));
  // A finished request cannot continue in the same step it is finished in.
  Status s = t.apply(step({next(2, {5}, 3)}, {2}));
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
}

TEST(RequestTableTest, MalformedStepsAreRefusedWholeAndNamed) {
  RequestTable t(limits());
  ASSERT_TRUE(t.apply(step({first(1, {1, 2, 3}, {0}, 3), first(4, {9}, {3}, 1)})).is_ok());
  struct Case {
    StepInput in;
    Code code;
    std::string says;
  };
  SeqStep bad_sampling = first(2, {1}, {1}, 1);
  bad_sampling.sampling.top_p = 0.0f;
  SeqStep late_first = first(2, {1}, {1}, 1);
  late_first.start_position = 3;
  SeqStep no_prompt = first(2, {1}, {1}, 0);
  SeqStep stop_outside = first(2, {1}, {1}, 1);
  stop_outside.sampling.stop_token_ids = {100};
  std::vector<Case> cases = {
      {step({next(9, {1}, 0)}), Code::kFailedPrecondition, "request 9 has no state"},
      {step({next(1, {4}, 2)}), Code::kInvalidArgument, "continues at position 2"},
      {step({next(1, {4, 5}, 3)}), Code::kInvalidArgument, "block table holds 4 tokens"},
      {step({next(1, {4}, 3, {8})}), Code::kInvalidArgument, "block 8 is outside the KV cache"},
      {step({next(1, {100}, 3)}), Code::kInvalidArgument, "token id 100 is outside"},
      {step({next(1, {-2}, 3)}), Code::kInvalidArgument, "token id -2 is outside"},
      {step({next(1, {}, 3)}), Code::kInvalidArgument, "at least one token"},
      {step({next(1, {4}, 3), next(1, {5}, 4)}), Code::kInvalidArgument, "appears twice"},
      {step({next(1, {4}, 3), first(2, {1}, {1}, 1), first(3, {1}, {2}, 1)}),
       Code::kInvalidArgument, "more than max-num-seqs 3"},
      {step({first(2, std::vector<int32_t>(17, 1), {1, 2, 3, 4, 5}, 17)}), Code::kInvalidArgument,
       "more than max-num-batched-tokens 16"},
      {step({first(2, std::vector<int32_t>(25, 1), {}, 25)}), Code::kInvalidArgument,
       "exceed max-model-len 24"},
      {step({first(2, {1}, {0, 1, 2, 3, 4, 5, 6}, 1)}), Code::kInvalidArgument,
       "7 blocks, more than max-model-len needs (6)"},
      {step({bad_sampling}), Code::kInvalidArgument, "top_p"},
      {step({stop_outside}), Code::kInvalidArgument, "100"},
      {step({late_first}), Code::kInvalidArgument, "starts after its cached prefix (0 tokens)"},
      {step({no_prompt}), Code::kInvalidArgument, "prompt_len"},
  };
  for (const Case& c : cases) {
    // Each bad step also finishes request 4 and starts a good request 5: neither may happen.
    StepInput in = c.in;
    in.finished.push_back(4);
    in.seqs.insert(in.seqs.begin(), first(5, {7}, {7}, 1));
    Status s = t.apply(in);
    EXPECT_EQ(s.code(), c.code) << c.says << ": " << s.to_string();
    EXPECT_TRUE(says(s, c.says)) << "wanted '" << c.says << "', got: " << s.to_string();
    EXPECT_EQ(t.size(), 2u) << c.says;
    EXPECT_EQ(t.at(1).tokens.size(), 3u) << c.says;
  }
  EXPECT_TRUE(t.apply(step({next(1, {4}, 3, {4})})).is_ok()) << "the table still works";
}

}  // namespace
}  // namespace tessera
