// Fuzzes the safetensors header parser (parse_safetensors_header, what SafetensorsFile::open
// runs on the mapped file). The input is a whole file: an 8-byte little-endian header length,
// the JSON header, the data region. A header that parses must describe tensors that lie inside
// the data region without overlapping, each numel × dtype-size bytes long; every byte of every
// tensor is read so that ASan checks those bounds.
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/checkpoint/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  Expected<SafetensorsHeader> header =
      parse_safetensors_header(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  if (!header) {
    FUZZ_CHECK(!header.status().message().empty());
    return 0;
  }
  FUZZ_CHECK(header->data_offset >= 8 && header->data_offset <= size);
  const uint64_t data_size = size - header->data_offset;
  const uint8_t* region = data + header->data_offset;
  uint64_t prev_end = 0;
  volatile uint8_t sink = 0;
  for (const SafetensorsEntry& e : header->entries) {
    FUZZ_CHECK(e.begin <= e.end && e.end <= data_size);
    uint64_t bytes = dtype_size(e.dtype);
    for (int64_t d : e.shape) {
      FUZZ_CHECK(d >= 0);
      bytes *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(bytes == e.end - e.begin);
    if (e.begin == e.end) continue;
    FUZZ_CHECK(e.begin >= prev_end);  // sorted by offset, no overlap
    prev_end = e.end;
    for (uint64_t i = e.begin; i < e.end; ++i) sink = sink ^ region[i];
  }
  return 0;
}
