// Safetensors checkpoints (https://github.com/huggingface/safetensors): reading, zero-copy, and
// writing, streamed.
//
// File layout: an 8-byte little-endian header length N, N bytes of JSON header, then the data
// region. The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the data region) and may hold a "__metadata__" object of strings.
// A Hugging Face model directory holds either model.safetensors or shards listed by
// model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {tensor: file}}).
//
// Every error names the file and, where one is involved, the tensor:
//   "/m/model-00002-of-00004.safetensors: tensor 'model.layers.3.mlp.up_proj.weight':
//    data_offsets [a, b] run past the end of the file (N bytes)".
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

// The largest header accepted (the safetensors library's own limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// "F32" / "F16" / "BF16" → dtype; any other spelling (I64, F8_E4M3, ...) → INVALID_ARGUMENT
// naming it and the supported ones.
Expected<DType> parse_safetensors_dtype(std::string_view name);

// One tensor of a safetensors header.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data region
  uint64_t end = 0;
};

// What a safetensors header says, validated against the size of its file.
struct SafetensorsHeader {
  uint64_t data_offset = 0;                     // 8 + header length
  std::vector<SafetensorsEntry> entries;        // ordered by begin offset
  std::map<std::string, std::string> metadata;  // "__metadata__" (empty when absent)
};

// Parses and validates the header of the safetensors file whose bytes are `file` (all of them:
// the data region's size bounds the offsets); `origin` (the path) starts every error message.
// Checks are those of SafetensorsFile::open; a file shorter than 8 bytes, a header length over
// kMaxSafetensorsHeaderBytes or past the end, a header that is not a JSON object, or any bad
// entry → INVALID_ARGUMENT naming `origin` (and the tensor). Never throws.
Expected<SafetensorsHeader> parse_safetensors_header(std::span<const uint8_t> file,
                                                     const std::string& origin);

// A safetensors file mapped read-only. The header is fully validated by open(): dtypes are
// F32/F16/BF16, shapes are non-negative, offsets lie inside the data region, each tensor's byte
// size is numel × dtype size and no two tensors overlap (gaps are allowed). Views returned point
// into the mapping (zero-copy) and stay valid while this object lives. Tensors are aligned to
// their dtype size when the file was written with a header padded to 8 bytes, as the safetensors
// library (since 0.3) and SafetensorsWriter do. Immutable after open: safe to share across
// threads. Truncating the file on disk while it is mapped is not detected (SIGBUS on access).
class SafetensorsFile {
 public:
  // Maps and validates `path`. A missing file → NOT_FOUND; a truncated file, a header length
  // past the end or over kMaxSafetensorsHeaderBytes, a non-JSON header or any bad entry →
  // INVALID_ARGUMENT naming the file (and the tensor).
  static Expected<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  // Byte offset of the data region in the file: 8 + header length.
  uint64_t data_offset() const { return data_offset_; }
  // All tensors, ordered by their begin offset.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The "__metadata__" strings (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The entry named `name`, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const;
  bool has(std::string_view name) const { return find(name) != nullptr; }
  // A view of `name`; NOT_FOUND names the tensor and the file and lists up to 5 similar names.
  Expected<TensorView> tensor(std::string_view name) const;
  // A view of an entry of this file. Precondition: `entry` is one of entries().
  TensorView view(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // name → position in entries_
  std::map<std::string, std::string> metadata_;
};

// The weights of a Hugging Face model directory: model.safetensors, or (when that is absent)
// the shards model.safetensors.index.json lists. Owns the mapped files; views stay valid while
// it lives. Immutable after open: safe to share across threads.
class Checkpoint {
 public:
  // Opens `model_dir`. Errors: no such directory or neither file (NOT_FOUND; mentions a
  // pytorch_model.bin that is there), a malformed index, a shard name that is not a plain file
  // name, a missing shard file (NOT_FOUND naming it), a tensor the index maps to a shard that
  // does not hold it, and every SafetensorsFile::open error. Tensors a shard holds but the index
  // does not list are ignored, as transformers does.
  static Expected<std::unique_ptr<Checkpoint>> open(const std::string& model_dir);

  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  size_t size() const { return tensors_.size(); }
  // Sum of all tensors' byte sizes.
  uint64_t total_bytes() const;

  bool has(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  // All tensor names, sorted.
  std::vector<std::string> names() const;
  // The file holding `name`, or nullptr.
  const SafetensorsFile* file_of(std::string_view name) const;
  // A zero-copy view. NOT_FOUND names the tensor and the directory and lists up to 5 similar
  // names ("did you mean ...").
  Expected<TensorView> tensor(std::string_view name) const;
  // tensor(name), and INVALID_ARGUMENT unless its shape is `shape`; the error names the tensor,
  // its file, the expected and the actual shape.
  Expected<TensorView> require(std::string_view name, const std::vector<int64_t>& shape) const;

 private:
  Checkpoint() = default;
  struct Slot {
    const SafetensorsFile* file;
    const SafetensorsEntry* entry;
  };

  std::string dir_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Slot, std::less<>> tensors_;
};

// A tensor to write.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const;
  uint64_t bytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }
};

// Produces bytes [offset, offset + out.size()) of one tensor's data (row-major, little-endian).
// The writer asks for each tensor's bytes in order, in pieces whose offset and size are
// multiples of the dtype size, so a piece is always whole elements. A failed Status aborts the
// write.
using TensorSource = std::function<Status(uint64_t offset, std::span<uint8_t> out)>;

// Called after each file is written: its path, the bytes of tensor data written so far across
// all files, and the total to write.
using WriteProgress =
    std::function<void(const std::string& path, uint64_t bytes_done, uint64_t bytes_total)>;

// Collects tensors, then writes them as a safetensors file or a sharded set, streaming: memory
// use is one bounded buffer, whatever the model size. The layout matches the safetensors
// library: tensors ordered by dtype size (F32, then BF16, then F16) and then by name, offsets
// contiguous, "__metadata__" first in a compact JSON header padded with spaces to a multiple of
// 8 bytes. Files are written to "<path>.tmp" and renamed into place.
class SafetensorsWriter {
 public:
  // Metadata defaults to {"format": "pt"}, as transformers' save_pretrained writes.
  SafetensorsWriter();

  // Adds a tensor whose bytes `source` produces at write time. INVALID_ARGUMENT for an empty,
  // duplicate or "__metadata__" name, or a negative dimension.
  Status add(TensorSpec spec, TensorSource source);
  // Adds a tensor from memory the caller keeps alive until the last write; `bytes` must be
  // numel × dtype size long.
  Status add(std::string name, DType dtype, std::vector<int64_t> shape,
             std::span<const uint8_t> bytes);
  void set_metadata(std::map<std::string, std::string> metadata) {
    metadata_ = std::move(metadata);
  }
  void set_progress(WriteProgress progress) { progress_ = std::move(progress); }

  size_t size() const { return tensors_.size(); }
  uint64_t total_bytes() const;

  // Writes every tensor into one file.
  Status write(const std::string& path) const;
  // Writes <dir>/<prefix>.safetensors when all tensors fit in max_shard_bytes, else shards
  // <prefix>-00001-of-0000N.safetensors plus <prefix>.safetensors.index.json, split as
  // huggingface_hub does: tensors in the order added, a new shard when the next tensor would
  // push the current one past max_shard_bytes, and a tensor larger than that alone in a shard.
  // `dir` must exist. Returns the names of the files written (index last).
  Expected<std::vector<std::string>> write_sharded(const std::string& dir, uint64_t max_shard_bytes,
                                                   const std::string& prefix = "model") const;

 private:
  struct Pending {
    TensorSpec spec;
    TensorSource source;
  };
  Status write_file(const std::string& path, const std::vector<const Pending*>& tensors,
                    uint64_t* bytes_done, uint64_t bytes_total) const;

  std::vector<Pending> tensors_;
  std::map<std::string, size_t, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
  WriteProgress progress_;
};

}  // namespace tessera
