#include "driver/bench.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "common/checkpoint/safetensors.h"
#include "common/kv_cache_dtype.h"
#include "driver/cli/cli_help.h"
#include "driver/server/replica_generate.h"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// What every bench JSON starts with: the command, the model, and the machine it ran on.
nlohmann::json run_json(const std::string& command, const std::string& model, const ModelInfo& m) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return {{"command", command},
          {"model", model},
          {"architecture", m.architecture},
          {"dtype", m.dtype},
          {"kv_cache_dtype", m.kv_cache_dtype},
          {"quantization", m.quantization},
          {"backend", m.backend},
          {"device", m.device_name},
          {"hostname", host}};
}

// The routings of a run (`after` less `before`, the counts at its start) as the bench JSON's
// "expert_load": per MoE layer the tokens each expert took and the busiest expert's share
// against the mean (1.0: perfectly even), and the same over the run per step. Null for a
// dense model.
nlohmann::json expert_load_json(const ExpertLoad& before, const ExpertLoad& after) {
  if (after.empty() || after.num_experts <= 0) return nullptr;
  const size_t E = static_cast<size_t>(after.num_experts);
  const bool same = before.layers == after.layers && before.num_experts == after.num_experts;
  const uint64_t steps = after.steps - (same ? before.steps : 0);
  nlohmann::json layers = nlohmann::json::array();
  double worst = 0, sum_ratio = 0, total = 0;
  for (size_t l = 0; l < after.layers.size(); ++l) {
    std::vector<uint64_t> tokens(E);
    uint64_t all = 0, most = 0, least = UINT64_MAX;
    for (size_t e = 0; e < E; ++e) {
      tokens[e] = after.tokens[l * E + e] - (same ? before.tokens[l * E + e] : 0);
      all += tokens[e];
      most = std::max(most, tokens[e]);
      least = std::min(least, tokens[e]);
    }
    const double mean = static_cast<double>(all) / static_cast<double>(E);
    const double ratio = mean > 0 ? static_cast<double>(most) / mean : 0;
    worst = std::max(worst, ratio);
    sum_ratio += ratio;
    total += static_cast<double>(all);
    layers.push_back({{"layer", after.layers[l]},
                      {"tokens_per_expert", tokens},
                      {"max_over_mean", ratio},
                      {"min_over_mean", mean > 0 ? static_cast<double>(least) / mean : 0}});
  }
  const double n_layers = static_cast<double>(after.layers.size());
  return {
      {"num_experts", after.num_experts},
      {"steps", steps},
      {"tokens_per_expert_per_step",
       steps > 0 ? total / n_layers / static_cast<double>(E) / static_cast<double>(steps) : 0.0},
      {"max_over_mean", worst},
      {"mean_max_over_mean", sum_ratio / n_layers},
      {"layers", layers}};
}

// `bench throughput`'s workload and rates, with one replica or many.
nlohmann::json throughput_figures(const BenchThroughputOptions& o, size_t requests,
                                  size_t input_tokens, size_t output_tokens, double wall) {
  const double in_s = static_cast<double>(input_tokens) / wall;
  const double out_s = static_cast<double>(output_tokens) / wall;
  return {{"num_requests", requests},
          {"dataset", o.dataset_path.empty() ? "random" : o.dataset_path},
          {"input_len", o.dataset_path.empty() ? o.input_len : 0},
          {"output_len", o.dataset_path.empty() ? o.output_len : 0},
          {"input_tokens", input_tokens},
          {"output_tokens", output_tokens},
          {"elapsed_s", wall},
          {"requests_per_second", static_cast<double>(requests) / wall},
          {"input_tokens_per_second", in_s},
          {"output_tokens_per_second", out_s},
          {"total_tokens_per_second", in_s + out_s}};
}

}  // namespace

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = q / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(rank);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

void add_bench_output_options(CLI::App* cmd, std::string& output_json, bool& json) {
  cmd->add_option("--output-json", output_json, "Write the results as JSON here");
  cmd->add_flag("--json", json, "Print the results as JSON on stdout (the text goes to stderr)");
}

Status write_json(const std::string& path, const nlohmann::json& j, FILE* say_to) {
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  f.close();
  if (!f) return internal_error("cannot write " + path);
  std::fprintf(say_to, "wrote %s\n", path.c_str());
  return Status::ok();
}

void BenchOutput::say(const char* format, ...) const {
  va_list args;
  va_start(args, format);
  std::vfprintf(text_, format, args);
  va_end(args);
}

void BenchOutput::table(const std::vector<std::vector<std::string>>& rows,
                        const std::string& align) const {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string pad(width[c] - row[c].size(), ' ');
      const bool left = c < align.size() ? align[c] == 'l' : false;
      line += "  " + (left ? row[c] + pad : pad + row[c]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::fprintf(text_, "%s\n", line.c_str());
  }
}

Status BenchOutput::finish(const std::string& output_json, const nlohmann::json& j) const {
  if (!output_json.empty()) TESSERA_RETURN_IF_ERROR(write_json(output_json, j, text_));
  if (json_) std::printf("%s\n", j.dump(2).c_str());
  return Status::ok();
}

namespace {

std::vector<int32_t> random_prompt(std::mt19937_64& rng, int64_t vocab, uint32_t len) {
  // Ids from the low part of the vocabulary: ordinary tokens, never special ones.
  std::uniform_int_distribution<int32_t> dist(
      100, static_cast<int32_t>(std::min<int64_t>(vocab, 32000) - 1));
  std::vector<int32_t> ids(len);
  for (auto& id : ids) id = dist(rng);
  return ids;
}

SamplingParams greedy(uint32_t max_tokens) {
  SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = static_cast<int>(max_tokens);
  s.ignore_eos = true;
  return s;
}

// Queues a benchmark's request, made against the model its engine runs (request.h).
Expected<uint64_t> add(LlmEngine& engine, std::vector<int32_t> prompt, SamplingParams sampling) {
  TESSERA_ASSIGN_OR_RETURN(
      Request r, Request::make(std::move(prompt), std::move(sampling), engine.config().model));
  return engine.add_request(std::move(r));
}

// Timings of a batch of requests run to completion.
struct BatchTiming {
  double ttft_s = 0;                   // add -> the first token of the first request
  double all_first_s = 0;              // add -> every request has its first token
  double end_s = 0;                    // add -> all finished
  std::vector<double> decode_steps_s;  // steps after every request had its first token
  // Of those steps: the RPC call as the driver saw it, the actor's execute, its GPU forward.
  std::vector<double> call_ms, actor_ms, gpu_ms;
  // The same, summed over the steps before (the prompts' prefill, the first tokens).
  double first_call_ms = 0, first_actor_ms = 0, first_gpu_ms = 0;
  size_t tokens = 0;
};

Expected<BatchTiming> run_batch(ModelSession& session,
                                const std::vector<std::vector<int32_t>>& prompts,
                                uint32_t output_len) {
  LlmEngine& engine = session.engine();
  BatchTiming t;
  auto t0 = Clock::now();
  std::map<uint64_t, bool> started;
  for (const auto& p : prompts) {
    TESSERA_ASSIGN_OR_RETURN(uint64_t id, add(engine, p, greedy(output_len)));
    started[id] = false;
  }
  size_t waiting = prompts.size();
  while (engine.has_unfinished()) {
    auto s0 = Clock::now();
    TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
    auto s1 = Clock::now();
    const bool decoding = waiting == 0;
    for (const auto& o : outs) {
      if (o.finished && o.finish_reason == FinishReason::kError) {
        return internal_error(o.error.message());
      }
      t.tokens += o.new_tokens.size();
      if (!o.new_tokens.empty() && !started[o.request_id]) {
        started[o.request_id] = true;
        if (waiting == prompts.size()) t.ttft_s = seconds(s1 - t0);
        if (--waiting == 0) t.all_first_s = seconds(s1 - t0);
      }
    }
    const auto& times = session.group().last_times();
    if (decoding) {
      t.decode_steps_s.push_back(seconds(s1 - s0));
      t.call_ms.push_back(times.call_us / 1000.0);
      t.actor_ms.push_back(times.actor_us / 1000.0);
      t.gpu_ms.push_back(times.gpu_us / 1000.0);
    } else {
      t.first_call_ms += times.call_us / 1000.0;
      t.first_actor_ms += times.actor_us / 1000.0;
      t.first_gpu_ms += times.gpu_us / 1000.0;
    }
  }
  t.end_s = seconds(Clock::now() - t0);
  return t;
}

void merge(BatchTiming& into, const BatchTiming& t) {
  auto add = [](std::vector<double>& a, const std::vector<double>& b) {
    a.insert(a.end(), b.begin(), b.end());
  };
  add(into.decode_steps_s, t.decode_steps_s);
  add(into.call_ms, t.call_ms);
  add(into.actor_ms, t.actor_ms);
  add(into.gpu_ms, t.gpu_ms);
}

// Medians of the decode steps: the whole step in the driver, the RPC call, the actor's execute
// and its GPU forward pass. step - call = the driver's scheduling and bookkeeping; call - actor =
// the RPC; actor - gpu = staging, launch and sampling in the actor.
void add_step_breakdown(nlohmann::json& j, const BatchTiming& t) {
  std::vector<double> step_ms;
  for (double s : t.decode_steps_s) step_ms.push_back(s * 1000);
  j["step_ms_median"] = percentile(step_ms, 50);
  j["rpc_call_ms_median"] = percentile(t.call_ms, 50);
  j["actor_execute_ms_median"] = percentile(t.actor_ms, 50);
  j["gpu_forward_ms_median"] = percentile(t.gpu_ms, 50);
}

// The medians of the decode steps as rows of the report's table.
void add_breakdown_rows(std::vector<std::vector<std::string>>& rows, const std::string& scenario,
                        const BatchTiming& t) {
  std::vector<double> step_ms;
  for (double s : t.decode_steps_s) step_ms.push_back(s * 1000);
  rows.push_back({scenario, "decode step (median)", fixed(percentile(step_ms, 50), 3), "ms"});
  rows.push_back({"", "  RPC call", fixed(percentile(t.call_ms, 50), 3), "ms"});
  rows.push_back({"", "  actor execute", fixed(percentile(t.actor_ms, 50), 3), "ms"});
  rows.push_back({"", "  GPU forward", fixed(percentile(t.gpu_ms, 50), 3), "ms"});
}

Status run_report(const BenchReportOptions& o) {
  const BenchOutput text(o.json);
  EngineArgs args = o.engine;
  EngineSpec& mem = args;
  mem.max_num_seqs = std::max<int64_t>(mem.max_num_seqs, std::max<int64_t>(o.batch_size, 1));
  mem.max_num_batched_tokens = resolve_max_num_batched_tokens(
      mem.max_num_batched_tokens,
      std::max<int64_t>(o.prefill_len, int64_t{o.batch_size} * o.input_len));
  TESSERA_ASSIGN_OR_RETURN(auto session, ModelSession::open(args, "tessera bench", false));
  const ModelConfig& c = session->config();
  const ModelInfo& m = session->model();
  std::mt19937_64 rng(o.seed);
  const int64_t params = matmul_parameters(c);
  const size_t es = m.dtype == "F32" ? 4 : 2;
  // The bytes a batch-1 decode step reads at least: the matmul weights in the run dtype; for a
  // quantized model (on the GPU) the weights as stored (packed, scales included) less the
  // embedding table, of which a step reads one row (unless lm_head is that table).
  const uint64_t embedding_bytes =
      c.tie_word_embeddings ? 0 : static_cast<uint64_t>(c.vocab_size * c.hidden_size) * es;
  const uint64_t decode_bytes =
      m.quantization == "none" || m.backend != "cuda"
          ? static_cast<uint64_t>(params) * es
          : m.weight_bytes - std::min(m.weight_bytes, embedding_bytes);
  nlohmann::json scenarios = nlohmann::json::object();
  text.say("%s on %s (%s backend, %s), loaded in %.1f s\n", m.architecture.c_str(),
           m.device_name.empty() ? "the CPU" : m.device_name.c_str(), m.backend.c_str(),
           m.dtype.c_str(), session->load_seconds());

  std::vector<std::vector<std::string>> rows = {{"scenario", "figure", "value", "unit"}};
  // Batch-1 decode.
  {
    std::vector<double> ttft, tok_s;
    BatchTiming all;
    for (uint32_t i = 0; i < o.num_iters_warmup + o.num_iters; ++i) {
      std::vector<std::vector<int32_t>> prompts{random_prompt(rng, c.vocab_size, o.input_len)};
      TESSERA_ASSIGN_OR_RETURN(BatchTiming t, run_batch(*session, prompts, o.output_len));
      if (i < o.num_iters_warmup) continue;
      ttft.push_back(t.ttft_s * 1000);
      tok_s.push_back((o.output_len - 1) / (t.end_s - t.all_first_s));
      merge(all, t);
    }
    scenarios["batch1_decode"] = {
        {"batch_size", 1},           {"input_len", o.input_len}, {"output_len", o.output_len},
        {"iterations", o.num_iters}, {"ttft_ms", ttft},          {"decode_tok_s", tok_s}};
    add_step_breakdown(scenarios["batch1_decode"], all);
    const std::string name = "batch 1, " + std::to_string(o.input_len) + " in / " +
                             std::to_string(o.output_len) + " out";
    rows.push_back({name, "TTFT (median)", fixed(percentile(ttft, 50), 2), "ms"});
    rows.push_back({"", "decode (median)", fixed(percentile(tok_s, 50), 1), "tok/s"});
    add_breakdown_rows(rows, "", all);
  }
  // One long prefill: the time to its first token.
  if (o.prefill_len > 0) {
    // TTFT, and of it the RPC calls, the actor's execute and the GPU forward of the steps up to
    // the first token (one step unless --max-num-batched-tokens chunks the prompt).
    std::vector<double> ms, call_ms, actor_ms, gpu_ms;
    for (uint32_t i = 0; i < 1 + o.prefill_iters; ++i) {
      std::vector<std::vector<int32_t>> prompts{random_prompt(rng, c.vocab_size, o.prefill_len)};
      TESSERA_ASSIGN_OR_RETURN(BatchTiming t, run_batch(*session, prompts, 1));
      if (i == 0) continue;
      ms.push_back(t.ttft_s * 1000);
      call_ms.push_back(t.first_call_ms);
      actor_ms.push_back(t.first_actor_ms);
      gpu_ms.push_back(t.first_gpu_ms);
    }
    const double best = *std::min_element(ms.begin(), ms.end());
    const double L = o.prefill_len;
    const double flops = 2.0 * static_cast<double>(params) * L +
                         4.0 * c.num_layers * c.num_heads * c.head_dim * L * L / 2.0;
    scenarios["prefill_" + std::to_string(o.prefill_len)] = {
        {"input_len", o.prefill_len},
        {"iterations", o.prefill_iters},
        {"ms", ms},
        {"best_ms", best},
        {"tok_s", L / (best / 1000)},
        {"tflops", flops / (best / 1000) / 1e12},
        {"flops_formula", "2 * matmul_params * L + 4 * layers * heads * head_dim * L^2 / 2"},
        {"rpc_call_ms_median", percentile(call_ms, 50)},
        {"actor_execute_ms_median", percentile(actor_ms, 50)},
        {"gpu_forward_ms_median", percentile(gpu_ms, 50)}};
    const std::string name = "prefill " + std::to_string(o.prefill_len) + " tokens";
    rows.push_back({name, "best of " + std::to_string(o.prefill_iters), fixed(best, 2), "ms"});
    rows.push_back({"", "", fixed(L / (best / 1000), 0), "tok/s"});
    rows.push_back({"", "", fixed(flops / (best / 1000) / 1e12, 1), "TFLOP/s"});
    rows.push_back({"", "  RPC call (median)", fixed(percentile(call_ms, 50), 3), "ms"});
    rows.push_back({"", "  actor execute", fixed(percentile(actor_ms, 50), 3), "ms"});
    rows.push_back({"", "  GPU forward", fixed(percentile(gpu_ms, 50), 3), "ms"});
  }
  // Large-batch decode.
  if (o.batch_size > 0) {
    std::vector<double> tok_s;
    BatchTiming all;
    for (uint32_t i = 0; i < 1 + o.batch_iters; ++i) {
      std::vector<std::vector<int32_t>> prompts;
      for (uint32_t b = 0; b < o.batch_size; ++b) {
        prompts.push_back(random_prompt(rng, c.vocab_size, o.input_len));
      }
      TESSERA_ASSIGN_OR_RETURN(BatchTiming t, run_batch(*session, prompts, o.output_len));
      if (i == 0) continue;
      tok_s.push_back(static_cast<double>(o.batch_size) * (o.output_len - 1) /
                      (t.end_s - t.all_first_s));
      merge(all, t);
    }
    const std::string name = "batch" + std::to_string(o.batch_size) + "_decode";
    scenarios[name] = {{"batch_size", o.batch_size},
                       {"input_len", o.input_len},
                       {"output_len", o.output_len},
                       {"iterations", o.batch_iters},
                       {"decode_tok_s", tok_s}};
    add_step_breakdown(scenarios[name], all);
    const std::string label = "batch " + std::to_string(o.batch_size) + " decode";
    rows.push_back({label, "decode (median)", fixed(percentile(tok_s, 50), 0), "tok/s"});
    add_breakdown_rows(rows, "", all);
  }
  text.table(rows, "llrl");
  nlohmann::json j = run_json(o.command_line, o.engine.model, m);
  j.update({{"enforce_eager", o.engine.enforce_eager},
            {"detokenize", false},
            {"weight_bytes", m.weight_bytes},
            {"matmul_parameters", params},
            {"decode_bytes_per_token", decode_bytes},
            {"kv_blocks", m.kv_blocks},
            {"load_seconds", session->load_seconds()},
            {"scenarios", scenarios}});
  TESSERA_RETURN_IF_ERROR(text.finish(o.output_json, j));
  return Status::ok();
}

Status run_latency(const BenchLatencyOptions& o) {
  const BenchOutput text(o.json);
  if (o.batch_size == 0) return invalid_argument("--batch-size must be at least 1");
  if (o.input_len == 0 || o.output_len == 0) {
    return invalid_argument("--input-len and --output-len must be at least 1");
  }
  if (o.num_iters == 0) return invalid_argument("--num-iters must be at least 1");
  EngineArgs args = o.engine;
  EngineSpec& mem = args;
  // The whole batch runs in one step, as vLLM's benchmark sizes its engine for it.
  mem.max_num_seqs = std::max<int64_t>(mem.max_num_seqs, o.batch_size);
  mem.max_num_batched_tokens = resolve_max_num_batched_tokens(mem.max_num_batched_tokens,
                                                              int64_t{o.batch_size} * o.input_len);
  TESSERA_ASSIGN_OR_RETURN(auto session, ModelSession::open(args, "tessera bench", false));
  const ModelInfo& m = session->model();
  const int64_t vocab = session->config().vocab_size;
  text.say("%s on %s (%s backend, %s), loaded in %.1f s: batch %u, %u in / %u out\n",
           m.architecture.c_str(), m.device_name.empty() ? "the CPU" : m.device_name.c_str(),
           m.backend.c_str(), m.dtype.c_str(), session->load_seconds(), o.batch_size, o.input_len,
           o.output_len);
  std::fflush(text.text());
  LlmEngine& engine = session->engine();
  const uint32_t total = o.num_iters_warmup + o.num_iters;
  std::vector<double> latencies;
  for (uint32_t i = 0; i < total; ++i) {
    // Fresh prompts each iteration (seed + i), so the prefix cache never shortens a prefill.
    const auto prompts =
        random_bench_prompts(o.batch_size, o.input_len, o.output_len, o.seed + i, vocab);
    const auto t0 = Clock::now();
    for (size_t r = 0; r < prompts.size(); ++r) {
      SamplingParams s;
      s.temperature = 1.0f;
      s.seed = o.seed + i * o.batch_size + r;
      s.max_tokens = static_cast<int>(o.output_len);
      s.ignore_eos = true;
      TESSERA_RETURN_IF_ERROR(add(engine, prompts[r].ids, s).status());
    }
    while (engine.has_unfinished()) {
      TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
      for (const auto& out : outs) {
        if (out.finished && out.finish_reason == FinishReason::kError) {
          return internal_error(out.error.message());
        }
      }
    }
    const double s = seconds(Clock::now() - t0);
    const bool warm = i < o.num_iters_warmup;
    if (!warm) latencies.push_back(s);
    std::fprintf(stderr, "bench latency: %s iteration %u of %u: %.4f s\n",
                 warm ? "warm-up" : "measured", warm ? i + 1 : i + 1 - o.num_iters_warmup,
                 warm ? o.num_iters_warmup : o.num_iters, s);
  }
  double sum = 0;
  for (double l : latencies) sum += l;
  const double avg = sum / static_cast<double>(latencies.size());
  text.say("Avg latency: %.6f seconds\n", avg);
  nlohmann::json pct = nlohmann::json::object();
  for (int q : {10, 25, 50, 75, 90, 99}) {
    const double v = percentile(latencies, q);
    text.say("%d%% percentile latency: %.6f seconds\n", q, v);
    pct[std::to_string(q)] = v;
  }
  nlohmann::json j = run_json(o.command_line, o.engine.model, m);
  j.update({{"tensor_parallel_size", session->plan().plan.tp},
            {"pipeline_parallel_size", session->plan().plan.pp},
            {"batch_size", o.batch_size},
            {"input_len", o.input_len},
            {"output_len", o.output_len},
            {"num_iters_warmup", o.num_iters_warmup},
            {"num_iters", o.num_iters},
            {"avg_latency", avg},
            {"latencies", latencies},
            {"percentiles", pct}});
  TESSERA_RETURN_IF_ERROR(text.finish(o.output_json, j));
  return Status::ok();
}

Status run_control_plane(const BenchControlPlaneOptions& o) {
  const BenchOutput text(o.json);
  if (o.transport != "ring" && o.transport != "rpc") {
    return invalid_argument("--transport must be ring or rpc, got '" + o.transport + "'");
  }
  if (o.num_steps == 0) return invalid_argument("--num-steps must be at least 1");
  EngineArgs args = o.engine;
  args.step_rings = o.transport == "ring";
  TESSERA_ASSIGN_OR_RETURN(auto session, ModelSession::open(args, "tessera bench", false));
  const ModelInfo& m = session->model();
  WorkerGroup& group = session->group();
  text.say("%s on %s (%s backend), %d rank(s), steps over %s: %u empty steps\n",
           m.architecture.c_str(), m.device_name.empty() ? "the CPU" : m.device_name.c_str(),
           m.backend.c_str(), group.world_size(),
           o.transport == "ring" ? "shared-memory rings" : "execute RPCs", o.num_steps);
  std::fflush(text.text());
  std::vector<double> round_us, actor_us;
  round_us.reserve(o.num_steps);
  actor_us.reserve(o.num_steps);
  const uint32_t total = o.num_warmup + o.num_steps;
  for (uint32_t i = 0; i < total; ++i) {
    StepInput step;
    step.step_id = i + 1;
    const auto t0 = Clock::now();
    TESSERA_RETURN_IF_ERROR(group.submit(std::move(step)));
    TESSERA_ASSIGN_OR_RETURN(StepOutput out, group.collect());
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (out.step_id != i + 1) {
      return internal_error("step " + std::to_string(i + 1) + " came back as step " +
                            std::to_string(out.step_id));
    }
    if (i < o.num_warmup) continue;
    round_us.push_back(us);
    actor_us.push_back(group.last_times().actor_us);
  }
  double sum = 0;
  for (double v : round_us) sum += v;
  const double mean = sum / static_cast<double>(round_us.size());
  nlohmann::json pct = nlohmann::json::object();
  std::vector<std::vector<std::string>> rows = {{"", "mean", "p50", "p90", "p99", ""}};
  std::vector<std::string> round = {"round trip", fixed(mean, 1)};
  for (int q : {50, 90, 99}) {
    const double v = percentile(round_us, q);
    pct["p" + std::to_string(q)] = v;
    round.push_back(fixed(v, 1));
  }
  round.push_back("us");
  rows.push_back(round);
  rows.push_back({"actors' own part", "", fixed(percentile(actor_us, 50), 1), "", "", "us"});
  text.table(rows, "lrrrrl");
  nlohmann::json j = run_json(o.command_line, o.engine.model, m);
  j.update({{"tensor_parallel_size", session->plan().plan.tp},
            {"pipeline_parallel_size", session->plan().plan.pp},
            {"world_size", group.world_size()},
            {"transport", o.transport},
            {"num_steps", o.num_steps},
            {"num_warmup", o.num_warmup},
            {"round_trip_us_mean", mean},
            {"round_trip_us", pct},
            {"actor_us_p50", percentile(actor_us, 50)}});
  TESSERA_RETURN_IF_ERROR(text.finish(o.output_json, j));
  return Status::ok();
}

// bench throughput's requests: --num-prompts random prompts or the dataset's, tokenized.
Expected<std::vector<BenchPrompt>> throughput_prompts(const BenchThroughputOptions& o,
                                                      const ModelSession& session) {
  std::vector<BenchPrompt> w;
  if (o.dataset_path.empty()) {
    w = random_bench_prompts(o.num_prompts, o.input_len, o.output_len, o.seed,
                             session.config().vocab_size);
  } else {
    TESSERA_ASSIGN_OR_RETURN(w, read_bench_dataset(o.dataset_path, o.num_prompts, o.output_len,
                                                   session.config().vocab_size));
  }
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i].ids.empty()) w[i].ids = session.tokenizer().encode(w[i].text, true);
    if (w[i].ids.empty())
      return invalid_argument("request " + std::to_string(i) + ": empty prompt");
  }
  return w;
}

// Request i's sampling: sampled, as vLLM's benchmark does (seeded per request), EOS ignored.
SamplingParams throughput_sampling(const BenchThroughputOptions& o, size_t i,
                                   const BenchPrompt& p) {
  SamplingParams s;
  s.temperature = 1.0f;
  s.seed = o.seed + i;
  s.max_tokens = static_cast<int>(p.output_len);
  s.ignore_eos = true;
  return s;
}

// "bench throughput: N of M requests done, ..." on stderr at each tenth of the requests done,
// and at least every 10 s.
class ThroughputProgress {
 public:
  ThroughputProgress(size_t requests, Clock::time_point t0)
      : requests_(requests), t0_(t0), last_report_(t0) {}
  void update(size_t finished, size_t output_tokens, Clock::time_point now) {
    if (finished * 10 < next_tenth_ * requests_ && now - last_report_ <= std::chrono::seconds(10))
      return;
    while (finished * 10 >= next_tenth_ * requests_) ++next_tenth_;
    last_report_ = now;
    std::fprintf(stderr,
                 "bench throughput: %zu of %zu requests done, %zu output tokens, %.0f tok/s so "
                 "far\n",
                 finished, requests_, output_tokens, output_tokens / seconds(now - t0_));
  }

 private:
  size_t requests_;
  Clock::time_point t0_, last_report_;
  size_t next_tenth_ = 1;
};

Status check_throughput(const BenchThroughputOptions& o) {
  if (o.num_prompts == 0) return invalid_argument("--num-prompts must be at least 1");
  if (o.dataset_path.empty() && (o.input_len == 0 || o.output_len == 0)) {
    return invalid_argument("--input-len and --output-len must be at least 1");
  }
  return Status::ok();
}

// -dp N or auto: every request added at once to the replicas; the requests and tokens each one
// ran beside the totals. The steps' time split is the single engine's report (it reads one
// worker group's step times).
Status run_throughput_replicas(const BenchThroughputOptions& o) {
  const BenchOutput text(o.json);
  const auto start = Clock::now();
  TESSERA_ASSIGN_OR_RETURN(auto replicas,
                           server::ReplicaSet::start(o.engine, o.replicas, "tessera bench"));
  const double load_s = seconds(Clock::now() - start);
  const ModelSession& session = replicas->session();
  const ModelInfo& m = replicas->loaded();
  TESSERA_ASSIGN_OR_RETURN(auto w, throughput_prompts(o, session));
  text.say("%s on %s (%s backend, %s), %zu replicas loaded in %.1f s: %zu requests\n",
           m.architecture.c_str(), m.device_name.empty() ? "the CPU" : m.device_name.c_str(),
           m.backend.c_str(), m.dtype.c_str(), replicas->size(), load_s, w.size());
  std::fflush(text.text());
  std::vector<Request> requests;
  requests.reserve(w.size());
  size_t input_tokens = 0, output_tokens = 0, finished = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    auto r = Request::make(w[i].ids, throughput_sampling(o, i, w[i]), m);
    if (!r) return r.status().with_context("request " + std::to_string(i));
    input_tokens += w[i].ids.size();
    requests.push_back(std::move(*r));
  }
  const auto t0 = Clock::now();
  auto t_end = t0;
  ThroughputProgress progress(w.size(), t0);
  TESSERA_ASSIGN_OR_RETURN(server::ReplicaGeneration g,
                           server::generate_on_replicas(*replicas, std::move(requests),
                                                        [&](size_t, const RequestOutput& out) {
                                                          output_tokens += out.new_tokens.size();
                                                          finished += out.finished;
                                                          t_end = Clock::now();
                                                          progress.update(finished, output_tokens,
                                                                          t_end);
                                                        }));
  const double wall = seconds(t_end - t0);
  const double rps = w.size() / wall, out_s = output_tokens / wall;
  text.say("Throughput: %.2f requests/s, %.1f total tokens/s, %.1f output tokens/s\n", rps,
           (input_tokens + output_tokens) / wall, out_s);
  text.table({{"requests", std::to_string(w.size()), ""},
              {"input tokens", std::to_string(input_tokens), ""},
              {"output tokens", std::to_string(output_tokens), ""},
              {"elapsed", fixed(wall, 2), "s"},
              {"replicas", std::to_string(g.replicas.size()),
               std::string("router ") + server::router_policy_name(replicas->policy())}},
             "lrl");
  std::vector<std::vector<std::string>> rows = {
      {"replica", "requests", "input tokens", "output tokens"}};
  nlohmann::json per_replica = nlohmann::json::array();
  for (size_t i = 0; i < g.replicas.size(); ++i) {
    const server::ReplicaRun& r = g.replicas[i];
    rows.push_back({std::to_string(i), std::to_string(r.requests), std::to_string(r.prompt_tokens),
                    std::to_string(r.output_tokens)});
    per_replica.push_back({{"replica", i},
                           {"requests", r.requests},
                           {"input_tokens", r.prompt_tokens},
                           {"output_tokens", r.output_tokens}});
  }
  text.table(rows, "lrrr");
  nlohmann::json j = run_json(o.command_line, o.engine.model, m);
  j.update(throughput_figures(o, w.size(), input_tokens, output_tokens, wall));
  j.update({{"tensor_parallel_size", session.plan().plan.tp},
            {"pipeline_parallel_size", session.plan().plan.pp},
            {"data_parallel_size", g.replicas.size()},
            {"router", server::router_policy_name(replicas->policy())},
            {"kv_blocks", m.kv_blocks},
            {"load_seconds", load_s},
            {"detokenize", true},
            {"weight_bytes", m.weight_bytes},
            {"replicas", per_replica}});
  return text.finish(o.output_json, j);
}

Status run_throughput(const BenchThroughputOptions& o) {
  TESSERA_RETURN_IF_ERROR(check_throughput(o));
  if (o.replicas.data_parallel_size.ranks != 1) return run_throughput_replicas(o);
  const BenchOutput text(o.json);
  TESSERA_ASSIGN_OR_RETURN(auto session, ModelSession::open(o.engine, "tessera bench", true));
  const ModelInfo& m = session->model();
  TESSERA_ASSIGN_OR_RETURN(auto w, throughput_prompts(o, *session));
  text.say("%s on %s (%s backend, %s), loaded in %.1f s: %zu requests\n", m.architecture.c_str(),
           m.device_name.empty() ? "the CPU" : m.device_name.c_str(), m.backend.c_str(),
           m.dtype.c_str(), session->load_seconds(), w.size());
  std::fflush(text.text());
  LlmEngine& engine = session->engine();
  size_t input_tokens = 0, output_tokens = 0, finished = 0, steps = 0;
  double gpu_s = 0, actor_s = 0, call_s = 0;
  const bool moe = session->config().moe.enabled();
  ExpertLoad load_before;
  if (moe) {
    TESSERA_ASSIGN_OR_RETURN(load_before, session->group().expert_load());
  }
  const auto t0 = Clock::now();
  for (size_t i = 0; i < w.size(); ++i) {
    input_tokens += w[i].ids.size();
    TESSERA_RETURN_IF_ERROR(add(engine, w[i].ids, throughput_sampling(o, i, w[i])).status());
  }
  ThroughputProgress progress(w.size(), t0);
  // The timeline: a sample every half second of what the steps in it did, and the bytes each
  // step had to read at least (the weights once, the K/V of the tokens in the cache), from which
  // scripts/bench-plot draws the fraction of the memory roofline over the run.
  const ModelConfig& cfg = session->config();
  TESSERA_ASSIGN_OR_RETURN(DType run_dtype, parse_safetensors_dtype(m.dtype));
  const double kv_bytes_per_token =
      2.0 * static_cast<double>(cfg.num_layers) * cfg.num_kv_heads * cfg.head_dim *
      static_cast<double>(kv_cache_element_size(o.engine.kv_cache_dtype, run_dtype));
  const uint32_t block_size = static_cast<uint32_t>(engine.config().model.block_size);
  nlohmann::json timeline = nlohmann::json::array();
  struct Interval {
    size_t steps = 0, output_tokens = 0;
    double step_s = 0, gpu_s = 0, min_bytes = 0;
  } iv;
  auto iv_start = t0;
  while (engine.has_unfinished()) {
    const auto step_t0 = Clock::now();
    const EngineStats before = engine.stats();
    TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
    ++steps;
    const auto& t = session->group().last_times();
    gpu_s += t.gpu_us / 1e6;
    actor_s += t.actor_us / 1e6;
    call_s += t.call_us / 1e6;
    ++iv.steps;
    iv.step_s += seconds(Clock::now() - step_t0);
    iv.gpu_s += t.gpu_us / 1e6;
    iv.min_bytes += static_cast<double>(m.weight_bytes) +
                    static_cast<double>(before.kv_blocks_used) * block_size * kv_bytes_per_token;
    for (const auto& out : outs) {
      if (out.finished && out.finish_reason == FinishReason::kError) {
        return internal_error(out.error.message());
      }
      output_tokens += out.new_tokens.size();
      iv.output_tokens += out.new_tokens.size();
      finished += out.finished;
    }
    const auto now = Clock::now();
    if (now - iv_start >= std::chrono::milliseconds(500) || !engine.has_unfinished()) {
      const EngineStats st = engine.stats();
      const double span = seconds(now - iv_start);
      timeline.push_back({{"t_s", seconds(now - t0)},
                          {"steps", iv.steps},
                          {"output_tok_s", iv.output_tokens / span},
                          {"step_ms", 1000 * iv.step_s / iv.steps},
                          {"gpu_forward_ms", 1000 * iv.gpu_s / iv.steps},
                          {"min_bytes_per_step", iv.min_bytes / iv.steps},
                          {"running", st.running},
                          {"waiting", st.waiting},
                          {"kv_cache_usage", st.kv_cache_usage}});
      iv = Interval{};
      iv_start = now;
    }
    progress.update(finished, output_tokens, now);
  }
  const double wall = seconds(Clock::now() - t0);
  const double rps = w.size() / wall, out_s = output_tokens / wall;
  // vLLM's summary line, then the figures as a table.
  text.say("Throughput: %.2f requests/s, %.1f total tokens/s, %.1f output tokens/s\n", rps,
           (input_tokens + output_tokens) / wall, out_s);
  auto share = [&](double s) { return fixed(100 * s / wall, 1) + "% of the wall time"; };
  text.table({{"requests", std::to_string(w.size()), "", ""},
              {"input tokens", std::to_string(input_tokens), "", ""},
              {"output tokens", std::to_string(output_tokens), "", ""},
              {"elapsed", fixed(wall, 2), "s", ""},
              {"steps", std::to_string(steps), "", ""},
              {"step (mean)", fixed(1000 * wall / std::max<size_t>(steps, 1), 2), "ms", ""},
              {"GPU forward passes", fixed(gpu_s, 2), "s", share(gpu_s)},
              {"actor execute", fixed(actor_s, 2), "s", share(actor_s)},
              {engine.steps_in_flight() > 1 ? "steps' submit to collect (overlapping)"
                                            : "driver's RPC/ring round trips",
               fixed(call_s, 2), "s", share(call_s)}},
             "lrlr");
  nlohmann::json expert_load = nullptr;
  if (moe) {
    TESSERA_ASSIGN_OR_RETURN(ExpertLoad load_after, session->group().expert_load());
    expert_load = expert_load_json(load_before, load_after);
    if (!expert_load.is_null()) {
      text.say(
          "Expert balance: %.1f routings per expert per step; the busiest expert of a layer "
          "took %.2fx the mean (%.2fx on average over the %zu MoE layers)\n",
          expert_load["tokens_per_expert_per_step"].get<double>(),
          expert_load["max_over_mean"].get<double>(),
          expert_load["mean_max_over_mean"].get<double>(), expert_load["layers"].size());
    }
  }
  nlohmann::json j = run_json(o.command_line, o.engine.model, m);
  j.update(throughput_figures(o, w.size(), input_tokens, output_tokens, wall));
  j["expert_load"] = expert_load;
  j["enable_expert_parallel"] = o.engine.enable_expert_parallel;
  j.update({{"tensor_parallel_size", session->plan().plan.tp},
            {"pipeline_parallel_size", session->plan().plan.pp},
            {"kv_blocks", m.kv_blocks},
            {"load_seconds", session->load_seconds()},
            {"async_scheduling", engine.config().async_scheduling},
            {"steps", steps},
            {"gpu_forward_s", gpu_s},
            {"gpu_busy_fraction", gpu_s / wall},
            {"actor_execute_s", actor_s},
            {"driver_call_s", call_s},
            {"detokenize", true},
            {"weight_bytes", m.weight_bytes},
            {"kv_bytes_per_token", kv_bytes_per_token},
            {"timeline", timeline}});
  TESSERA_RETURN_IF_ERROR(text.finish(o.output_json, j));
  return Status::ok();
}

}  // namespace

std::vector<BenchPrompt> random_bench_prompts(uint32_t n, uint32_t input_len, uint32_t output_len,
                                              uint64_t seed, int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<BenchPrompt> out(n);
  for (BenchPrompt& p : out) {
    p.ids = random_prompt(rng, vocab, input_len);
    p.output_len = output_len;
  }
  return out;
}

Expected<std::vector<BenchPrompt>> read_bench_dataset(const std::string& path, uint32_t limit,
                                                      uint32_t output_len, int64_t vocab) {
  std::ifstream in(path);
  if (!in) return not_found("--dataset-path " + path + ": cannot open it");
  std::vector<BenchPrompt> out;
  size_t line_no = 0;
  for (std::string line; out.size() < limit && std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return invalid_argument(where + ": not a JSON object");
    BenchPrompt p;
    if (j.contains("prompt_token_ids") && j["prompt_token_ids"].is_array()) {
      for (const auto& id : j["prompt_token_ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
          return invalid_argument(where + ": prompt_token_ids holds " + id.dump() +
                                  ", not a token id below the vocabulary size " +
                                  std::to_string(vocab));
        }
        p.ids.push_back(id.get<int32_t>());
      }
      if (p.ids.empty()) return invalid_argument(where + ": prompt_token_ids is empty");
    } else if (j.contains("prompt") && j["prompt"].is_string() &&
               !j["prompt"].get<std::string>().empty()) {
      p.text = j["prompt"].get<std::string>();
    } else {
      return invalid_argument(where + ": needs \"prompt\" (text) or \"prompt_token_ids\"");
    }
    p.output_len = output_len;
    if (j.contains("output_len")) {
      if (!j["output_len"].is_number_integer() || j["output_len"].get<int64_t>() < 1) {
        return invalid_argument(where + ": output_len must be a positive integer");
      }
      p.output_len = j["output_len"].get<uint32_t>();
    }
    out.push_back(std::move(p));
  }
  if (out.empty()) return invalid_argument("--dataset-path " + path + ": no prompts");
  return out;
}

int64_t matmul_parameters(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  int64_t attention = H * (q + 2 * kv) + q * H + 2 * H;
  if (c.attention_bias) attention += q + 2 * kv;
  if (c.o_proj_bias) attention += H;
  if (c.qk_norm) attention += 2 * c.head_dim;
  // An MoE layer's token reads the router, its top_k experts and the shared expert with its
  // gate: the active parameters, not all the experts the GPU holds.
  const MoeConfig& m = c.moe;
  const int64_t sparse = m.num_experts * H + m.top_k * 3 * H * m.expert_intermediate +
                         (m.shared_intermediate > 0 ? 3 * H * m.shared_intermediate + H : 0);
  int64_t total = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    total += attention + (m.enabled() && m.sparse_layer(l) ? sparse : 3 * H * I);
  }
  return total + H + c.vocab_size * H;
}

CLI::App* add_bench_subcommand(CLI::App& app) {
  auto* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  add_examples(bench_cmd, {"tessera bench throughput --model ./llama3-8b --num-prompts 1000"});
  return bench_cmd;
}

CLI::App* add_bench_latency_subcommand(CLI::App& bench, BenchLatencyOptions& latency) {
  auto* latency_cmd = bench.add_subcommand(
      "latency", "End-to-end latency of one batch, over many iterations (vLLM's)");
  add_engine_options(latency_cmd, latency.engine);
  latency_cmd->add_option("--input-len", latency.input_len, "Random prompt tokens (32)");
  latency_cmd->add_option("--output-len", latency.output_len,
                          "Tokens each request generates, EOS ignored (128)");
  latency_cmd->add_option("--batch-size", latency.batch_size, "Requests in the batch (8)");
  latency_cmd->add_option("--num-iters-warmup", latency.num_iters_warmup,
                          "Unmeasured iterations first (10)");
  latency_cmd->add_option("--num-iters", latency.num_iters, "Measured iterations (30)");
  latency_cmd->add_option("--seed", latency.seed,
                          "The run's random seed: prompts and samplers (0)");
  add_bench_output_options(latency_cmd, latency.output_json, latency.json);
  add_examples(latency_cmd, {"tessera bench latency --model ./llama3-8b --batch-size 8 "
                             "--input-len 32 --output-len 128"});
  return latency_cmd;
}

CLI::App* add_bench_report_subcommand(CLI::App& bench, BenchReportOptions& report) {
  auto* report_cmd = bench.add_subcommand(
      "report",
      "Tessera's report: batch-1 decode (TTFT, step breakdown), a long prefill and a large-batch "
      "decode of one model");
  add_engine_options(report_cmd, report.engine);
  report_cmd->add_option("--input-len", report.input_len, "Prompt tokens (128)");
  report_cmd->add_option("--output-len", report.output_len, "New tokens (256)");
  report_cmd->add_option("--num-iters", report.num_iters, "Measured batch-1 runs (3)");
  report_cmd->add_option("--num-iters-warmup", report.num_iters_warmup, "Warm-up runs (1)");
  report_cmd->add_option("--prefill-len", report.prefill_len,
                         "Long prefill tokens (4096; 0 = skip)");
  report_cmd->add_option("--prefill-iters", report.prefill_iters, "Measured prefills (5)");
  report_cmd->add_option("--batch-size", report.batch_size,
                         "Large-batch decode size (64; 0 = skip)");
  report_cmd->add_option("--batch-iters", report.batch_iters, "Measured large-batch runs (2)");
  report_cmd->add_option("--seed", report.seed, "The run's random seed: the prompts (0)");
  add_bench_output_options(report_cmd, report.output_json, report.json);
  add_examples(report_cmd, {"tessera bench report --model ./llama3-8b --output-json report.json"});
  return report_cmd;
}

CLI::App* add_bench_throughput_subcommand(CLI::App& bench, BenchThroughputOptions& throughput) {
  auto* throughput_cmd = bench.add_subcommand(
      "throughput", "Offline throughput: many requests at once through one engine (vLLM's)");
  add_engine_options(throughput_cmd, throughput.engine);
  server::add_replica_options(throughput_cmd, throughput.replicas);
  throughput_cmd->add_option("--num-prompts", throughput.num_prompts, "Requests (1000)");
  throughput_cmd->add_option("--input-len", throughput.input_len, "Random prompt tokens (1024)");
  throughput_cmd->add_option("--output-len", throughput.output_len,
                             "Tokens each request generates, EOS ignored (128)");
  throughput_cmd->add_option("--dataset-path", throughput.dataset_path,
                             "JSONL of prompts: \"prompt\" or \"prompt_token_ids\", optional "
                             "\"output_len\" (default: random prompts)");
  throughput_cmd->add_option(
      "--seed", throughput.seed,
      "The run's random seed: prompts, and request i's sampler (seed + i) (0)");
  add_bench_output_options(throughput_cmd, throughput.output_json, throughput.json);
  add_examples(throughput_cmd, {"tessera bench throughput --model ./llama3-8b --num-prompts 1000 "
                                "--input-len 1000 --output-len 1000"});
  return throughput_cmd;
}

CLI::App* add_bench_control_plane_subcommand(CLI::App& bench, BenchControlPlaneOptions& control) {
  auto* control_cmd = bench.add_subcommand(
      "control-plane", "Round trip of empty steps driver -> ranks -> driver (rings or RPC)");
  add_engine_options(control_cmd, control.engine);
  control_cmd
      ->add_option("--transport", control.transport,
                   "ring: shared-memory step rings; rpc: an execute RPC per step (ring)")
      ->check(CLI::IsMember({"ring", "rpc"}));
  control_cmd->add_option("--num-steps", control.num_steps, "Measured steps (10000)");
  control_cmd->add_option("--num-warmup", control.num_warmup, "Unmeasured steps first (200)");
  add_bench_output_options(control_cmd, control.output_json, control.json);
  add_examples(control_cmd,
               {"tessera bench control-plane --model ./tiny -tp 2 --device cpu --transport ring"});
  return control_cmd;
}

int bench_latency_command(const BenchLatencyOptions& options) {
  return command_exit(run_latency(options), "tessera bench latency");
}

int bench_report_command(const BenchReportOptions& options) {
  return command_exit(run_report(options), "tessera bench report");
}

int bench_control_plane_command(const BenchControlPlaneOptions& options) {
  return command_exit(run_control_plane(options), "tessera bench control-plane");
}

int bench_throughput_command(const BenchThroughputOptions& options) {
  return command_exit(run_throughput(options), "tessera bench throughput");
}

}  // namespace tessera
