#include "driver/engine/engine.h"

#include <algorithm>
#include <cmath>

namespace tessera {

Status validate_sampling(const SamplingOptions& s, int64_t vocab_size) {
  if (!(s.temperature >= 0.0f) || !std::isfinite(s.temperature)) {
    return invalid_argument("temperature must be a number >= 0, got " +
                            std::to_string(s.temperature));
  }
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1], got " + std::to_string(s.top_p));
  }
  if (s.top_k == 0 || s.top_k < -1) {
    return invalid_argument("top_k must be -1 (off) or at least 1, got " + std::to_string(s.top_k));
  }
  if (!(s.min_p >= 0.0f && s.min_p <= 1.0f)) {
    return invalid_argument("min_p must be in [0, 1], got " + std::to_string(s.min_p));
  }
  if (!(s.repetition_penalty > 0.0f && s.repetition_penalty <= 2.0f)) {
    return invalid_argument("repetition_penalty must be in (0, 2], got " +
                            std::to_string(s.repetition_penalty));
  }
  if (!(s.presence_penalty >= -2.0f && s.presence_penalty <= 2.0f)) {
    return invalid_argument("presence_penalty must be in [-2, 2], got " +
                            std::to_string(s.presence_penalty));
  }
  if (!(s.frequency_penalty >= -2.0f && s.frequency_penalty <= 2.0f)) {
    return invalid_argument("frequency_penalty must be in [-2, 2], got " +
                            std::to_string(s.frequency_penalty));
  }
  if (s.max_tokens < 1) {
    return invalid_argument("max_tokens must be at least 1, got " + std::to_string(s.max_tokens));
  }
  if (s.logprobs < -1 || s.logprobs > 20) {
    return invalid_argument("logprobs must be between 0 and 20 (or -1 for none), got " +
                            std::to_string(s.logprobs));
  }
  for (int32_t id : s.stop_token_ids) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return invalid_argument(
          "stop token id " + std::to_string(id) + " is outside the vocabulary" +
          (vocab_size > 0 ? " (" + std::to_string(vocab_size) + " tokens)" : std::string()));
    }
  }
  for (const auto& stop : s.stop) {
    if (stop.empty()) return invalid_argument("stop strings must not be empty");
  }
  return Status::ok();
}

LlmEngine::LlmEngine(EngineConfig config, StepExecutor& executor, const Detokenizer& detokenizer)
    : config_(std::move(config)),
      executor_(executor),
      detokenizer_(detokenizer),
      blocks_(config_.num_blocks, config_.block_size),
      scheduler_(config_.scheduler, blocks_) {}

Expected<uint64_t> LlmEngine::add_request(std::vector<int32_t> prompt, SamplingOptions sampling) {
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  const size_t max_len = config_.scheduler.max_model_len;
  if (prompt.size() >= max_len) {
    return invalid_argument("the prompt has " + std::to_string(prompt.size()) +
                            " tokens, but max-model-len is " + std::to_string(max_len) +
                            ": shorten the prompt or raise --max-model-len");
  }
  if (blocks_.blocks_for(prompt.size() + 1) > blocks_.total_blocks()) {
    return invalid_argument("the prompt has " + std::to_string(prompt.size()) +
                            " tokens, more than the KV cache holds (" +
                            std::to_string(blocks_.total_blocks() * blocks_.block_size()) +
                            " tokens)");
  }
  for (int32_t t : prompt) {
    if (t < 0 || (config_.vocab_size > 0 && t >= config_.vocab_size)) {
      return invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary (" +
                              std::to_string(config_.vocab_size) + " tokens)");
    }
  }
  TESSERA_RETURN_IF_ERROR(validate_sampling(sampling, config_.vocab_size));
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_++;
  seq->prompt = std::move(prompt);
  seq->sampling = std::move(sampling);
  uint64_t id = seq->id;
  scheduler_.add(std::move(seq));
  return id;
}

Expected<std::vector<RequestOutput>> LlmEngine::step() {
  std::vector<ScheduledChunk> chunks = scheduler_.schedule();
  std::vector<RequestOutput> outputs;
  if (chunks.empty()) {
    if (!scheduler_.idle() && scheduler_.running() == 0) {
      return resource_exhausted("no request fits in the free KV-cache blocks");
    }
    return outputs;
  }
  StepBatch batch;
  batch.finished = std::move(finished_since_last_step_);
  finished_since_last_step_.clear();
  for (const auto& c : chunks) {
    SeqWork w;
    w.request_id = c.seq->id;
    for (size_t i = c.start; i < c.start + c.count; ++i) w.tokens.push_back(c.seq->token_at(i));
    w.start_position = static_cast<uint32_t>(c.start);
    w.block_table = c.seq->block_table;
    w.sample = c.sample;
    w.first = !c.seq->started;
    if (w.first) {
      w.prompt = c.seq->prompt;
      w.sampling = c.seq->sampling;
    }
    batch.seqs.push_back(std::move(w));
  }
  auto result = executor_.execute(batch);
  if (!result) {
    // The step failed: every request in it fails, the others (and the engine) go on.
    for (const auto& c : chunks) {
      auto seq = scheduler_.finish(c.seq->id);
      RequestOutput out;
      out.request_id = seq->id;
      out.finished = true;
      out.finish_reason = "error: " + result.status().message();
      out.prompt_tokens = seq->prompt.size();
      out.completion_tokens = seq->output.size();
      finished_since_last_step_.push_back(seq->id);
      outputs.push_back(std::move(out));
    }
    return outputs;
  }
  size_t next = 0;
  std::vector<uint64_t> done;
  for (const auto& c : chunks) {
    c.seq->started = true;
    c.seq->computed = c.start + c.count;
    if (!c.sample) continue;
    if (next >= result->sampled.size() || result->sampled[next].request_id != c.seq->id) {
      return internal_error("the actor returned " + std::to_string(result->sampled.size()) +
                            " samples for a step that asked for more, or out of order");
    }
    RequestOutput out;
    out.request_id = c.seq->id;
    postprocess(*c.seq, result->sampled[next++].token, out);
    if (out.finished) done.push_back(c.seq->id);
    outputs.push_back(std::move(out));
  }
  for (uint64_t id : done) {
    scheduler_.finish(id);
    finished_since_last_step_.push_back(id);
  }
  return outputs;
}

void LlmEngine::postprocess(Sequence& seq, const TokenLogprobs& sampled, RequestOutput& out) {
  const SamplingOptions& s = seq.sampling;
  seq.output.push_back(sampled.token);
  out.new_tokens.push_back(sampled.token);
  if (s.logprobs >= 0) {
    seq.logprobs.push_back(sampled);
    out.new_logprobs.push_back(sampled);
  }
  bool is_eos = std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(),
                          sampled.token) != config_.eos_token_ids.end();
  bool is_stop_id = std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), sampled.token) !=
                    s.stop_token_ids.end();
  // Text: decode the whole output and hold back a trailing incomplete UTF-8 sequence (decoded
  // as U+FFFD) until the next token completes it.
  std::string text = detokenizer_.decode(seq.output, s.skip_special_tokens);
  static const std::string kReplacement = "\xEF\xBF\xBD";
  bool incomplete = text.size() >= 3 && text.compare(text.size() - 3, 3, kReplacement) == 0;
  seq.text = text;
  size_t stop_at = std::string::npos;
  size_t longest_stop = 0;
  for (const auto& stop : s.stop) {
    longest_stop = std::max(longest_stop, stop.size());
    size_t from = seq.emitted > stop.size() ? seq.emitted - stop.size() : 0;
    size_t pos = seq.text.find(stop, from);
    if (pos != std::string::npos) stop_at = std::min(stop_at, pos);
  }
  if (stop_at != std::string::npos) {
    seq.text.resize(stop_at);
    seq.finish_reason = "stop";
  } else if ((is_eos && !s.ignore_eos) || is_stop_id) {
    seq.finish_reason = "stop";
    if (is_eos && s.skip_special_tokens) {
      // The EOS token adds no text.
    }
  } else if (static_cast<int>(seq.output.size()) >= s.max_tokens) {
    seq.finish_reason = "length";
  } else if (seq.total() >= config_.scheduler.max_model_len) {
    seq.finish_reason = "length";
  }
  out.finished = !seq.finish_reason.empty();
  out.finish_reason = seq.finish_reason;
  // Emit what can no longer change: all of it when finished; otherwise hold back a partial
  // UTF-8 character and anything that could still become the start of a stop string.
  size_t emit_to = seq.text.size();
  if (!out.finished) {
    if (incomplete) emit_to -= std::min(emit_to, kReplacement.size());
    if (longest_stop > 1) emit_to -= std::min(emit_to, longest_stop - 1);
  } else if (incomplete && stop_at == std::string::npos) {
    emit_to -= std::min(emit_to, kReplacement.size());  // never end on a broken character
  }
  // Never cut inside a UTF-8 sequence.
  while (emit_to > seq.emitted && emit_to < seq.text.size() &&
         (static_cast<unsigned char>(seq.text[emit_to]) & 0xC0) == 0x80) {
    --emit_to;
  }
  if (emit_to > seq.emitted) {
    out.delta = seq.text.substr(seq.emitted, emit_to - seq.emitted);
    seq.emitted = emit_to;
  }
  out.prompt_tokens = seq.prompt.size();
  out.completion_tokens = seq.output.size();
}

}  // namespace tessera
