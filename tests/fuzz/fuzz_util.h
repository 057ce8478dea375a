// Helpers shared by the fuzz targets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace tessera::fuzz {

// The input cut at its first `max_parts - 1` NUL bytes: several texts (a tokenizer.json and the
// string to encode, say) from one input. 1 to max_parts parts (one more than the NULs found);
// the last keeps any later NULs.
inline std::vector<std::string_view> split_input(const uint8_t* data, size_t size,
                                                 size_t max_parts) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    size_t nul = rest.find('\0');
    if (nul == std::string_view::npos) break;
    parts.push_back(rest.substr(0, nul));
    rest.remove_prefix(nul + 1);
  }
  parts.push_back(rest);
  return parts;
}

// A broken invariant of a parse that succeeded: report it and abort, so libFuzzer keeps the
// input as a crash.
[[noreturn]] inline void invariant_failed(const char* what) {
  std::fprintf(stderr, "fuzz invariant failed: %s\n", what);
  std::abort();
}

}  // namespace tessera::fuzz

#define FUZZ_CHECK(cond) \
  ((cond) ? (void)0 : ::tessera::fuzz::invariant_failed(#cond " (" __FILE__ ")"))
