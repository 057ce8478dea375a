// The real Llama 3, Qwen 3 and Llama 2 (SentencePiece-style) tokenizers against the goldens that
// Hugging Face tokenizers wrote (scripts/goldens/tokenizer_goldens.py): their tokenizer.json alone
// against the `tokenizers` library, and the whole directory against transformers' AutoTokenizer.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "common/tokenizer/tokenizer.h"
#include "tests/tokenizer/tokenizer_test_util.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::golden;
using testing::raw_tokenizer;
using testing::real_tokenizer;
using testing::show;

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

// Checks encode and decode of every case of `cases` (a golden "cases" list) with `tok`; stops
// after 10 failing cases.
void check_cases(const Tokenizer& tok, const json& cases, const std::string& what) {
  int failing = 0;
  for (const json& c : cases) {
    std::string text = c["text"].get<std::string>();
    auto ids = ids_of(c["ids"]);
    bool ok = true;
    auto expect = [&](const auto& got, const auto& want, const char* step) {
      if (got == want) return;
      ok = false;
      ADD_FAILURE() << what << ": " << step << " of " << show(text) << " differs from "
                    << "Hugging Face's:\n  got  "
                    << json(got).dump(-1, ' ', false, json::error_handler_t::replace) << "\n  want "
                    << json(want).dump();
    };
    expect(tok.encode(text, true), ids, "encode(add_special_tokens=true)");
    expect(tok.encode(text, false), ids_of(c["ids_no_special"]),
           "encode(add_special_tokens=false)");
    expect(tok.decode(ids, false), c["decoded"].get<std::string>(), "decode");
    expect(tok.decode(ids, true), c["decoded_skip"].get<std::string>(),
           "decode(skip_special_tokens=true)");
    if (!ok && ++failing >= 10) {
      ADD_FAILURE() << what << ": stopping after 10 failing cases";
      return;
    }
  }
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, EncodeAndDecodeCorpus) {
  const Tokenizer* tok = raw_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const json& g = golden(GetParam());
  ASSERT_TRUE(g.contains("cases"));
  EXPECT_EQ(tok->vocab_size(), g["vocab_size"].get<size_t>());
  check_cases(*tok, g["cases"], GetParam());
}

TEST_P(GoldenTest, DecodeIdSequences) {
  const Tokenizer* tok = raw_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const json& g = golden(GetParam());
  ASSERT_TRUE(g.contains("decode_cases"));
  for (const json& c : g["decode_cases"]) {
    auto ids = ids_of(c["ids"]);
    EXPECT_EQ(tok->decode(ids, false), c["decoded"].get<std::string>()) << c["ids"].dump();
    EXPECT_EQ(tok->decode(ids, true), c["decoded_skip"].get<std::string>()) << c["ids"].dump();
  }
}

// The same tokenizer with extra added tokens (lstrip, rstrip, single_word, normalized, special,
// one already in the model's vocab, overlapping contents) as Hugging Face assigned them.
TEST_P(GoldenTest, AddedTokenFlags) {
  std::string dir = testing::tokenizer_dir(GetParam());
  ASSERT_TRUE(real_tokenizer(GetParam()) != nullptr);
  const json& g = golden(GetParam());
  ASSERT_TRUE(g.contains("added"));
  json spec = json::parse(testing::read_file(dir + "/tokenizer.json"));
  spec["added_tokens"] = g["added"]["added_tokens"];
  auto tok = Tokenizer::from_json(spec.dump());
  ASSERT_TRUE(tok) << tok.status().to_string();
  EXPECT_EQ((*tok)->vocab_size(), g["added"]["vocab_size"].get<size_t>());
  for (const json& t : g["added"]["added_tokens"]) {
    EXPECT_EQ((*tok)->token_to_id(t["content"].get<std::string>()), t["id"].get<int32_t>());
    EXPECT_EQ((*tok)->is_special(t["id"].get<int32_t>()), t["special"].get<bool>()) << t.dump();
  }
  check_cases(**tok, g["added"]["cases"], GetParam() + " with added tokens");
}

// Variants of the tokenizer with sections replaced (TemplateProcessing adding a bos, Metaspace,
// a Replace regex, GPT-2's ByteLevel regex, every Split behavior), against Hugging Face on them.
TEST_P(GoldenTest, Variants) {
  std::string dir = testing::tokenizer_dir(GetParam());
  ASSERT_TRUE(real_tokenizer(GetParam()) != nullptr);
  const json& g = golden(GetParam());
  ASSERT_TRUE(g.contains("variants"));
  json base = json::parse(testing::read_file(dir + "/tokenizer.json"));
  for (const json& variant : g["variants"]) {
    std::string name = GetParam() + " variant " + variant["name"].get<std::string>();
    if (variant.contains("error")) {
      ADD_FAILURE() << name << ": Hugging Face did not load it:\n" << variant["error"];
      continue;
    }
    json spec = base;
    for (const auto& [section, value] : variant["patch"].items()) spec[section] = value;
    auto tok = Tokenizer::from_json(spec.dump());
    ASSERT_TRUE(tok) << name << ": " << tok.status().to_string();
    check_cases(**tok, variant["cases"], name);
  }
}

// The directory as transformers' AutoTokenizer loads it (tokenizer_config.json's class and flags
// on top of tokenizer.json) gives the ids vLLM gets. The goldens keep transformers' ids only
// where they differ from the `tokenizers` library's (Llama 2's legacy Metaspace: 7 of 50 texts).
TEST_P(GoldenTest, IdsEqualTransformers) {
  const Tokenizer* tok = real_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const json& g = golden(GetParam());
  ASSERT_TRUE(g.contains("transformers") && g["transformers"].contains("cases"))
      << "the goldens have no transformers section";
  std::map<size_t, const json*> differing;
  for (const json& c : g["transformers"]["cases"]) differing[c["index"].get<size_t>()] = &c;
  const json& cases = g["cases"];
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& want = differing.count(i) ? *differing[i] : cases[i];
    const std::string text = cases[i]["text"].get<std::string>();
    EXPECT_EQ(tok->encode(text, true), ids_of(want["ids"])) << show(text);
    EXPECT_EQ(tok->encode(text, false), ids_of(want["ids_no_special"])) << show(text);
  }
}

TEST_P(GoldenTest, ConcurrentEncodesAgree) {
  const Tokenizer* tok = raw_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  const json& cases = golden(GetParam())["cases"];
  ASSERT_FALSE(cases.empty());
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (size_t i = 0; i < cases.size(); ++i) {
          const json& c = cases[(i + t * 7) % cases.size()];
          if (tok->encode(c["text"].get<std::string>(), true) != ids_of(c["ids"])) {
            mismatches[t]++;
          }
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

// About 10 kB of varied text (prose, CJK, code, numbers, emoji) must encode in a few ms.
TEST_P(GoldenTest, EncodeSpeed) {
  const Tokenizer* tok = raw_tokenizer(GetParam());
  ASSERT_NE(tok, nullptr);
  std::string text;
  const json& cases = golden(GetParam())["cases"];
  ASSERT_FALSE(cases.empty());
  for (int round = 0; text.size() < 10000; ++round) {
    for (const json& c : cases) {
      text += c["text"].get<std::string>();
      text += std::to_string(round) + " ";  // new words each round: not all cache hits
    }
  }
  using Clock = std::chrono::steady_clock;
  auto time_encode = [&](const std::string& input) {
    auto start = Clock::now();
    auto ids = tok->encode(input, true);
    EXPECT_FALSE(ids.empty());
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };
  double cold = time_encode(text);
  std::vector<double> warm;
  for (int i = 0; i < 5; ++i) warm.push_back(time_encode(text));
  std::sort(warm.begin(), warm.end());
  std::printf("[ %s ] encode of %zu bytes: first %.2f ms, then median %.2f ms\n",
              GetParam().c_str(), text.size(), cold, warm[2]);
  EXPECT_LT(warm[2], 50.0) << "encode of 10 kB should take a few ms";
}

TEST(TokenizerConfigTest, RealConfigs) {
  const Tokenizer* llama3 = real_tokenizer("llama3");
  const Tokenizer* qwen3 = real_tokenizer("qwen3");
  const Tokenizer* llama2 = real_tokenizer("llama2");
  ASSERT_TRUE(llama3 && qwen3 && llama2);

  EXPECT_EQ(llama3->bos_id(), 128000);
  EXPECT_EQ(llama3->eos_ids(), std::vector<int32_t>{128001});
  EXPECT_EQ(llama3->id_to_token(128000), "<|begin_of_text|>");
  EXPECT_TRUE(llama3->is_special(128000));
  EXPECT_FALSE(llama3->is_special(9906));
  EXPECT_NE(llama3->chat_template().find("start_header_id"), std::string::npos);
  EXPECT_EQ(llama3->model_max_length(), std::nullopt);  // 1e30: unlimited
  // This tokenizer.json's post-processor is ByteLevel only: no bos is added by encode().
  EXPECT_FALSE(llama3->add_bos_token());

  EXPECT_EQ(qwen3->bos_id(), std::nullopt);
  EXPECT_EQ(qwen3->eos_ids(), std::vector<int32_t>{151645});
  EXPECT_EQ(qwen3->token_to_id("<|im_start|>"), 151644);
  EXPECT_FALSE(qwen3->add_bos_token());
  EXPECT_EQ(qwen3->model_max_length(), 131072);
  EXPECT_NE(qwen3->chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_FALSE(qwen3->is_special(*qwen3->token_to_id("<think>")));  // added, not special

  EXPECT_EQ(llama2->bos_id(), 1);
  EXPECT_EQ(llama2->eos_ids(), std::vector<int32_t>{2});
  EXPECT_TRUE(llama2->add_bos_token());
  EXPECT_EQ(llama2->token_to_id("<0x0A>"), 13);
  EXPECT_TRUE(llama2->chat_template().empty());
}

INSTANTIATE_TEST_SUITE_P(Real, GoldenTest, ::testing::Values("llama3", "qwen3", "llama2"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tessera
