// Fuzzes config.json / generation_config.json parsing through load_model_config on a model
// directory. The input is config.json's text, optionally followed by a NUL and
// generation_config.json's. A config that loads must satisfy what parse_model_config promises
// (positive sizes, head counts that divide, an even head_dim, eos ids below vocab_size), and
// expected_weights() of it must be computable.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace fs = std::filesystem;

// A directory for this process's model files, removed at exit.
struct ModelDir {
  fs::path path =
      fs::temp_directory_path() / ("tessera-model-config-fuzz-" + std::to_string(::getpid()));
  ModelDir() { fs::create_directories(path); }
  ~ModelDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  static ModelDir dir;
  auto parts = fuzz::split_input(data, size, 2);
  write(dir.path / "config.json", parts[0]);
  const fs::path gen = dir.path / "generation_config.json";
  std::error_code ec;
  fs::remove(gen, ec);
  if (parts.size() == 2) write(gen, parts[1]);

  GenerationDefaults defaults;
  Expected<ModelConfig> cfg = load_model_config(dir.path.string(), &defaults);
  if (!cfg) {
    FUZZ_CHECK(!cfg.status().message().empty());
    return 0;
  }
  FUZZ_CHECK(cfg->vocab_size > 0 && cfg->hidden_size > 0 && cfg->intermediate_size > 0);
  FUZZ_CHECK(cfg->num_layers > 0 && cfg->num_heads > 0 && cfg->num_kv_heads > 0);
  FUZZ_CHECK(cfg->num_heads % cfg->num_kv_heads == 0);
  FUZZ_CHECK(cfg->head_dim > 0 && cfg->head_dim % 2 == 0);
  for (int64_t id : cfg->eos_token_ids) FUZZ_CHECK(id >= 0 && id < cfg->vocab_size);
  FUZZ_CHECK(architecture_name(cfg->arch) != nullptr);
  // expected_weights() lists every layer: bound the count so a config with a billion layers
  // does not spend the run allocating names.
  if (cfg->num_layers <= 64) {
    std::vector<WeightSpec> weights = expected_weights(*cfg);
    FUZZ_CHECK(!weights.empty());
    for (const WeightSpec& w : weights) {
      for (int64_t d : w.shape) FUZZ_CHECK(d > 0);
    }
  }
  return 0;
}
