#include "kernels/cpu/embedding.h"

#include <algorithm>
#include <string>

#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

Status embedding(CpuContext& ctx, const TensorView& table, std::span<const int32_t> ids,
                 std::span<float> out) {
  TESSERA_RETURN_IF_ERROR(detail::check_matrix(table, "embedding table"));
  const int64_t vocab = table.dim(0);
  const int64_t hidden = table.dim(1);
  const int64_t n = static_cast<int64_t>(ids.size());
  TESSERA_RETURN_IF_ERROR(
      detail::check_size(out.size(), n * hidden, "embedding out",
                         "[" + std::to_string(n) + ", " + std::to_string(hidden) + "]"));
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return invalid_argument("embedding: token id " + std::to_string(ids[i]) + " at index " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
    }
  }
  // A row is a copy or a conversion of `hidden` elements: parallel only for big batches.
  const int64_t grain = std::max<int64_t>(1, detail::kParallelWork / hidden);
  ctx.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      detail::to_float(table, ids[i] * hidden, hidden, out.data() + i * hidden);
    }
  });
  return Status::ok();
}

}  // namespace tessera::cpu
