#include "actors/model/requests.h"

#include <random>
#include <set>
#include <string>

namespace tessera {

RequestTable::RequestTable(ModelInfo limits)
    : limits_(std::move(limits)), seed_state_(std::random_device{}()) {}

Status RequestTable::apply(const StepInput& step) {
  const auto& L = limits_;
  if (static_cast<int64_t>(step.seqs.size()) > L.max_num_seqs) {
    return invalid_argument("the step has " + std::to_string(step.seqs.size()) +
                            " sequences, more than max-num-seqs " + std::to_string(L.max_num_seqs));
  }
  std::set<uint64_t> finished(step.finished.begin(), step.finished.end());
  std::set<uint64_t> in_step;
  int64_t tokens = 0;
  // Pass 1: check everything against the state as it will be after `finished` is dropped.
  for (const SeqStep& s : step.seqs) {
    const std::string who = "request " + std::to_string(s.request_id);
    if (!in_step.insert(s.request_id).second) {
      return invalid_argument(who + " appears twice in one step");
    }
    if (s.tokens.empty()) return invalid_argument(who + ": a step needs at least one token");
    tokens += static_cast<int64_t>(s.tokens.size());
    auto it = requests_.find(s.request_id);
    const bool known = it != requests_.end() && !finished.count(s.request_id);
    if (!s.first && !known) {
      return failed_precondition(who +
                                 " has no state on this actor (its first step never came): the "
                                 "driver must send it with first = true");
    }
    if (s.first) {
      TESSERA_RETURN_IF_ERROR(s.sampling.validate(L.vocab_size));
      if (s.start_position != static_cast<int64_t>(s.prefix_tokens.size())) {
        return invalid_argument(who + ": a first step starts after its cached prefix (" +
                                std::to_string(s.prefix_tokens.size()) + " tokens), not at " +
                                std::to_string(s.start_position));
      }
      for (int32_t t : s.prefix_tokens) {
        if (t < 0 || t >= L.vocab_size) {
          return invalid_argument(who + ": prefix token id " + std::to_string(t) +
                                  " is outside the vocabulary");
        }
      }
      if (s.prompt_len < 1) return invalid_argument(who + ": prompt_len must be at least 1");
    }
    const int64_t seen = s.first ? static_cast<int64_t>(s.prefix_tokens.size())
                                 : static_cast<int64_t>(it->second.tokens.size());
    if (s.start_position != seen) {
      return invalid_argument(who + " continues at position " + std::to_string(s.start_position) +
                              " but this actor has " + std::to_string(seen) + " of its tokens");
    }
    const int64_t end = seen + static_cast<int64_t>(s.tokens.size());
    if (end > L.max_model_len) {
      return invalid_argument(who + ": positions up to " + std::to_string(end) +
                              " exceed max-model-len " + std::to_string(L.max_model_len));
    }
    const int64_t blocks = (s.first ? 0 : static_cast<int64_t>(it->second.blocks.size())) +
                           static_cast<int64_t>(s.new_blocks.size());
    if (blocks * L.block_size < end) {
      return invalid_argument(who + ": its block table holds " +
                              std::to_string(blocks * L.block_size) + " tokens, it needs " +
                              std::to_string(end));
    }
    const int64_t most_blocks = (L.max_model_len + L.block_size - 1) / L.block_size;
    if (blocks > most_blocks) {
      return invalid_argument(who + ": its block table has " + std::to_string(blocks) +
                              " blocks, more than max-model-len needs (" +
                              std::to_string(most_blocks) + ")");
    }
    for (uint32_t b : s.new_blocks) {
      if (static_cast<int64_t>(b) >= L.kv_blocks) {
        return invalid_argument(who + ": block " + std::to_string(b) +
                                " is outside the KV cache (" + std::to_string(L.kv_blocks) +
                                " blocks)");
      }
    }
    if (takes_sampled_token(s)) {
      if (!samples_) continue;  // a placeholder, always
      const RequestState& r = it->second;
      const bool recorded = r.pending_samples == 0 && r.last_sampled;
      const bool pending = r.pending_samples == 1 && !r.placeholder;
      if (!recorded && !pending) {
        if (r.pending_samples > 0) {
          return failed_precondition(
              who + " asks for the token this actor sampled last while " +
              std::to_string(r.pending_samples) +
              " samples of it are pending: only the step right after the one that samples it "
              "may take it");
        }
        return failed_precondition(who +
                                   " asks for the token this actor sampled last, but it "
                                   "has none (async scheduling needs one rank)");
      }
      continue;
    }
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= L.vocab_size) {
        return invalid_argument(who + ": token id " + std::to_string(t) +
                                " is outside the vocabulary (" + std::to_string(L.vocab_size) +
                                " tokens)");
      }
    }
  }
  if (L.max_num_batched_tokens > 0 && tokens > L.max_num_batched_tokens) {
    return invalid_argument("the step has " + std::to_string(tokens) +
                            " tokens, more than max-num-batched-tokens " +
                            std::to_string(L.max_num_batched_tokens));
  }
  // Pass 2: apply.
  forgotten_.clear();
  placeholders_.clear();
  for (uint64_t id : step.finished) {
    if (requests_.erase(id)) forgotten_.push_back(id);
  }
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SeqStep& s = step.seqs[i];
    if (s.first) {
      if (requests_.erase(s.request_id)) forgotten_.push_back(s.request_id);
      RequestState r;
      r.sampling = s.sampling;
      if (s.sampling.seed) {
        r.seed = *s.sampling.seed;
      } else {
        seed_state_ = seed_state_ * 6364136223846793005ull + 1442695040888963407ull;
        r.seed = seed_state_ ^ (seed_state_ >> 29);
      }
      r.prompt_len = s.prompt_len;
      r.tokens = s.prefix_tokens;
      requests_.emplace(s.request_id, std::move(r));
    }
    RequestState& r = requests_.at(s.request_id);
    r.blocks.insert(r.blocks.end(), s.new_blocks.begin(), s.new_blocks.end());
    if (takes_sampled_token(s)) {
      if (!samples_) {
        r.tokens.push_back(kSampledToken);
        placeholders_.push_back(i);
      } else if (r.pending_samples == 0) {
        r.tokens.push_back(*r.last_sampled);
      } else {
        r.placeholder = r.tokens.size();
        r.tokens.push_back(kSampledToken);
        placeholders_.push_back(i);
      }
    } else {
      r.tokens.insert(r.tokens.end(), s.tokens.begin(), s.tokens.end());
    }
    r.last_sampled.reset();
  }
  return Status::ok();
}

void RequestTable::expect_sample(uint64_t request_id) {
  auto it = requests_.find(request_id);
  if (it != requests_.end()) ++it->second.pending_samples;
}

void RequestTable::record_sample(uint64_t request_id, int32_t token) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  RequestState& r = it->second;
  if (r.pending_samples > 0) --r.pending_samples;
  if (r.placeholder) {
    r.tokens[*r.placeholder] = token;
    r.placeholder.reset();
  } else {
    r.last_sampled = token;
  }
}

StepBatch RequestTable::batch(const StepInput& step, std::vector<TokenFill> fills) const {
  StepBatch out;
  out.seqs_.reserve(step.seqs.size());
  for (const SeqStep& s : step.seqs) {
    const RequestState& r = requests_.at(s.request_id);
    const std::span<const int32_t> tokens(r.tokens);
    out.seqs_.push_back({tokens.subspan(static_cast<size_t>(s.start_position), s.tokens.size()),
                         s.start_position, r.blocks, s.sample});
    if (s.sample) out.rows_.push_back({s.request_id, &r});
  }
  // The runner makes the fills from the placeholders apply() left and the rows of the step
  // before (at most max_num_seqs of them): a fill elsewhere is a bug of this process.
  for (const TokenFill& f : fills) {
    TESSERA_CHECK(f.seq < out.seqs_.size() && out.seqs_[f.seq].tokens.size() == 1 &&
                      static_cast<int64_t>(f.row) < limits_.max_num_seqs,
                  "a token fill outside the batch's decode tokens");
  }
  out.fills_ = std::move(fills);
  return out;
}

}  // namespace tessera
