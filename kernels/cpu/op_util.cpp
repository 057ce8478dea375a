#include "kernels/cpu/op_util.h"

namespace tessera::cpu::detail {

namespace {

std::string shape_string(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : shape) {
    s += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return s + "]";
}

}  // namespace

Status check_view(const TensorView& view, std::initializer_list<int64_t> shape, const char* what) {
  if (view.data == nullptr) return invalid_argument(std::string(what) + ": tensor has no data");
  bool same = view.shape.size() == shape.size();
  if (same) {
    size_t i = 0;
    for (int64_t d : shape) same = same && view.shape[i++] == d;
  }
  if (!same) {
    return invalid_argument(std::string(what) + ": expected " + shape_string(shape) +
                            " (any dtype), got " + view.describe());
  }
  return Status::ok();
}

Status check_matrix(const TensorView& view, const char* what) {
  if (view.data == nullptr) return invalid_argument(std::string(what) + ": tensor has no data");
  if (view.shape.size() != 2 || view.shape[0] <= 0 || view.shape[1] <= 0) {
    return invalid_argument(std::string(what) + ": expected a non-empty 2-D tensor, got " +
                            view.describe());
  }
  return Status::ok();
}

Status check_size(size_t actual, int64_t expected, const char* what, const std::string& shape) {
  if (static_cast<int64_t>(actual) != expected) {
    return invalid_argument(std::string(what) + ": expected " + std::to_string(expected) +
                            " elements (" + shape + "), got " + std::to_string(actual));
  }
  return Status::ok();
}

void to_float(const TensorView& view, int64_t begin, int64_t count, float* out) {
  switch (view.dtype) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(view.data) + begin, count * sizeof(float));
      return;
    case DType::kBF16: {
      // bf16 is the top half of an fp32: widen eight at a time with vector extensions.
      typedef uint16_t v8u16 __attribute__((vector_size(16)));
      typedef uint32_t v4u32 __attribute__((vector_size(16)));
      const auto* p = static_cast<const uint16_t*>(view.data) + begin;
      int64_t i = 0;
      for (; i + 8 <= count; i += 8) {
        v8u16 h;
        std::memcpy(&h, p + i, sizeof(h));
        const v4u32 lo = __builtin_convertvector(__builtin_shufflevector(h, h, 0, 1, 2, 3), v4u32);
        const v4u32 hi = __builtin_convertvector(__builtin_shufflevector(h, h, 4, 5, 6, 7), v4u32);
        const v4u32 lo_bits = lo << 16;
        const v4u32 hi_bits = hi << 16;
        std::memcpy(out + i, &lo_bits, sizeof(lo_bits));
        std::memcpy(out + i + 4, &hi_bits, sizeof(hi_bits));
      }
      for (; i < count; ++i) {
        const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
        std::memcpy(out + i, &bits, sizeof(float));
      }
      return;
    }
    case DType::kF16: {
      const auto* p = static_cast<const uint16_t*>(view.data) + begin;
      for (int64_t i = 0; i < count; ++i) out[i] = half_to_float(p[i]);
      return;
    }
    case DType::kI32:
    case DType::kF8E4M3:
      for (int64_t i = 0; i < count; ++i) out[i] = view.at(begin + i);
      return;
  }
}

std::vector<float> to_float(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.numel()));
  to_float(view, 0, view.numel(), out.data());
  return out;
}

}  // namespace tessera::cpu::detail
