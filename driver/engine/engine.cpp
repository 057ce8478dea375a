#include "driver/engine/engine.h"

#include <algorithm>
#include <cmath>

namespace tessera {

LlmEngine::LlmEngine(EngineConfig config, StepExecutor& executor, const Detokenizer& detokenizer)
    : config_(std::move(config)),
      executor_(executor),
      detokenizer_(detokenizer),
      blocks_(config_.num_blocks, config_.block_size),
      scheduler_(config_.scheduler, blocks_) {}

Expected<uint64_t> LlmEngine::add_request(std::vector<int32_t> prompt, SamplingParams sampling) {
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
  TESSERA_RETURN_IF_ERROR(sampling.validate(config_.vocab_size));
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_++;
  seq->prompt = std::move(prompt);
  seq->sampling = std::move(sampling);
  uint64_t id = seq->id;
  scheduler_.add(std::move(seq));
  return id;
}

StepInput LlmEngine::make_step(const std::vector<ScheduledChunk>& chunks) {
  StepInput step;
  step.step_id = next_step_++;
  step.finished = std::move(finished_since_last_step_);
  finished_since_last_step_.clear();
  for (const auto& c : chunks) {
    Sequence& seq = *c.seq;
    SeqStep s;
    s.request_id = seq.id;
    for (size_t i = c.start; i < c.start + c.count; ++i) s.tokens.push_back(seq.token_at(i));
    s.start_position = static_cast<int64_t>(c.start);
    s.new_blocks.assign(seq.block_table.begin() + static_cast<std::ptrdiff_t>(seq.sent_blocks),
                        seq.block_table.end());
    seq.sent_blocks = seq.block_table.size();
    s.sample = c.sample;
    s.first = !seq.started;
    if (s.first) {
      s.prompt_len = static_cast<int64_t>(seq.prompt.size());
      s.sampling = seq.sampling;
      seq.started = true;
    }
    step.seqs.push_back(std::move(s));
  }
  return step;
}

void LlmEngine::fail(const std::vector<ScheduledChunk>& chunks, const Status& why,
                     std::vector<RequestOutput>& outputs) {
  for (const auto& c : chunks) {
    auto seq = scheduler_.finish(c.seq->id);
    if (!seq) continue;
    RequestOutput out;
    out.request_id = seq->id;
    out.finished = true;
    out.finish_reason = "error: " + why.message();
    out.prompt_tokens = seq->prompt.size();
    out.completion_tokens = seq->output.size();
    finished_since_last_step_.push_back(seq->id);
    outputs.push_back(std::move(out));
  }
}

Expected<std::vector<RequestOutput>> LlmEngine::step() {
  std::vector<RequestOutput> outputs;
  // Fill the pipeline: one step per stage can be in flight, each with other sequences.
  while (static_cast<int>(in_flight_.size()) < executor_.pipeline_depth()) {
    std::vector<ScheduledChunk> chunks = scheduler_.schedule();
    if (chunks.empty()) break;
    Status sent = executor_.submit(make_step(chunks));
    if (!sent) {
      for (const auto& c : chunks) c.seq->in_flight = false;
      fail(chunks, sent, outputs);
      return outputs;
    }
    in_flight_.push_back(std::move(chunks));
  }
  if (in_flight_.empty()) {
    if (!scheduler_.idle() && scheduler_.running() == 0) {
      return resource_exhausted("no request fits in the free KV-cache blocks");
    }
    return outputs;
  }
  std::vector<ScheduledChunk> chunks = std::move(in_flight_.front());
  in_flight_.pop_front();
  for (const auto& c : chunks) c.seq->in_flight = false;
  auto result = executor_.collect();
  if (!result) {
    // The step failed: every request in it fails, the others (and the engine) go on.
    fail(chunks, result.status(), outputs);
    return outputs;
  }
  size_t next = 0;
  std::vector<uint64_t> done;
  for (const auto& c : chunks) {
    c.seq->computed = c.start + c.count;
    if (!c.sample) continue;
    if (next >= result->outputs.size() || result->outputs[next].request_id != c.seq->id) {
      return internal_error("the actors returned " + std::to_string(result->outputs.size()) +
                            " samples for a step that asked for more, or out of order");
    }
    const SampleResult& sampled = result->outputs[next++].sample;
    TokenLogprobs token{sampled.token, sampled.logprob, sampled.top_logprobs};
    RequestOutput out;
    out.request_id = c.seq->id;
    postprocess(*c.seq, token, out);
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
  const SamplingParams& s = seq.sampling;
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
