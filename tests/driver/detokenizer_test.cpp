// The engine's detokenizer over the real tokenizers: streams add up to the full decode, and the
// engine's text (stop strings included) comes out right with a real tokenizer behind it.
#include "driver/engine/tokenizer_detokenizer.h"

#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <memory>
#include <string>

#include "common/tokenizer/tokenizer.h"
#include "driver/engine/engine.h"

namespace tessera {
namespace {

class TokenizerDetokenizerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string dir = std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/" + GetParam();
    ASSERT_TRUE(std::filesystem::exists(dir + "/tokenizer.json"))
        << dir << "/tokenizer.json is missing: run scripts/fetch-test-assets";
    auto tok = Tokenizer::load(dir);
    ASSERT_TRUE(tok) << tok.status().to_string();
    tokenizer_ = std::move(tok).value();
  }
  // The text `ids` add after `prompt` (a SentencePiece decoder keeps their leading space there,
  // where it strips it at the start of a text).
  std::string after_prompt(const std::vector<int32_t>& prompt, const std::vector<int32_t>& ids) {
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), ids.begin(), ids.end());
    std::string full = tokenizer_->decode(all, true);
    std::string head = tokenizer_->decode(prompt, true);
    EXPECT_EQ(full.compare(0, head.size(), head), 0);
    return full.substr(head.size());
  }
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_P(TokenizerDetokenizerTest, StreamAddsUpToTheFullDecode) {
  TokenizerDetokenizer d(*tokenizer_);
  const std::string text = "Hello, 世界! Ünïcödé 🎉 tokens\n  spaced out.";
  std::vector<int32_t> ids = tokenizer_->encode(text, false);
  std::vector<int32_t> prompt = tokenizer_->encode("Say it:", false);
  auto stream = d.start(prompt, true);
  std::string out;
  for (int32_t id : ids) out += stream->push(id);
  out += stream->flush();
  EXPECT_EQ(out, after_prompt(prompt, ids));
}

// Plays back `ids` as the sampled tokens of every request.
class PlaybackExecutor final : public StepExecutor {
 public:
  std::deque<int32_t> ids;
  std::deque<StepInput> pending;
  Status submit(StepInput step) override {
    pending.push_back(std::move(step));
    return Status::ok();
  }
  Expected<StepOutput> collect() override {
    StepOutput out;
    for (const auto& s : pending.front().seqs) {
      if (!s.sample) continue;
      out.outputs.push_back({s.request_id, {ids.empty() ? 0 : ids.front(), 0.0f, {}}});
      if (!ids.empty()) ids.pop_front();
    }
    pending.pop_front();
    return out;
  }
};

TEST_P(TokenizerDetokenizerTest, EngineTextStopsAtAStopStringAcrossTokens) {
  TokenizerDetokenizer d(*tokenizer_);
  PlaybackExecutor ex;
  std::vector<int32_t> ids = tokenizer_->encode("The answer is 42, 你好. THE END and more", false);
  ex.ids.assign(ids.begin(), ids.end());
  EngineConfig c;
  c.model.kv_blocks = 64;
  c.model.block_size = 16;
  c.model.max_num_seqs = 1;
  c.model.max_num_batched_tokens = 2048;
  c.model.max_model_len = 1024;
  c.model.vocab_size = static_cast<int64_t>(tokenizer_->vocab_size());
  LlmEngine engine(c, ex, d);
  SamplingParams s;
  s.max_tokens = 100;
  s.stop = {"E END"};
  std::vector<int32_t> prompt = tokenizer_->encode("Q:", false);
  std::string expected = after_prompt(prompt, ids);
  ASSERT_NE(expected.find("E END"), std::string::npos);
  expected.resize(expected.find("E END"));
  auto request = Request::make(prompt, s, c.model);
  ASSERT_TRUE(request) << request.status().message();
  auto id = engine.add_request(std::move(*request));
  ASSERT_TRUE(id) << id.status().to_string();
  std::string text;
  std::string reason;
  for (int i = 0; i < 200 && engine.has_unfinished(); ++i) {
    auto outs = engine.step();
    ASSERT_TRUE(outs) << outs.status().to_string();
    for (const auto& o : *outs) {
      text += o.delta;
      EXPECT_EQ(o.delta.find('E'), std::string::npos) << "held back as a stop-string start";
      if (o.finished) reason = finish_reason_name(o.finish_reason);
    }
  }
  EXPECT_EQ(text, expected);
  EXPECT_NE(text.find("42, 你好. TH"), std::string::npos) << text;
  EXPECT_EQ(reason, "stop");
}

INSTANTIATE_TEST_SUITE_P(Real, TokenizerDetokenizerTest,
                         ::testing::Values("llama3", "qwen3", "llama2"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tessera
