// tokenizer_config.json's flags (legacy, add_prefix_space, add_bos_token, add_eos_token, the
// tokenizer class) against what transformers' AutoTokenizer did with the same patched
// directories (scripts/goldens/tokenizer_flag_goldens.py wrote tests/assets/goldens/
// tokenizer_flags.json on the GPU machine): the ids vLLM would feed the model.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/tokenizer/tokenizer.h"
#include "tests/tokenizer/tokenizer_test_util.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::read_file;
using testing::show;
using testing::tokenizer_dir;

const json& flag_goldens() {
  static const json goldens = [] {
    const std::string path =
        std::string(TESSERA_SOURCE_DIR) + "/tests/assets/goldens/tokenizer_flags.json";
    if (!std::filesystem::exists(path)) {
      ADD_FAILURE() << path << " is missing (scripts/goldens/tokenizer_flag_goldens.py writes it)";
      return json::object();
    }
    return json::parse(read_file(path));
  }();
  return goldens;
}

class FlagsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FlagsTest, IdsAndTextEqualTransformers) {
  const json& g = flag_goldens();
  ASSERT_TRUE(g.contains("tokenizers") && g["tokenizers"].contains(GetParam()));
  const std::string dir = tokenizer_dir(GetParam());
  const std::string tokenizer_json = read_file(dir + "/tokenizer.json");
  const json base_config = json::parse(read_file(dir + "/tokenizer_config.json"));
  int checked = 0;
  // The flags interact only in the SentencePiece pipeline (llama2): every combination there; on
  // the byte-level tokenizers each flag alone (their combinations are as many full loads again,
  // which the sanitizer stage of CI pays for twice over).
  const bool sentencepiece = GetParam() == "llama2";
  for (const json& entry : g["tokenizers"][GetParam()]) {
    if (!sentencepiece && entry["patch"].size() > 1) continue;
    if (!sentencepiece && !entry["patch"].empty() && entry["patch"].begin()->is_null()) continue;
    const std::string what = GetParam() + " with " + entry["patch"].dump();
    if (entry.contains("error")) {
      ADD_FAILURE() << what << ": transformers did not load it:\n" << entry["error"];
      continue;
    }
    json config = base_config;
    for (const auto& [key, value] : entry["patch"].items()) {
      if (value.is_null()) {
        config.erase(key);
      } else {
        config[key] = value;
      }
    }
    auto tok = Tokenizer::from_json(tokenizer_json, config.dump());
    ASSERT_TRUE(tok) << what << ": " << tok.status().to_string();
    for (const json& c : entry["cases"]) {
      const std::string text = c["text"].get<std::string>();
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      EXPECT_EQ((*tok)->encode(text, true), ids) << what << ": " << show(text);
      EXPECT_EQ((*tok)->encode(text, false), c["ids_no_special"].get<std::vector<int32_t>>())
          << what << ": " << show(text) << " without special tokens";
      EXPECT_EQ((*tok)->decode(ids, false), c["decoded"].get<std::string>())
          << what << ": decode of " << show(text);
      EXPECT_EQ((*tok)->decode(ids, true), c["decoded_skip"].get<std::string>())
          << what << ": decode (skipping special tokens) of " << show(text);
      ++checked;
    }
  }
  EXPECT_GT(checked, 100) << "too few cases: regenerate the goldens";  // 9 or 16 patches x 13
}

INSTANTIATE_TEST_SUITE_P(Real, FlagsTest, ::testing::Values("llama3", "qwen3", "llama2"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tessera
