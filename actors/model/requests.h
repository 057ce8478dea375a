// The live requests of one actor: what the driver sent so far of each (its KV block table, its
// tokens, its sampling parameters), so that a step only has to carry what changed. Shared by
// every backend: a step is applied here first, then the backend runs the forward pass over the
// batch view this table builds.
//
// Token history: the tokens of a request arrive in order as step inputs (prompt chunks, then
// each sampled token fed back). The first prompt_len of them are the prompt; the rest are the
// output so far — the history the penalties read when this rank samples. A request restarted
// after preemption arrives again as a `first` step with its prompt_len, its output re-fed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "common/load_spec.h"
#include "common/sampling_params.h"
#include "common/status.h"
#include "common/step.h"

namespace tessera {

// One sequence's slice of a forward batch (views into the request table and the step).
struct ForwardSeq {
  std::span<const int32_t> tokens;  // the new tokens
  int64_t start_position = 0;       // position of tokens[0]
  std::span<const uint32_t> block_table;
  bool want_logits = false;  // logits of the last new token are returned
};

struct RequestState;

// A row to sample: the request whose last forwarded token it follows.
struct SampleRequest {
  uint64_t request_id = 0;
  const RequestState* state = nullptr;
};

// A token of a batch that is the sample of the step launched before, still running (async
// scheduling): seqs()[seq].tokens holds one kSampledToken, which the backend replaces with that
// step's sample of row `row` before the forward pass reads it.
struct TokenFill {
  size_t seq = 0;
  size_t row = 0;
};

// One step as the backends run it, made only by RequestTable::batch from a step apply()
// accepted. What that proves, the contract every backend relies on (and checks nothing of
// again): at most max_num_seqs sequences and max_num_batched_tokens tokens; each sequence has
// tokens, continues its request at start_position and ends within max_model_len; its block
// table covers those positions, is no longer than max_model_len needs, and names blocks inside
// the KV cache; its tokens are in the vocabulary, or kSampledToken exactly where a fill replaces
// it (one decode token, from a row of the step before). Views into the table: valid until its
// next apply().
class StepBatch {
 public:
  std::span<const ForwardSeq> seqs() const { return seqs_; }
  // The rows to sample (the sequences with want_logits, in order).
  std::span<const SampleRequest> rows() const { return rows_; }
  std::span<const TokenFill> fills() const { return fills_; }
  bool empty() const { return seqs_.empty(); }

 private:
  friend class RequestTable;
  StepBatch() = default;
  std::vector<ForwardSeq> seqs_;
  std::vector<SampleRequest> rows_;
  std::vector<TokenFill> fills_;
};

struct RequestState {
  SamplingParams sampling;
  uint64_t seed = 0;  // sampling.seed, or one drawn when the request arrived
  int64_t prompt_len = 0;
  std::vector<uint32_t> blocks;
  std::vector<int32_t> tokens;  // every token received, in position order
  // Async scheduling. The token this rank sampled in the request's last step, until a step takes
  // it as input (kSampledToken); none on a rank that does not sample.
  std::optional<int32_t> last_sampled;
  // Steps running on this rank that sample the request (expect_sample), not recorded yet.
  int pending_samples = 0;
  // Where in `tokens` a kSampledToken went whose sample was still pending when its step was
  // applied (the step before it was still running): the backend fills the token in from that
  // step's sample, and record_sample() writes it here. Holds kSampledToken until then.
  std::optional<size_t> placeholder;
  std::span<const int32_t> prompt() const {
    return {tokens.data(), static_cast<size_t>(std::min<int64_t>(prompt_len, tokens.size()))};
  }
  std::span<const int32_t> output() const {
    auto p = prompt().size();
    return {tokens.data() + p, tokens.size() - p};
  }
};

class RequestTable {
 public:
  // Steps are checked against what this rank reports of itself: its vocabulary, KV blocks
  // (kv_blocks, set again by set_num_blocks once the cache is allocated), block size,
  // max_model_len, max_num_seqs and max_num_batched_tokens.
  explicit RequestTable(ModelInfo limits);

  // Checks the whole step against the table and the limits, then applies it: forgets the
  // finished requests, starts the new ones, appends tokens and blocks. On error nothing
  // changes: INVALID_ARGUMENT for a malformed step (a token outside the vocabulary, a position
  // that does not continue the request, a block outside the cache, too many tokens or
  // sequences, bad sampling parameters), FAILED_PRECONDITION for a continuing request this
  // actor has no state for, or a kSampledToken it has no sample for (a step that is not one
  // decode token right after a sampled one, or a rank that does not sample).
  //
  // A kSampledToken is the request's last recorded sample, or, while exactly one step that
  // samples it is in flight (pending), a placeholder for that step's sample (placeholders()).
  Status apply(const StepInput& step);

  // The forward batch of the step applied last (views valid until the next apply()); its tokens
  // are the table's: a kSampledToken is the sample, or kSampledToken where it is a placeholder,
  // which `fills` (by index in step.seqs) replace from the samples of the step before.
  StepBatch batch(const StepInput& step, std::vector<TokenFill> fills = {}) const;
  // The indices in step.seqs of the last applied step's placeholders.
  const std::vector<size_t>& placeholders() const { return placeholders_; }
  // A rank that does not sample (tensor parallelism) never has the sample on the host: every
  // kSampledToken is a placeholder there, which the backend fills in from the sampling rank's
  // samples. Set once, before the first step.
  void set_samples(bool samples) { samples_ = samples; }
  // This rank is to sample the request in a step it is running (after apply(); one call per
  // step that samples it, on the rank that samples).
  void expect_sample(uint64_t request_id);
  // The token this rank sampled for a request in its oldest pending step: fills the placeholder
  // waiting for it, or is kept for the next step's kSampledToken.
  void record_sample(uint64_t request_id, int32_t token);

  const RequestState& at(uint64_t request_id) const { return requests_.at(request_id); }
  // The request's state, or null.
  const RequestState* find(uint64_t request_id) const {
    auto it = requests_.find(request_id);
    return it != requests_.end() ? &it->second : nullptr;
  }
  size_t size() const { return requests_.size(); }
  // Requests forgotten by the last apply() (a backend drops its own per-request state for them).
  const std::vector<uint64_t>& forgotten() const { return forgotten_; }
  void set_num_blocks(int64_t blocks) { limits_.kv_blocks = blocks; }
  const ModelInfo& limits() const { return limits_; }

 private:
  ModelInfo limits_;
  std::map<uint64_t, RequestState> requests_;
  std::vector<uint64_t> forgotten_;
  std::vector<size_t> placeholders_;
  bool samples_ = true;
  uint64_t seed_state_;
};

}  // namespace tessera
