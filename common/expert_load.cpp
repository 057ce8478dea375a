#include "common/expert_load.h"

#include <algorithm>
#include <string>

namespace tessera {

Status ExpertLoad::merge(const ExpertLoad& o) {
  if (o.empty()) return Status::ok();
  const auto ok = [](const ExpertLoad& l) {
    return l.num_experts > 0 &&
           l.tokens.size() == l.layers.size() * static_cast<size_t>(l.num_experts);
  };
  if (!ok(o) || (!empty() && (!ok(*this) || o.num_experts != num_experts))) {
    return invalid_argument("expert load: counts of " + std::to_string(o.num_experts) +
                            " experts over " + std::to_string(o.layers.size()) +
                            " layers do not add to counts of " + std::to_string(num_experts));
  }
  num_experts = o.num_experts;
  steps = std::max(steps, o.steps);
  const size_t E = static_cast<size_t>(num_experts);
  for (size_t i = 0; i < o.layers.size(); ++i) {
    auto at = std::lower_bound(layers.begin(), layers.end(), o.layers[i]);
    const size_t row = static_cast<size_t>(at - layers.begin());
    if (at == layers.end() || *at != o.layers[i]) {
      layers.insert(at, o.layers[i]);
      tokens.insert(tokens.begin() + static_cast<std::ptrdiff_t>(row * E), E, 0);
    }
    for (size_t e = 0; e < E; ++e) tokens[row * E + e] += o.tokens[i * E + e];
  }
  return Status::ok();
}

}  // namespace tessera
