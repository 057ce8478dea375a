#include "driver/generate.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/unicode.h"
#include "driver/cli/cli_help.h"
#include "driver/engine/engine.h"
#include "driver/llm.h"
#include "driver/model_session.h"
#include "driver/server/replica_generate.h"

namespace tessera {

namespace {

// The offset of the first byte of `text` that is not well-formed UTF-8, or nullopt.
std::optional<size_t> invalid_utf8_at(std::string_view text) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD itself is fine
  for (size_t pos = 0; pos < text.size();) {
    const size_t start = pos;
    if (tokenizer::next_code_point(text, pos) == tokenizer::kReplacementChar &&
        text.substr(start, kReplacement.size()) != kReplacement) {
      return start;
    }
  }
  return std::nullopt;
}

// "prompt N is not valid UTF-8 at byte K (0xXX)" (N from 1, K from 0), or OK.
Status check_utf8(std::string_view text, size_t prompt_number, const std::string& where = {}) {
  const auto at = invalid_utf8_at(text);
  if (!at) return Status::ok();
  char byte[8];
  std::snprintf(byte, sizeof(byte), "0x%02x", static_cast<unsigned char>(text[*at]));
  return invalid_argument((where.empty() ? "" : where + ": ") + "prompt " +
                          std::to_string(prompt_number) + " is not valid UTF-8 at byte " +
                          std::to_string(*at) + (where.empty() ? "" : " of the line") + " (" +
                          byte + ")");
}

// One --input prompt: its text, or its token ids.
struct InputPrompt {
  std::optional<std::string> text;
  std::vector<int32_t> ids;
};

// --input: one JSON object per line, {"prompt": "..."} or {"prompt_token_ids": [...]}. Read
// whole before a node starts, so that a bad line fails at once.
Expected<std::vector<InputPrompt>> read_inputs(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("--input: cannot read " + path);
  std::vector<InputPrompt> prompts;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = "--input " + path + " line " + std::to_string(n);
    // JSON text is UTF-8: say where it is not, rather than "not a JSON object".
    TESSERA_RETURN_IF_ERROR(check_utf8(line, prompts.size() + 1, where));
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object()) return invalid_argument(where + ": not a JSON object");
    InputPrompt p;
    if (j.contains("prompt") && j["prompt"].is_string()) {
      p.text = j["prompt"].get<std::string>();
    } else if (j.contains("prompt_token_ids") && j["prompt_token_ids"].is_array()) {
      for (const auto& t : j["prompt_token_ids"]) {
        if (!t.is_number_integer()) return invalid_argument(where + ": token ids are integers");
        p.ids.push_back(t.get<int32_t>());
      }
    } else {
      return invalid_argument(where + ": give \"prompt\" (text) or \"prompt_token_ids\"");
    }
    prompts.push_back(std::move(p));
  }
  if (prompts.empty()) return invalid_argument("--input " + path + " has no prompts");
  return prompts;
}

nlohmann::json result_json(const GenerationResult& r) {
  nlohmann::json lp = nlohmann::json::array();
  for (const auto& l : r.logprobs) {
    nlohmann::json top = nlohmann::json::array();
    for (const auto& [t, p] : l.top) top.push_back({t, p});
    lp.push_back({{"token", l.token}, {"logprob", l.logprob}, {"top", top}});
  }
  return {{"prompt_ids", r.prompt_token_ids},
          {"output_ids", r.token_ids},
          {"text", r.text},
          {"finish_reason", std::string(finish_reason_name(r.finish_reason))},
          {"logprobs", lp}};
}

using Clock = std::chrono::steady_clock;

// What is checked before a node starts or a model loads: the flags, the prompts, --input (read
// whole) and --output (opened).
struct Checked {
  std::vector<InputPrompt> inputs;
  std::unique_ptr<std::ofstream> output;
};

Expected<Checked> check(const GenerateOptions& o) {
  if (o.prompts.empty() == o.input.empty()) {
    return invalid_argument("give --prompt (one or more) or --input FILE.jsonl");
  }
  TESSERA_RETURN_IF_ERROR(validate(o.engine));
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(o.engine.model));
  // The flags' sampling parameters, at once (their prompts are checked as Requests once the
  // tokenizer is loaded).
  TESSERA_RETURN_IF_ERROR(Request::check_sampling(o.sampling, config.vocab_size));
  // Prompts are text: ill-formed UTF-8 is refused, not silently replaced.
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    TESSERA_RETURN_IF_ERROR(check_utf8(o.prompts[i], i + 1).with_context("--prompt"));
  }
  Checked c;
  if (!o.input.empty()) {
    TESSERA_ASSIGN_OR_RETURN(c.inputs, read_inputs(o.input));
  }
  if (!o.output.empty()) {
    c.output = std::make_unique<std::ofstream>(o.output);
    if (!*c.output) return invalid_argument("--output: cannot write " + o.output);
  }
  return c;
}

// Each prompt's text (as the output shows it) and ids: --prompt texts tokenized, or the --input
// lines (text tokenized, ids decoded).
struct Prompts {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
};

Prompts tokenize(const GenerateOptions& o, std::vector<InputPrompt> inputs,
                 const Tokenizer& tokenizer) {
  Prompts p{o.prompts, {}};
  if (!o.input.empty()) {
    for (auto& in : inputs) {
      if (in.text) {
        p.ids.push_back(tokenizer.encode(*in.text, /*add_special_tokens=*/true));
        p.texts.push_back(std::move(*in.text));
      } else {
        p.texts.push_back(tokenizer.decode(in.ids, false));
        p.ids.push_back(std::move(in.ids));
      }
    }
  } else {
    for (const auto& text : p.texts) p.ids.push_back(tokenizer.encode(text, true));
  }
  return p;
}

// Text streams to stdout as it comes for one prompt printed as text.
bool streams(const GenerateOptions& o, const Checked& c, const Prompts& p) {
  return p.texts.size() == 1 && !o.json && !c.output;
}

// The results, in the prompts' order: to --output, as JSON lines, or as text (after the stream).
Status print_results(const GenerateOptions& o, std::ofstream* output, const Prompts& p,
                     const std::vector<GenerationResult>& results, bool stream) {
  if (output) {
    for (size_t i = 0; i < results.size(); ++i) {
      nlohmann::json j = result_json(results[i]);
      j["prompt"] = p.texts[i];
      *output << j.dump() << "\n";
    }
    output->flush();
    if (!*output) return unavailable("--output: writing " + o.output + " failed (disk full?)");
    std::fprintf(stderr, "wrote %zu results to %s\n", results.size(), o.output.c_str());
    // The results are in the file.
  } else if (o.json) {
    for (const auto& r : results) std::cout << result_json(r).dump() << "\n";
  } else if (stream) {
    std::cout << std::endl;  // before the summary on stderr
  } else {
    for (size_t i = 0; i < results.size(); ++i) {
      std::cout << "[" << i << "] " << p.texts[i] << results[i].text << "\n";
    }
  }
  return Status::ok();
}

// The summary line on stderr: the model, the tokens, the load time, the first token's and the
// decode rate after it.
void print_summary(const ModelInfo& m, const std::vector<GenerationResult>& results,
                   Clock::time_point t0, Clock::time_point t_loaded, Clock::time_point t_end) {
  using ms = std::chrono::duration<double, std::milli>;
  size_t prompt_tokens = 0, output_tokens = 0;
  std::optional<Clock::time_point> first;
  for (const auto& r : results) {
    prompt_tokens += r.prompt_token_ids.size();
    output_tokens += r.token_ids.size();
    if (r.first_token && (!first || *r.first_token < *first)) first = r.first_token;
  }
  double decode_ms = first ? ms(t_end - *first).count() : 0.0;
  std::fprintf(
      stderr,
      "[%s, %s backend%s%s, %s, weights %s, KV cache %s] %zu prompt(s), %zu prompt "
      "tokens, %zu output "
      "tokens (%s); load %.0f ms, first token %.0f ms, %.1f tok/s after it\n",
      m.architecture.c_str(), m.backend.c_str(), m.device_name.empty() ? "" : " on ",
      m.device_name.c_str(), m.dtype.c_str(), m.quantization.c_str(), m.kv_cache_dtype.c_str(),
      results.size(), prompt_tokens, output_tokens,
      results.size() == 1 ? finish_reason_name(results[0].finish_reason).data() : "batched",
      ms(t_loaded - t0).count(), first ? ms(*first - t_loaded).count() : 0.0,
      output_tokens > results.size() && decode_ms > 0
          ? (output_tokens - results.size()) / (decode_ms / 1000.0)
          : 0.0);
}

// -dp 1: one engine (LLM).
Status run_one(const GenerateOptions& o, Checked c) {
  auto t0 = Clock::now();
  TESSERA_ASSIGN_OR_RETURN(auto llm, LLM::open(o.engine, "tessera generate"));
  ModelSession* session = &llm->session();
  auto t_loaded = Clock::now();
  const Prompts p = tokenize(o, std::move(c.inputs), session->tokenizer());
  const bool stream = streams(o, c, p);
  TESSERA_ASSIGN_OR_RETURN(auto results,
                           llm->generate(p.ids, o.sampling, [&](size_t, const RequestOutput& out) {
                             if (stream) std::cout << out.delta << std::flush;
                           }));
  auto t_end = Clock::now();
  TESSERA_RETURN_IF_ERROR(print_results(o, c.output.get(), p, results, stream));
  if (session->plan().plan.world > 1 || !session->plan().choice.empty()) {
    std::fputs(plan_summary(session->plan()).c_str(), stderr);
  }
  print_summary(session->model(), results, t0, t_loaded, t_end);
  return Status::ok();
}

// -dp N or auto: the prompts spread over the replicas, then a line per replica.
Status run_replicas(const GenerateOptions& o, Checked c) {
  auto t0 = Clock::now();
  TESSERA_ASSIGN_OR_RETURN(auto replicas,
                           server::ReplicaSet::start(o.engine, o.replicas, "tessera generate"));
  auto t_loaded = Clock::now();
  const Prompts p = tokenize(o, std::move(c.inputs), replicas->session().tokenizer());
  std::vector<Request> requests;
  requests.reserve(p.ids.size());
  for (size_t i = 0; i < p.ids.size(); ++i) {
    auto r = Request::make(p.ids[i], o.sampling, replicas->loaded());
    if (!r) return r.status().with_context("prompt " + std::to_string(i));
    requests.push_back(std::move(*r));
  }
  const bool stream = streams(o, c, p);
  TESSERA_ASSIGN_OR_RETURN(server::ReplicaGeneration g,
                           server::generate_on_replicas(*replicas, std::move(requests),
                                                        [&](size_t, const RequestOutput& out) {
                                                          if (stream)
                                                            std::cout << out.delta << std::flush;
                                                        }));
  auto t_end = Clock::now();
  TESSERA_RETURN_IF_ERROR(print_results(o, c.output.get(), p, g.results, stream));
  print_summary(replicas->loaded(), g.results, t0, t_loaded, t_end);
  for (size_t i = 0; i < g.replicas.size(); ++i) {
    const server::ReplicaRun& r = g.replicas[i];
    std::fprintf(stderr,
                 "replica %zu ran %llu request(s): %llu prompt tokens, %llu output tokens\n", i,
                 static_cast<unsigned long long>(r.requests),
                 static_cast<unsigned long long>(r.prompt_tokens),
                 static_cast<unsigned long long>(r.output_tokens));
  }
  return Status::ok();
}

Status run(const GenerateOptions& o) {
  // Everything that can be checked is checked before a node starts or a model loads.
  TESSERA_ASSIGN_OR_RETURN(Checked c, check(o));
  if (o.replicas.data_parallel_size.ranks == 1) return run_one(o, std::move(c));
  return run_replicas(o, std::move(c));
}

}  // namespace

CLI::App* add_generate_subcommand(CLI::App& app, GenerateOptions& gen) {
  gen.sampling.max_tokens = 64;
  auto* gen_cmd = app.add_subcommand("generate", "Generate completions for one or more prompts");
  add_engine_options(gen_cmd, gen.engine);
  server::add_replica_options(gen_cmd, gen.replicas);
  gen_cmd->add_option("--prompt", gen.prompts, "The prompt text (repeat for a batch)");
  gen_cmd->add_option("--input", gen.input,
                      "A JSONL file of {\"prompt\": ...} or {\"prompt_token_ids\": [...]}");
  gen_cmd->add_option("--output", gen.output, "Write the results as JSONL here");
  gen_cmd->add_option("--max-tokens", gen.sampling.max_tokens, "Tokens to generate (64)");
  gen_cmd->add_option("--temperature", gen.sampling.temperature, "0 = greedy (default 1.0)");
  gen_cmd->add_option("--top-p", gen.sampling.top_p, "Nucleus sampling mass (1.0 = off)");
  gen_cmd->add_option("--top-k", gen.sampling.top_k, "Keep the k most likely (-1 = off)");
  gen_cmd->add_option("--min-p", gen.sampling.min_p, "Drop tokens below min_p x the top (0 = off)");
  gen_cmd->add_option("--seed", gen.sampling.seed,
                      "The run's random seed: every prompt's sampler (default: unseeded)");
  gen_cmd->add_option("--repetition-penalty", gen.sampling.repetition_penalty, "(1.0 = off)");
  gen_cmd->add_option("--presence-penalty", gen.sampling.presence_penalty, "(0 = off)");
  gen_cmd->add_option("--frequency-penalty", gen.sampling.frequency_penalty, "(0 = off)");
  gen_cmd->add_option("--stop", gen.sampling.stop, "Stop strings (repeatable)");
  gen_cmd->add_option("--stop-token-ids", gen.sampling.stop_token_ids,
                      "Token ids that end generation");
  gen_cmd->add_flag("--ignore-eos", gen.sampling.ignore_eos, "Keep going past EOS");
  gen_cmd->add_option("--logprobs", gen.sampling.logprobs, "Return top-N logprobs per token");
  gen_cmd->add_flag("--json", gen.json, "Print ids, text and logprobs as JSON, a line per prompt");
  add_examples(gen_cmd, {"tessera generate --model ./Llama-3.1-8B-Instruct --prompt \"Hello\" "
                         "--max-tokens 32 --temperature 0"});
  return gen_cmd;
}

int generate_command(const GenerateOptions& options) {
  return command_exit(run(options), "tessera generate");
}

}  // namespace tessera
