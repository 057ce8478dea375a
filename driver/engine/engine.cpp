#include "driver/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <tuple>

namespace tessera {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Bytes at the end of `text` (after `from`) that could be the start of one of `stops`: the
// longest proper prefix of a stop string that `text` ends with.
size_t stop_prefix_at_end(std::string_view text, size_t from,
                          const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& stop : stops) {
    size_t k = std::min(stop.size() - std::min<size_t>(stop.size(), 1), text.size() - from);
    for (; k > hold; --k) {
      if (text.substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  return hold;
}

// The scheduler's per-step seats: with several pipeline stages, the running sequences split
// into as many micro-batches, one per step in flight (scheduler.h).
SchedulerConfig scheduler_config(const EngineConfig& config, int depth) {
  SchedulerConfig s;
  s.limits = config.model;
  s.async_scheduling = config.async_scheduling;
  if (!config.async_scheduling && depth > 1) {  // async: full steps, overlapping
    const int64_t d = depth;
    s.max_seqs_per_step = static_cast<uint32_t>((config.model.max_num_seqs + d - 1) / d);
  }
  return s;
}

}  // namespace

LlmEngine::LlmEngine(EngineConfig config, StepExecutor& executor, const Detokenizer& detokenizer)
    : config_(std::move(config)),
      depth_(std::max(executor.pipeline_depth(), config_.async_scheduling ? 2 : 1)),
      executor_(executor),
      detokenizer_(detokenizer),
      blocks_(static_cast<uint32_t>(config_.model.kv_blocks),
              static_cast<uint32_t>(config_.model.block_size), config_.enable_prefix_caching,
              &BlockManager::hash_block, config_.kv_window),
      scheduler_(scheduler_config(config_, executor.pipeline_depth()), blocks_),
      // With a sliding-window cache a sequence holds only its window's blocks: any length fits.
      max_len_(
          static_cast<size_t>(config_.kv_window > 0 && blocks_.max_step_tokens() > 0
                                  ? config_.model.max_model_len
                                  : std::min(config_.model.max_model_len,
                                             config_.model.kv_blocks * config_.model.block_size))) {
}

Expected<uint64_t> LlmEngine::add_request(Request request) {
  const size_t prompt_len = request.prompt().size();
  if (!blocks_.fits_alone(prompt_len + 1)) {
    return invalid_argument(
        "the prompt has " + std::to_string(prompt_len) + " tokens, more than the KV cache holds (" +
        std::to_string(blocks_.total_blocks() * blocks_.block_size()) + " tokens" +
        (blocks_.window() > 0 ? ", too few for the model's sliding window of " +
                                    std::to_string(blocks_.window()) + " tokens"
                              : std::string()) +
        ")");
  }
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_++;
  std::tie(seq->prompt, seq->sampling) = std::move(request).take();
  seq->text_stream = detokenizer_.start(seq->prompt, seq->sampling.skip_special_tokens);
  uint64_t id = seq->id;
  scheduler_.add(std::move(seq));
  return id;
}

StepInput LlmEngine::make_step(const std::vector<ScheduledChunk>& chunks) {
  StepInput step;
  step.step_id = next_step_++;
  step.finished = std::move(finished_since_last_step_);
  finished_since_last_step_.clear();
  for (uint64_t id : scheduler_.take_preempted()) step.finished.push_back(id);
  for (const auto& c : chunks) {
    Sequence& seq = *c.seq;
    SeqStep s;
    s.request_id = seq.id;
    for (size_t i = c.start; i < c.start + c.count; ++i) {
      // Async scheduling: the token the step in flight samples, which the actor fills in.
      s.tokens.push_back(i < seq.total() ? seq.token_at(i) : kSampledToken);
    }
    s.start_position = static_cast<int64_t>(c.start);
    s.new_blocks.assign(seq.block_table.begin() + static_cast<std::ptrdiff_t>(seq.sent_blocks),
                        seq.block_table.end());
    seq.sent_blocks = seq.block_table.size();
    s.sample = c.sample;
    s.first = !seq.started;
    if (s.first) {
      s.prompt_len = static_cast<int64_t>(seq.prompt.size());
      s.sampling = seq.sampling;
      for (size_t i = 0; i < c.start; ++i) s.prefix_tokens.push_back(seq.token_at(i));
      seq.started = true;
    }
    step.seqs.push_back(std::move(s));
  }
  return step;
}

RequestOutput LlmEngine::final_output(const Sequence& seq, FinishReason reason, Status error) {
  RequestOutput out;
  out.request_id = seq.id;
  out.finished = true;
  out.finish_reason = reason;
  out.error = std::move(error);
  out.prompt_tokens = seq.prompt.size();
  out.completion_tokens = seq.output.size();
  out.cached_tokens = seq.cached_tokens;
  return out;
}

void LlmEngine::fail(const std::vector<ScheduledChunk>& chunks, const Status& why,
                     std::vector<RequestOutput>& outputs) {
  for (const auto& c : chunks) {
    if (c.seq->aborted) continue;  // already ended
    auto seq = scheduler_.finish(c.seq->id);
    if (!seq) continue;
    finished_since_last_step_.push_back(seq->id);
    outputs.push_back(final_output(*seq, FinishReason::kError, why));
    keep_until_collected(std::move(seq));
  }
}

void LlmEngine::keep_until_collected(std::unique_ptr<Sequence> seq) {
  if (seq == nullptr || seq->in_flight == 0) return;
  seq->aborted = true;
  aborted_in_flight_.push_back(std::move(seq));
}

std::vector<std::unique_ptr<Sequence>> LlmEngine::take_aborted(
    const std::vector<ScheduledChunk>& chunks) {
  std::vector<std::unique_ptr<Sequence>> out;
  for (const auto& c : chunks) {
    if (!c.seq->aborted || c.seq->in_flight > 0) continue;  // still in a later step
    auto it = std::find_if(aborted_in_flight_.begin(), aborted_in_flight_.end(),
                           [&](const auto& s) { return s.get() == c.seq; });
    TESSERA_CHECK(it != aborted_in_flight_.end(), "an aborted sequence not kept until its step");
    out.push_back(std::move(*it));
    aborted_in_flight_.erase(it);
  }
  return out;
}

std::optional<RequestOutput> LlmEngine::abort_request(uint64_t id) {
  std::unique_ptr<Sequence> seq = scheduler_.finish(id);
  if (!seq) return std::nullopt;
  // The actors forget it before the next step; one in flight is still computed by the steps
  // ahead of that one, which is why its blocks can be reused from the next step on.
  if (seq->started) finished_since_last_step_.push_back(id);
  RequestOutput out = final_output(*seq, FinishReason::kAbort);
  keep_until_collected(std::move(seq));
  return out;
}

Expected<std::vector<RequestOutput>> LlmEngine::step() {
  std::vector<RequestOutput> outputs;
  // Fill the pipeline: one step per stage can be in flight, each with other sequences (with
  // async scheduling two, the second continuing the first's decodes).
  while (static_cast<int>(in_flight_.size()) < depth_) {
    std::vector<ScheduledChunk> chunks = scheduler_.schedule();
    if (chunks.empty()) break;
    StepInput input = make_step(chunks);
    std::vector<uint64_t> forget = input.finished;
    Status sent = executor_.submit(std::move(input));
    if (!sent) {
      // Whether the actors saw it is unknown: tell them again (forgetting twice is harmless).
      finished_since_last_step_.insert(finished_since_last_step_.end(), forget.begin(),
                                       forget.end());
      for (const auto& c : chunks) --c.seq->in_flight;
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
  for (const auto& c : chunks) --c.seq->in_flight;
  // Sequences aborted meanwhile: alive until this step is handled, their results dropped.
  std::vector<std::unique_ptr<Sequence>> aborted = take_aborted(chunks);
  auto result = executor_.collect();
  if (!result) {
    // The step failed: every request in it fails, the others (and the engine) go on.
    fail(chunks, result.status(), outputs);
    return outputs;
  }
  size_t next = 0;
  std::vector<uint64_t> done;
  for (const auto& c : chunks) {
    if (c.sample) {
      if (next >= result->outputs.size() || result->outputs[next].request_id != c.seq->id) {
        return internal_error("the actors returned " + std::to_string(result->outputs.size()) +
                              " samples for a step that asked for more, or out of order");
      }
      ++next;
    }
    if (c.seq->aborted) continue;  // its result is dropped
    c.seq->computed = c.start + c.count;
    blocks_.commit(*c.seq);  // its newly full blocks hold K/V now: cache them
    blocks_.release_out_of_window(*c.seq);  // sliding window: blocks no later step reads
    if (!c.sample) continue;
    const SampleResult& sampled = result->outputs[next - 1].sample;
    TokenLogprobs token{sampled.token, sampled.logprob, sampled.top_logprobs};
    RequestOutput out;
    out.request_id = c.seq->id;
    postprocess(*c.seq, token, out);
    if (out.finished) done.push_back(c.seq->id);
    outputs.push_back(std::move(out));
  }
  for (uint64_t id : done) {
    // With async scheduling the next step may hold it already: kept until that one is collected,
    // its result dropped; the actors forget it after that step.
    keep_until_collected(scheduler_.finish(id));
    finished_since_last_step_.push_back(id);
  }
  return outputs;
}

void LlmEngine::postprocess(Sequence& seq, const TokenLogprobs& sampled, RequestOutput& out) {
  const SamplingParams& s = seq.sampling;
  seq.output.push_back(sampled.token);
  out.new_tokens.push_back(sampled.token);
  ++generation_tokens_;
  if (seq.output.size() == 1) prompt_tokens_ += seq.prompt.size();
  if (s.logprobs >= 0) {
    seq.logprobs.push_back(sampled);
    out.new_logprobs.push_back(sampled);
  }
  bool is_eos = std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(),
                          sampled.token) != config_.eos_token_ids.end();
  bool is_stop_id = std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), sampled.token) !=
                    s.stop_token_ids.end();
  // Text: only this token's, from the request's stream (an incomplete character stays in the
  // stream until a later token completes it).
  const size_t searched = seq.text.size();  // text before this token, already searched
  seq.text += seq.text_stream->push(sampled.token);
  if ((is_eos && !s.ignore_eos) || is_stop_id) {
    seq.finish_reason = FinishReason::kStop;
    if (is_stop_id && !(is_eos && !s.ignore_eos)) out.stop_reason = sampled.token;
  } else if (static_cast<int>(seq.output.size()) >= s.max_tokens) {
    seq.finish_reason = FinishReason::kLength;
  } else if (seq.total() >= max_len_) {
    seq.finish_reason = FinishReason::kLength;
  }
  if (seq.finish_reason != FinishReason::kNone) {
    // The end: what the stream held back, but never a broken character.
    std::string rest = seq.text_stream->flush();
    if (ends_with(rest, kReplacement)) rest.resize(rest.size() - kReplacement.size());
    seq.text += rest;
  }
  // Stop strings: a new match ends in the new text, so it starts at most size - 1 bytes before.
  size_t stop_at = std::string::npos;
  const std::string* stop_string = nullptr;
  for (const auto& stop : s.stop) {
    if (stop.empty()) continue;
    size_t from = searched - std::min(searched, stop.size() - 1);
    size_t pos = seq.text.find(stop, from);
    if (pos != std::string::npos && pos < stop_at) {
      stop_at = pos;
      stop_string = &stop;
    }
  }
  if (stop_string != nullptr) {
    seq.text.resize(stop_at);
    seq.finish_reason = FinishReason::kStop;
    out.stop_reason = *stop_string;
  }
  out.finished = seq.finish_reason != FinishReason::kNone;
  out.finish_reason = seq.finish_reason;
  // Emit what can no longer change: all of it when finished; otherwise hold back a tail that
  // could still become the start of a stop string.
  size_t emit_to = seq.text.size();
  if (!out.finished) emit_to -= stop_prefix_at_end(seq.text, seq.emitted, s.stop);
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
  out.cached_tokens = seq.cached_tokens;
}

EngineStats LlmEngine::stats() const {
  EngineStats s;
  s.running = scheduler_.running();
  s.waiting = scheduler_.waiting();
  s.kv_blocks_total = blocks_.total_blocks();
  s.kv_blocks_used = blocks_.used_blocks();
  s.kv_cache_usage = s.kv_blocks_total == 0 ? 0.0
                                            : static_cast<double>(s.kv_blocks_used) /
                                                  static_cast<double>(s.kv_blocks_total);
  s.prefix_cache_queries = blocks_.prefix_queries();
  s.prefix_cache_hits = blocks_.prefix_hits();
  s.prompt_tokens = prompt_tokens_;
  s.generation_tokens = generation_tokens_;
  s.preemptions = scheduler_.preemptions();
  return s;
}

}  // namespace tessera
