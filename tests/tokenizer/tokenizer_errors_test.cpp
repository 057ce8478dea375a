// Loading errors name the file and what is wrong; small hand-made tokenizers check the BPE
// options the real ones do not exercise.
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>

#include "common/tokenizer/tokenizer.h"
#include "tests/tokenizer/tokenizer_test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class TokenizerDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tessera-tokenizer-test-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  Expected<std::unique_ptr<Tokenizer>> load() { return Tokenizer::load(dir_.string()); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// A small BPE tokenizer.json: vocab a, b, c, ab, abc, <unk>; merges "a b", "ab c".
json tiny_bpe() {
  return json::parse(R"({
    "version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
    "post_processor": null, "decoder": null,
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": false,
              "byte_fallback": false, "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4,
              "<unk>": 5}, "merges": ["a b", "ab c"]}})");
}

TEST_F(TokenizerDir, MissingFile) {
  auto tok = load();
  ASSERT_FALSE(tok);
  EXPECT_EQ(tok.status().code(), Code::kNotFound);
  EXPECT_EQ(tok.status().message(), path("tokenizer.json") + ": no such file");
}

TEST_F(TokenizerDir, MalformedJson) {
  write("tokenizer.json", "{\"model\": {\"type\": \"BPE\",");
  auto tok = load();
  ASSERT_FALSE(tok);
  EXPECT_EQ(tok.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(tok.status().message().rfind(path("tokenizer.json") + ": malformed JSON", 0), 0u)
      << tok.status().message();
}

// A number out of double's range makes nlohmann throw out_of_range rather than parse_error;
// it used to escape (found by the fuzzers, tests/fuzz/).
TEST_F(TokenizerDir, NumberOutOfRangeIsMalformedJson) {
  write("tokenizer.json", R"({"model": {"type": "BPE", "dropout": 1e999}})");
  auto tok = load();
  ASSERT_FALSE(tok);
  EXPECT_EQ(tok.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(tok.status().message().rfind(path("tokenizer.json") + ": malformed JSON", 0), 0u)
      << tok.status().message();
}

// Ids that are not integers in range: a float id (2.2e104 was a float-to-int overflow, found by
// tests/fuzz/tokenizer_fuzz.cpp under UBSan), an id past int32, a Strip decoder's float bounds.
TEST_F(TokenizerDir, IdsMustBeIntegersInRange) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"model": {"type": "BPE", "vocab": {"a": 2.21889e+104}, "merges": []}})",
       "the id of vocab token 'a' must be an integer in [0, 2147483646], got 2.21889e+104"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 1.5}, "merges": []}})",
       "the id of vocab token 'a' must be an integer"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 4294967296}, "merges": []}})",
       "the id of vocab token 'a' must be an integer in [0, 2147483646], got 4294967296"},
      {R"({"model": {"type": "BPE", "vocab": {"a": -1}, "merges": []}})",
       "the id of vocab token 'a' must be an integer in [0, 2147483646], got -1"},
      // Far past the vocabulary's size: the id tables would take gigabytes (found by the fuzzer).
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 666666666}, "merges": []}})",
       "vocab token 'b' has id 666666666, but the vocabulary has 2 tokens: ids must be below its "
       "size plus 1048576"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
           "decoder": {"type": "Strip", "content": " ", "start": 1e300, "stop": 0}})",
       "Strip decoder start must be an integer"},
      // The vocab and merges stream past the document (parse_tokenizer_json): values of the
      // wrong type inside them are named as the document's accessors named them.
      {R"({"model": {"type": "BPE", "vocab": {"a": "0"}, "merges": []}})",
       R"(the id of vocab token 'a' must be an integer in [0, 2147483646], got "0")"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": {"c": 1}}, "merges": []}})",
       "the id of vocab token 'b' must be an integer in [0, 2147483646], got an object"},
      {R"({"model": {"type": "BPE", "vocab": {"a": [0]}, "merges": []}})",
       "the id of vocab token 'a' must be an integer in [0, 2147483646], got an array"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [["a", "b", "a"]]}})",
       "merge 1 is not a pair"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b", ["a"]]}})",
       "merge 2 is not a pair"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [["a", 1]]}})",
       "merge 1 is not a pair"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [7]}})",
       "merge 1 is not a pair"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [{"a": "b"}]}})",
       "merge 1 is not a pair"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [[["a"], "b"]]}})",
       "merge 1 is not a pair"},
  };
  for (const auto& [text, says] : cases) {
    write("tokenizer.json", text);
    auto tok = load();
    ASSERT_FALSE(tok) << text;
    EXPECT_EQ(tok.status().code(), Code::kInvalidArgument) << text;
    EXPECT_NE(tok.status().message().find(says), std::string::npos) << tok.status().message();
  }
}

TEST_F(TokenizerDir, UnsupportedModel) {
  write("tokenizer.json", R"({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})");
  auto tok = load();
  ASSERT_FALSE(tok);
  EXPECT_EQ(tok.status().message(),
            path("tokenizer.json") + ": model type 'Unigram' is not supported (supported: BPE)");
}

TEST_F(TokenizerDir, UnsupportedComponents) {
  const std::pair<const char*, const char*> cases[] = {
      {"normalizer", "normalizer type 'Lowercase' is not supported"},
      {"pre_tokenizer", "pre_tokenizer type 'Whitespace' is not supported"},
      {"decoder", "decoder type 'WordPiece' is not supported"},
      {"post_processor", "post_processor type 'BertProcessing' is not supported"},
  };
  const char* types[] = {"Lowercase", "Whitespace", "WordPiece", "BertProcessing"};
  for (int i = 0; i < 4; ++i) {
    json spec = tiny_bpe();
    spec[cases[i].first] = {{"type", types[i]}};
    write("tokenizer.json", spec.dump());
    auto tok = load();
    ASSERT_FALSE(tok) << cases[i].first;
    EXPECT_NE(tok.status().message().find(path("tokenizer.json") + ": " + cases[i].second),
              std::string::npos)
        << tok.status().message();
  }
}

TEST_F(TokenizerDir, BadMergesAndStructure) {
  json spec = tiny_bpe();
  spec["model"]["merges"] = {"a z"};
  write("tokenizer.json", spec.dump());
  auto tok = load();
  ASSERT_FALSE(tok);
  EXPECT_NE(tok.status().message().find("uses token 'z' that is not in the vocab"),
            std::string::npos)
      << tok.status().message();

  spec = tiny_bpe();
  spec["model"]["vocab"] = "not a map";
  write("tokenizer.json", spec.dump());
  tok = load();
  ASSERT_FALSE(tok);
  EXPECT_NE(tok.status().message().find(path("tokenizer.json") + ": unexpected structure"),
            std::string::npos)
      << tok.status().message();

  spec = tiny_bpe();
  spec["pre_tokenizer"] = {{"type", "Split"},
                           {"pattern", {{"Regex", "(unclosed"}}},
                           {"behavior", "Isolated"},
                           {"invert", false}};
  write("tokenizer.json", spec.dump());
  tok = load();
  ASSERT_FALSE(tok);
  EXPECT_NE(tok.status().message().find("does not compile"), std::string::npos)
      << tok.status().message();
}

TEST_F(TokenizerDir, MalformedConfigNamesIt) {
  write("tokenizer.json", tiny_bpe().dump());
  write("tokenizer_config.json", "{\"bos_token\": ");
  auto tok = load();
  ASSERT_FALSE(tok);
  EXPECT_EQ(tok.status().message().rfind(path("tokenizer_config.json") + ": malformed JSON", 0), 0u)
      << tok.status().message();
}

TEST_F(TokenizerDir, ConfigAndGenerationConfig) {
  json spec = tiny_bpe();
  spec["added_tokens"] = json::parse(R"([
    {"id": 6, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 7, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}])");
  spec["post_processor"] = json::parse(R"({"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A",
               "type_id": 0}}],
    "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [6], "tokens": ["<s>"]}}})");
  write("tokenizer.json", spec.dump());
  write("tokenizer_config.json", R"({"bos_token": {"content": "<s>", "special": true},
    "eos_token": "</s>", "model_max_length": 4096,
    "chat_template": [{"name": "default", "template": "{{ messages }}"},
                      {"name": "tool_use", "template": "{{ tools }}"}]})");
  write("generation_config.json", R"({"bos_token_id": 6, "eos_token_id": [7, 5]})");
  auto tok = load();
  ASSERT_TRUE(tok) << tok.status().to_string();
  EXPECT_EQ((*tok)->bos_id(), 6);
  EXPECT_EQ((*tok)->eos_ids(), (std::vector<int32_t>{7, 5}));
  EXPECT_TRUE((*tok)->add_bos_token());  // from the template
  EXPECT_EQ((*tok)->model_max_length(), 4096);
  EXPECT_EQ((*tok)->chat_template(), "{{ messages }}");
  ASSERT_EQ((*tok)->config().named_chat_templates.size(), 2u);
  EXPECT_EQ((*tok)->encode("abc", true), (std::vector<int32_t>{6, 4}));
  EXPECT_EQ((*tok)->encode("abc</s>", false), (std::vector<int32_t>{4, 7}));
  EXPECT_EQ((*tok)->vocab_size(), 8u);
}

TEST_F(TokenizerDir, ChatTemplateFile) {
  write("tokenizer.json", tiny_bpe().dump());
  write("chat_template.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}");
  auto tok = load();
  ASSERT_TRUE(tok) << tok.status().to_string();
  EXPECT_EQ((*tok)->chat_template(), "{% for m in messages %}{{ m.content }}{% endfor %}");
}

// Hugging Face's BPE: unknown characters become <unk>, fused into one when fuse_unk is set.
TEST(TinyBpeTest, UnknownCharacters) {
  json spec = tiny_bpe();
  auto tok = Tokenizer::from_json(spec.dump());
  ASSERT_TRUE(tok) << tok.status().to_string();
  EXPECT_EQ((*tok)->encode("abcxyab", false), (std::vector<int32_t>{4, 5, 5, 3}));
  EXPECT_EQ((*tok)->decode(std::vector<int32_t>{4, 5, 3}, false), "abc <unk> ab");  // no decoder
  spec["model"]["fuse_unk"] = true;
  tok = Tokenizer::from_json(spec.dump());
  ASSERT_TRUE(tok);
  EXPECT_EQ((*tok)->encode("abcxyab", false), (std::vector<int32_t>{4, 5, 3}));
  spec["model"]["unk_token"] = nullptr;  // no unk: unknown characters vanish
  tok = Tokenizer::from_json(spec.dump());
  ASSERT_TRUE(tok);
  EXPECT_EQ((*tok)->encode("abcxyab", false), (std::vector<int32_t>{4, 3}));
}

// Merges as [a, b] pairs (Qwen's format) mean the same as "a b" strings.
TEST(TinyBpeTest, MergesAsPairs) {
  json spec = tiny_bpe();
  spec["model"]["merges"] = json::parse(R"([["a", "b"], ["ab", "c"]])");
  auto tok = Tokenizer::from_json(spec.dump());
  ASSERT_TRUE(tok) << tok.status().to_string();
  EXPECT_EQ((*tok)->encode("abcab", false), (std::vector<int32_t>{4, 3}));
  EXPECT_EQ((*tok)->encode("abcab", true), (std::vector<int32_t>{4, 3}));  // no post-processor
}

// The vocab and merges stream out of the document only at model.vocab / model.merges: the same
// keys deeper elsewhere stay in the document, merges may come before the vocab, and a token
// listed twice keeps its last id, as a JSON document keeps the last value of a key.
TEST(TinyBpeTest, OnlyTheModelsVocabAndMergesStream) {
  json spec = tiny_bpe();
  json model = spec["model"];
  spec.erase("model");
  spec["extra"] = json::parse(R"({"model": {"vocab": {"zz": 1}, "merges": ["z z"]}})");
  std::string text = spec.dump();
  text.pop_back();  // the model last, its merges first, "c" listed twice (5, then its own 2)
  text += R"(,"model": {"type": "BPE", "merges": )" + model["merges"].dump() +
          R"(, "vocab": {"c": 5, )" + model["vocab"].dump().substr(1) + "}}";
  auto tok = Tokenizer::from_json(text);
  ASSERT_TRUE(tok) << tok.status().to_string();
  auto plain = Tokenizer::from_json(tiny_bpe().dump());
  ASSERT_TRUE(plain);
  EXPECT_EQ((*tok)->encode("abcab", false), (*plain)->encode("abcab", false));
  EXPECT_EQ((*tok)->vocab_size(), (*plain)->vocab_size());
  EXPECT_EQ((*tok)->token_to_id("c"), (*plain)->token_to_id("c"));
}

// single_word looks at Unicode word characters on both sides (Rust's \w: letters, marks,
// decimal digits, connector punctuation; not other numbers such as ①).
TEST(TinyBpeTest, SingleWordUsesUnicodeWordCharacters) {
  json spec = tiny_bpe();
  spec["added_tokens"] = json::parse(R"([{"id": 6, "content": "[W]", "single_word": true,
    "lstrip": false, "rstrip": false, "normalized": false, "special": false}])");
  auto tok = Tokenizer::from_json(spec.dump());
  ASSERT_TRUE(tok) << tok.status().to_string();
  using Ids = std::vector<int32_t>;
  EXPECT_EQ((*tok)->encode("[W]", false), (Ids{6}));
  EXPECT_EQ((*tok)->encode("x[W]", false), (Ids{5, 5, 5, 5}));
  EXPECT_EQ((*tok)->encode("\u00E9[W]", false), (Ids{5, 5, 5, 5}));  // é is a letter
  EXPECT_EQ((*tok)->encode("\u2460[W]", false), (Ids{5, 6}));        // ① is not
  EXPECT_EQ((*tok)->encode("[W]_", false), (Ids{5, 5, 5, 5}));
  EXPECT_FALSE((*tok)->is_special(6));
}

TEST(TinyBpeTest, IllFormedUtf8InputIsRepaired) {
  auto tok = Tokenizer::from_json(tiny_bpe().dump());
  ASSERT_TRUE(tok);
  EXPECT_EQ((*tok)->encode("ab\xFF"
                           "c",
                           false),
            (std::vector<int32_t>{3, 5, 2}));
}

}  // namespace
}  // namespace tessera
