// Fakes for the engine tests: a detokenizer over a fixed piece table and an executor that
// computes a checkable stand-in for the model's KV cache, plus helpers that drive an engine to
// the end and compare what requests produced.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "driver/engine/engine.h"

namespace tessera::engine_testing {

// Token i decodes to pieces[i]. Each request's stream emits the complete UTF-8 characters it
// has and holds an incomplete one back (flush() turns it into U+FFFD), as IncrementalDecoder
// does. `pushes` counts the ids pushed into all streams: one per generated token means the
// engine never decodes an output again.
class FakeDetokenizer final : public Detokenizer {
 public:
  std::map<int32_t, std::string> pieces = {
      {1, "a"}, {2, "b"},     {3, "\xE4"}, {4, "\xBD\xA0"}, {5, " X"}, {6, "ST"}, {7, "OP"},
      {8, "!"}, {9, "<eos>"}, {10, "c"},   {11, "S"},       {12, "T"}, {13, "O"}, {14, "P"}};
  mutable size_t pushes = 0;

  std::unique_ptr<TextStream> start(std::span<const int32_t>, bool skip_special) const override {
    return std::make_unique<Stream>(*this, skip_special);
  }

 private:
  class Stream final : public TextStream {
   public:
    Stream(const FakeDetokenizer& d, bool skip_special) : d_(d), skip_special_(skip_special) {}
    std::string push(int32_t id) override {
      ++d_.pushes;
      if (!(id == 9 && skip_special_)) {
        auto it = d_.pieces.find(id);
        pending_ += it == d_.pieces.end() ? "?" : it->second;
      }
      // Emit up to the start of a trailing incomplete character.
      size_t i = pending_.size();
      size_t back = 0;
      while (i > 0 && back < 4 && (static_cast<unsigned char>(pending_[i - 1]) & 0xC0) == 0x80) {
        --i;
        ++back;
      }
      size_t cut = pending_.size();
      if (i > 0) {
        unsigned char lead = static_cast<unsigned char>(pending_[i - 1]);
        size_t need = lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : 0;
        if (need > back) cut = i - 1;
      }
      std::string out = pending_.substr(0, cut);
      pending_.erase(0, cut);
      return out;
    }
    std::string flush() override {
      std::string out = pending_.empty() ? "" : "\xEF\xBF\xBD";
      pending_.clear();
      return out;
    }

   private:
    const FakeDetokenizer& d_;
    bool skip_special_;
    std::string pending_;
  };
};

// A model the engine cannot tell from a real one where it matters: it keeps a KV cache of
// "contents" per physical block slot and computes position p's content from the token at p and
// the content it reads at p - 1 through the request's block table (as the actors rebuild it
// from the deltas). Its sampled token derives from the last position's content, so it depends
// on the whole history as the cache holds it: a block shared wrongly, or overwritten while
// another request reads it, changes the output. Scripted tokens (per request) take precedence.
//
// It checks the protocol as actors/model/requests.cpp does (a continuing request must be
// known and continue at the position it reached; blocks inside the cache) and more: no
// position reads a slot never written, and no request writes a block another live request
// holds. Violations are recorded, not fatal. Steps are computed in submission order when
// collected; up to `depth` may be in flight (pipeline parallelism).
//
// Unlike the real actors today (actors/model/requests.cpp, RequestTable::apply, refuses it), a
// `first` step may start at a position > 0 on blocks that already hold the prefix (prefix
// caching).
class FakeExecutor final : public StepExecutor {
 public:
  explicit FakeExecutor(uint32_t block_size = 4, uint32_t num_blocks = 256)
      : block_size_(block_size), kv_(static_cast<size_t>(block_size) * num_blocks, 0) {}

  std::map<uint64_t, std::deque<int32_t>> script;
  std::vector<StepInput> batches;
  // Every live request's block table as the actors would rebuild it from the deltas.
  std::map<uint64_t, std::vector<uint32_t>> tables;
  std::vector<std::string> violations;
  int fail_next = 0;    // collects that fail
  int fail_submit = 0;  // submits that fail
  int depth = 1;
  // The model's sliding window (EngineConfig::kv_window): the entries of a table before its
  // request's window are stale (the engine freed those blocks and may have handed them on).
  uint32_t window = 0;
  size_t max_in_flight = 0;
  std::deque<StepInput> in_flight;

  Status submit(StepInput step) override {
    if (fail_submit > 0) {
      --fail_submit;
      return unavailable("the connection to actor a-0 broke");
    }
    for (const auto& s : step.seqs) {
      const bool ahead = s.tokens.size() == 1 && s.tokens[0] == kSampledToken;  // async
      if (in_flight_has(s.request_id) && !ahead) {
        violations.push_back("step " + std::to_string(step.step_id) + " has request " +
                             std::to_string(s.request_id) + ", which a step in flight has too");
      }
    }
    batches.push_back(step);
    in_flight.push_back(std::move(step));
    max_in_flight = std::max(max_in_flight, in_flight.size());
    return Status::ok();
  }
  Expected<StepOutput> collect() override {
    StepInput step = std::move(in_flight.front());
    in_flight.pop_front();
    if (fail_next > 0) {
      --fail_next;
      return unavailable("actor a-1 died (killed by signal 9)");
    }
    return compute(step);
  }
  int pipeline_depth() const override { return depth; }
  bool in_flight_has(uint64_t id) const {
    for (const auto& step : in_flight) {
      for (const auto& s : step.seqs) {
        if (s.request_id == id) return true;
      }
    }
    return false;
  }

 private:
  static uint64_t content(uint64_t previous, int32_t token, int64_t position) {
    uint64_t x = previous ^ (static_cast<uint64_t>(token) << 32) ^ static_cast<uint64_t>(position);
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return (x ^ (x >> 31)) | 1;  // 0 marks a slot never written
  }
  uint64_t* slot(const std::vector<uint32_t>& table, int64_t position) {
    size_t b = static_cast<size_t>(position) / block_size_;
    if (b >= table.size()) return nullptr;
    size_t index = static_cast<size_t>(table[b]) * block_size_ + position % block_size_;
    return index < kv_.size() ? &kv_[index] : nullptr;
  }
  bool held_by_other(uint64_t id, uint32_t block) const {
    for (const auto& [other, table] : tables) {
      if (other == id) continue;
      size_t live = 0;  // the first entry a later step of `other` reads
      if (window > 0) {
        const auto it = seen_.find(other);
        const int64_t seen = it == seen_.end() ? 0 : it->second;
        live = static_cast<size_t>(std::max<int64_t>(0, seen - window + 1)) / block_size_;
      }
      live = std::min(live, table.size());
      if (std::find(table.begin() + static_cast<std::ptrdiff_t>(live), table.end(), block) !=
          table.end()) {
        return true;
      }
    }
    return false;
  }

  StepOutput compute(const StepInput& step) {
    for (uint64_t id : step.finished) {
      tables.erase(id);
      seen_.erase(id);
      sampled_.erase(id);
    }
    StepOutput r;
    r.step_id = step.step_id;
    for (const auto& w : step.seqs) {
      const std::string who = "step " + std::to_string(step.step_id) + " request " +
                              std::to_string(w.request_id) + ": ";
      if (w.first) {
        tables[w.request_id].clear();
        seen_[w.request_id] = w.start_position;
      } else if (!tables.count(w.request_id)) {
        violations.push_back(who + "continues but the actors do not know it");
        seen_[w.request_id] = w.start_position;
      }
      if (w.start_position != seen_[w.request_id]) {
        violations.push_back(who + "starts at " + std::to_string(w.start_position) +
                             ", the actors have " + std::to_string(seen_[w.request_id]));
      }
      auto& table = tables[w.request_id];
      table.insert(table.end(), w.new_blocks.begin(), w.new_blocks.end());
      // Async scheduling: kSampledToken is the token sampled for it in the step before, as the
      // actors fill it in.
      std::vector<int32_t> tokens = w.tokens;
      const auto sampled = sampled_.find(w.request_id);
      for (int32_t& t : tokens) {
        if (t != kSampledToken) continue;
        if (tokens.size() != 1 || w.first || sampled == sampled_.end()) {
          violations.push_back(who + "asks for a sampled token the actors do not have");
          t = 0;
        } else {
          t = sampled->second;
        }
      }
      sampled_.erase(w.request_id);
      uint64_t last = 0;
      for (size_t i = 0; i < tokens.size(); ++i) {
        int64_t p = w.start_position + static_cast<int64_t>(i);
        uint64_t previous = 7;
        if (p > 0) {
          uint64_t* read = slot(table, p - 1);
          if (read == nullptr || *read == 0) {
            violations.push_back(who + "position " + std::to_string(p - 1) + " was never written");
          }
          previous = read ? *read : 0;
        }
        uint64_t* write = slot(table, p);
        if (write == nullptr) {
          violations.push_back(who + "no block for position " + std::to_string(p));
          continue;
        }
        if (held_by_other(w.request_id, table[static_cast<size_t>(p) / block_size_])) {
          violations.push_back(who + "writes a block another request holds");
        }
        *write = last = content(previous, tokens[i], p);
      }
      seen_[w.request_id] += static_cast<int64_t>(tokens.size());
      if (!w.sample) continue;
      auto& q = script[w.request_id];
      int32_t t = static_cast<int32_t>(20 + last % 70);  // never EOS (9) or a text piece
      if (!q.empty()) {
        t = q.front();
        q.pop_front();
      }
      sampled_[w.request_id] = t;
      r.outputs.push_back({w.request_id, {t, -0.5f, {}}});
    }
    return r;
  }

  uint32_t block_size_;
  std::vector<uint64_t> kv_;
  std::map<uint64_t, int64_t> seen_;  // tokens each live request has sent
  std::map<uint64_t, int32_t> sampled_;  // the token sampled in each request's last step
};

inline EngineConfig config(uint32_t blocks = 64, uint32_t budget = 2048, uint32_t max_len = 256) {
  EngineConfig c;
  c.model.kv_blocks = blocks;
  c.model.block_size = 4;
  c.model.max_num_seqs = 256;
  c.model.max_num_batched_tokens = budget;
  c.model.max_model_len = max_len;
  c.model.vocab_size = 100;
  c.eos_token_ids = {9};
  return c;
}

// Queues a request made against the engine's model, as the driver's callers make theirs
// (request.h): the checks of Request::make, then the engine's own.
inline Expected<uint64_t> add(LlmEngine& engine, std::vector<int32_t> prompt,
                              SamplingParams sampling) {
  TESSERA_ASSIGN_OR_RETURN(
      Request r, Request::make(std::move(prompt), std::move(sampling), engine.config().model));
  return engine.add_request(std::move(r));
}

struct Run {
  std::string text;
  size_t cached_tokens = 0;
  std::vector<int32_t> tokens;
  std::string finish;  // finish_reason_name of its finish reason
  Status error;        // with finish "error"
  std::vector<std::string> deltas;
};

inline std::map<uint64_t, Run> run_all(LlmEngine& engine) {
  std::map<uint64_t, Run> runs;
  for (int i = 0; i < 1000 && engine.has_unfinished(); ++i) {
    auto outs = engine.step();
    EXPECT_TRUE(outs) << outs.status().to_string();
    if (!outs) break;
    for (auto& o : *outs) {
      auto& r = runs[o.request_id];
      r.text += o.delta;
      if (!o.delta.empty()) r.deltas.push_back(o.delta);
      r.tokens.insert(r.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) r.finish = finish_reason_name(o.finish_reason);
      if (o.finished) r.error = o.error;
      r.cached_tokens = o.cached_tokens;
    }
  }
  return runs;
}

inline bool operator==(const Run& a, const Run& b) {
  return a.text == b.text && a.tokens == b.tokens && a.finish == b.finish;
}

inline std::ostream& operator<<(std::ostream& os, const Run& r) {
  os << "{" << r.finish << ", [";
  for (int32_t t : r.tokens) os << t << " ";
  return os << "]}";
}

inline SamplingParams opts(int max_tokens) {
  SamplingParams s;
  s.max_tokens = max_tokens;
  return s;
}

}  // namespace tessera::engine_testing
