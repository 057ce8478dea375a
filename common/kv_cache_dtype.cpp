#include "common/kv_cache_dtype.h"

#include <string>

namespace tessera {

Expected<KvCacheDtype> parse_kv_cache_dtype(std::string_view text) {
  if (text == "auto") return KvCacheDtype::kAuto;
  if (text == "fp8" || text == "fp8_e4m3") return KvCacheDtype::kFp8E4M3;
  std::string msg =
      "--kv-cache-dtype '" + std::string(text) + "' is not one of auto, fp8, fp8_e4m3";
  if (text == "fp8_e5m2") msg += " (E5M2 is not supported: fp8 stores E4M3, the more precise one)";
  return invalid_argument(msg);
}

const char* kv_cache_dtype_name(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::kFp8E4M3 ? "fp8_e4m3" : "auto";
}

const char* kv_cache_storage_name(KvCacheDtype dtype, DType run_dtype) {
  return dtype == KvCacheDtype::kFp8E4M3 ? "F8_E4M3" : dtype_name(run_dtype);
}

size_t kv_cache_element_size(KvCacheDtype dtype, DType run_dtype) {
  return dtype == KvCacheDtype::kFp8E4M3 ? 1 : dtype_size(run_dtype);
}

}  // namespace tessera
