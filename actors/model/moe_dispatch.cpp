#include "actors/model/moe_dispatch.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "common/checkpoint/layer_plan.h"

namespace tessera {

namespace {

// A dispatched row: its hidden state, then top_k expert ids (int32 bits, -1 = a slot for another
// rank) and top_k weights, all as 4-byte words so one buffer of floats carries it.
struct RecordLayout {
  int64_t hidden, top_k;
  int64_t words() const { return hidden + 2 * top_k; }
  int64_t bytes() const { return words() * 4; }
};

}  // namespace

Status moe_expert_parallel(cpu::CpuContext& ctx, const cpu::MoeLayer& layer, int64_t num_experts,
                           comm::Communicator& group, std::span<const float> x, std::span<float> y,
                           std::vector<int64_t>* routed) {
  const int64_t H = layer.router.shape.at(1), K = layer.top_k;
  const int R = group.size(), me = group.rank();
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  if (static_cast<int64_t>(y.size()) != T * H) {
    return invalid_argument("moe (expert parallel): y has " + std::to_string(y.size()) +
                            " elements for " + std::to_string(T) + " tokens");
  }
  // Which rank holds each expert (the layer plan's placement).
  std::vector<int> owner(static_cast<size_t>(num_experts));
  for (int p = 0; p < R; ++p) {
    auto [first, n] = expert_range(num_experts, R, p);
    for (int64_t e = first; e < first + n; ++e) owner[static_cast<size_t>(e)] = p;
  }
  const int64_t begin = T * me / R, end = T * (me + 1) / R, mine = end - begin;
  cpu::MoeRoute route;
  if (mine > 0) {
    TESSERA_ASSIGN_OR_RETURN(route, cpu::moe_route(ctx, layer, x.subspan(begin * H, mine * H)));
  }
  if (routed != nullptr) {
    routed->resize(static_cast<size_t>(num_experts), 0);
    for (int32_t e : route.expert) ++(*routed)[static_cast<size_t>(e)];
  }

  // 1. Dispatch: the records for each rank, in rank order, each of this rank's rows once per
  //    rank that holds one of its experts.
  const RecordLayout rec{H, K};
  std::vector<std::vector<int64_t>> sent_rows(static_cast<size_t>(R));  // row index, per rank
  std::vector<float> out_records;
  std::vector<int64_t> send_bytes(static_cast<size_t>(R)), recv_bytes(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    for (int64_t t = 0; t < mine; ++t) {
      bool any = false;
      for (int64_t k = 0; k < K && !any; ++k) any = owner[route.expert[t * K + k]] == p;
      if (!any) continue;
      sent_rows[static_cast<size_t>(p)].push_back(begin + t);
      const size_t at = out_records.size();
      out_records.resize(at + static_cast<size_t>(rec.words()));
      float* r = out_records.data() + at;
      std::copy_n(x.data() + (begin + t) * H, H, r);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = route.expert[t * K + k];
        const int32_t id = owner[static_cast<size_t>(e)] == p ? e : -1;
        std::memcpy(r + H + k, &id, 4);
        r[H + K + k] = route.weight[t * K + k];
      }
    }
    send_bytes[static_cast<size_t>(p)] =
        static_cast<int64_t>(sent_rows[static_cast<size_t>(p)].size()) * rec.bytes();
  }
  // The counts first (fixed size), so every rank knows what arrives.
  std::vector<int64_t> eight(static_cast<size_t>(R), 8);
  TESSERA_RETURN_IF_ERROR(
      group.all_to_all(send_bytes.data(), eight, recv_bytes.data(), eight, nullptr)
          .with_context("expert-parallel dispatch sizes"));
  int64_t received = 0;
  for (int64_t b : recv_bytes) {
    if (b < 0 || b % rec.bytes() != 0) {
      return internal_error("expert-parallel dispatch: a peer announced " + std::to_string(b) +
                            " bytes, not whole records of " + std::to_string(rec.bytes()));
    }
    received += b / rec.bytes();
  }
  std::vector<float> in_records(static_cast<size_t>(received * rec.words()));
  TESSERA_RETURN_IF_ERROR(
      group.all_to_all(out_records.data(), send_bytes, in_records.data(), recv_bytes, nullptr)
          .with_context("expert-parallel dispatch"));

  // 2. This rank's experts on what arrived: one weighted partial sum per record.
  std::vector<float> rows(static_cast<size_t>(received * H)), partial(rows.size());
  cpu::MoeRoute theirs;
  theirs.expert.resize(static_cast<size_t>(received * K));
  theirs.weight.resize(static_cast<size_t>(received * K));
  for (int64_t i = 0; i < received; ++i) {
    const float* r = in_records.data() + i * rec.words();
    std::copy_n(r, H, rows.data() + i * H);
    std::memcpy(theirs.expert.data() + i * K, r + H, static_cast<size_t>(K) * 4);
    std::copy_n(r + H + K, K, theirs.weight.data() + i * K);
  }
  if (received > 0) {
    TESSERA_RETURN_IF_ERROR(cpu::moe_experts(ctx, layer, rows, theirs, partial));
  }

  // 3. Combine: the partial sums go back where their records came from.
  std::vector<int64_t> back_send(static_cast<size_t>(R)), back_recv(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    back_send[static_cast<size_t>(p)] = recv_bytes[static_cast<size_t>(p)] / rec.bytes() * H * 4;
    back_recv[static_cast<size_t>(p)] =
        static_cast<int64_t>(sent_rows[static_cast<size_t>(p)].size()) * H * 4;
  }
  int64_t returned = 0;
  for (int64_t b : back_recv) returned += b / 4;
  std::vector<float> sums(static_cast<size_t>(returned));
  TESSERA_RETURN_IF_ERROR(
      group.all_to_all(partial.data(), back_send, sums.data(), back_recv, nullptr)
          .with_context("expert-parallel combine"));

  // 4. This rank's rows: the partial sums in rank order; the rest stays zero for the all-reduce.
  std::fill(y.begin(), y.end(), 0.0f);
  const float* s = sums.data();
  for (int p = 0; p < R; ++p) {
    for (int64_t row : sent_rows[static_cast<size_t>(p)]) {
      float* dst = y.data() + row * H;
      for (int64_t h = 0; h < H; ++h) dst[h] += s[h];
      s += H;
    }
  }
  return cpu::moe_shared(ctx, layer, x, y);
}

}  // namespace tessera
