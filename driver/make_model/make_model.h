// `tessera make-model`: writes a complete Hugging Face model directory with seeded random
// weights, of a tiny test shape or of a real published model's shape, so the runtime can be
// exercised (and compared with transformers on a GPU machine) without downloading weights.
//
// The directory holds config.json (keys as transformers writes them for the architecture),
// generation_config.json, model.safetensors or shards + model.safetensors.index.json, and copies
// of tokenizer.json and tokenizer_config.json (plus special_tokens_map.json and
// chat_template.jinja when the tokenizer directory has them). config.json is written last, so a
// directory with a config.json is complete.
//
// Weights: every tensor is generated from (seed, tensor name) alone by a counter-based PRNG
// (splitmix64), so each is reproducible independently and the same seed gives identical bytes.
// Values are approximately normal (a sum of four uniforms; |z| < 3.5):
//   embed_tokens            N(0, 1/sqrt(hidden))        — tied logits come out O(1)
//   q/k/v/gate/up, lm_head  N(0, 1/sqrt(in_features))   — each projection keeps unit scale, so
//                                                          attention is far from uniform
//   o_proj, down_proj       N(0, 1/sqrt(in_features · 2 · layers)) — the residual stream stays
//                                                          O(1) through any depth
//   norm weights            1 + N(0, 0.1)               — a missing or misplaced norm shows
//                           (Gemma: N(0, 0.1), its norms scale by 1 + w)
//   biases                  N(0, 0.1)
// Writing streams tensor by tensor through a bounded buffer: memory stays small for any size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/checkpoint/model_config.h"
#include "common/status.h"

namespace CLI {
class App;
}

namespace tessera {

struct MakeModelOptions {
  // "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
  // "gemma3" (the text model), "phi3" (or the HF class name). Required for "tiny"; optional
  // for a real-shape preset, which implies it (given, it must match).
  std::string arch;
  std::string preset;         // "tiny" or a real shape; see make_model_presets()
  std::string tokenizer_dir;  // must hold tokenizer.json (tokenizer_config.json recommended)
  uint64_t seed = 0;
  std::string dtype = "bf16";  // "bf16" | "fp16" | "fp32" (also bfloat16 / float16 / float32)
  std::string out;             // created if absent; refused if it exists and is not empty
  uint64_t max_shard_bytes = 5ull << 30;
  // --config-only: config.json, generation_config.json and the tokenizer files, no weights: a
  // shape to run with --load-format dummy (weights made on the GPU) when no disk holds it.
  bool config_only = false;
  // Replace the preset's figures where non-zero (tiny models of unusual shapes for tests:
  // head sizes, GQA ratios, vocabulary sizes). head_dim 0 keeps the preset's rule (its explicit
  // head_dim, else hidden_size / num_heads); vocab_size may not be below the tokenizer's.
  struct Overrides {
    int64_t hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0,
            head_dim = 0, vocab_size = 0;
  } overrides;
  // --quantization awq|gptq|fp8: the linear layers (q, k, v, o, gate, up, down) as that format's
  // exporter writes them, with its quantization_config in config.json: quantized from the
  // float weights the same seed draws (common/checkpoint/quantization.h's quantize_linear).
  struct Quantization {
    std::string method = "none";          // none | awq | gptq | fp8
    int bits = 4;                         // gptq: 4 or 8
    int64_t group_size = 128;             // awq / gptq: 32, 64, 128; gptq -1: one group
    bool desc_act = false;                // gptq: groups of a permutation (act-order)
    bool asym = false;                    // gptq: zero points (default symmetric)
    std::string weight_scale = "tensor";  // fp8: tensor | channel (compressed-tensors)
    std::string activations = "dynamic";  // fp8: dynamic | static | none (W8A16)
  } quantization;
};

// One preset: its name, architecture and the model whose published config.json it copies.
struct MakeModelPreset {
  std::string name;
  Architecture arch;
  std::string source;  // e.g. "meta-llama/Meta-Llama-3-8B"; "" for tiny
};

// Every preset ("tiny" appears once per architecture).
std::vector<MakeModelPreset> make_model_presets();

// The config.json make_model would write for `options` (pretty-printed, sorted keys), with the
// vocab size and special-token ids taken from the tokenizer. Errors as make_model's, minus the
// output-directory checks. Exposed for tests and `--dry-run`-style tooling.
Expected<std::string> make_model_config_json(const MakeModelOptions& options);

// The QuantConfig `q` asks make-model to write (method kNone for none); INVALID_ARGUMENT naming
// the flag for a value the format does not have.
Expected<QuantConfig> make_model_quantization(const MakeModelOptions::Quantization& q);

// Writes the model directory. INVALID_ARGUMENT for an unknown arch/preset/dtype, an arch that
// contradicts the preset, a tokenizer larger than the preset's vocab_size, an --out that exists
// and is not an empty directory; NOT_FOUND for a tokenizer directory without tokenizer.json;
// I/O errors name the file. On failure a partial directory (without config.json) may remain.
Status make_model(const MakeModelOptions& options);

// Adds the `make-model` subcommand to `app`, binding its flags to `options`
// (--arch, --preset, --tokenizer, --seed, --dtype, --out, --max-shard-size with a unit such as
// 5GB or 500MiB). The caller runs make_model_command(options) when the subcommand was parsed.
CLI::App* add_make_model_subcommand(CLI::App& app, MakeModelOptions& options);

// `tessera make-model`: make_model, then "Wrote DIR" on stdout; returns the exit code (0 ok,
// 1 failed: the reason on stderr prefixed "tessera make-model: ").
int make_model_command(const MakeModelOptions& options);

}  // namespace tessera
