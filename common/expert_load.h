// How the routers of a mixture-of-experts model spread tokens over the experts: the balance
// `tessera bench throughput` reports (vLLM's EPLB watches the same counts). Each rank counts the
// (token, expert) routings of the MoE layers it runs; the driver adds the ranks up.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace tessera {

struct ExpertLoad {
  int64_t num_experts = 0;
  std::vector<int64_t> layers;   // the model's index of each MoE layer counted, ascending
  std::vector<uint64_t> tokens;  // [layers.size() x num_experts]: routings to each expert
  uint64_t steps = 0;            // forward passes counted (the most any rank ran)

  bool empty() const { return layers.empty(); }
  // Adds another rank's counts: a layer both hold adds up, another's is added in order.
  // INVALID_ARGUMENT when the expert counts or sizes disagree.
  Status merge(const ExpertLoad& other);
};

}  // namespace tessera
