// Reading: SafetensorsFile (mmap + header validation) and Checkpoint (a model directory).
// The writer is in safetensors_writer.cpp.
#include "common/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace tessera {
namespace {

using nlohmann::json;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string describe_json(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "; similar names: 'a', 'b'" for up to 5 of `names` closest to `name` (edit distance), or "".
template <typename Map>
std::string similar_names(std::string_view name, const Map& names) {
  std::vector<std::pair<size_t, const std::string*>> scored;
  for (const auto& [candidate, unused] : names) {
    scored.emplace_back(edit_distance(name, candidate), &candidate);
  }
  const size_t n = std::min<size_t>(5, scored.size());
  std::partial_sort(scored.begin(), scored.begin() + n, scored.end(),
                    [](const auto& a, const auto& b) {
                      return a.first != b.first ? a.first < b.first : *a.second < *b.second;
                    });
  std::string out;
  for (size_t i = 0; i < n; ++i)
    out += (i ? ", '" : "; similar names: '") + *scored[i].second + "'";
  return out;
}

Expected<std::vector<int64_t>> parse_shape(const json& v, const std::string& where) {
  if (!v.is_array()) {
    return invalid_argument(where + ": shape must be a list of integers, got " + describe_json(v));
  }
  std::vector<int64_t> shape;
  for (const json& d : v) {
    if (!d.is_number_integer() || (!d.is_number_unsigned() && d.get<int64_t>() < 0)) {
      return invalid_argument(where + ": shape " + describe_json(v) +
                              " must hold non-negative integers");
    }
    if (d.get<uint64_t>() > (uint64_t(1) << 48)) {
      return invalid_argument(where + ": shape " + describe_json(v) + " has an absurd dimension");
    }
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

// numel × dtype size, or nullopt on overflow.
std::optional<uint64_t> byte_size(const std::vector<int64_t>& shape, DType dtype) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

Expected<SafetensorsEntry> parse_entry(const std::string& name, const json& v,
                                       const std::string& file, uint64_t data_size) {
  const std::string where = file + ": tensor '" + name + "'";
  if (!v.is_object()) {
    return invalid_argument(where +
                            ": expected an object with dtype, shape and data_offsets, "
                            "got " +
                            describe_json(v));
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(key)) return invalid_argument(where + ": missing \"" + key + "\"");
  }
  SafetensorsEntry e;
  e.name = name;
  if (!v["dtype"].is_string()) {
    return invalid_argument(where + ": dtype must be a string, got " + describe_json(v["dtype"]));
  }
  Expected<DType> dtype = parse_safetensors_dtype(v["dtype"].get<std::string>());
  if (!dtype) return dtype.status().with_context(where);
  e.dtype = *dtype;
  TESSERA_ASSIGN_OR_RETURN(e.shape, parse_shape(v["shape"], where));
  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned()) {
    return invalid_argument(where +
                            ": data_offsets must be [begin, end] with non-negative "
                            "integers, got " +
                            describe_json(off));
  }
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  const std::string offsets =
      "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
  if (e.end < e.begin) return invalid_argument(where + ": " + offsets + " end before they begin");
  if (e.end > data_size) {
    return invalid_argument(where + ": " + offsets +
                            " run past the end of the file (data region "
                            "is " +
                            std::to_string(data_size) +
                            " bytes; the file is truncated or "
                            "the header is wrong)");
  }
  std::optional<uint64_t> bytes = byte_size(e.shape, e.dtype);
  if (!bytes || *bytes != e.end - e.begin) {
    return invalid_argument(where + ": " + offsets + " span " + std::to_string(e.end - e.begin) +
                            " bytes but shape " + shape_text(e.shape) + " of " +
                            dtype_name(e.dtype) + " needs " +
                            (bytes ? std::to_string(*bytes) : std::string("more than 2^64")));
  }
  return e;
}

std::string errno_text() { return std::strerror(errno); }

Expected<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(path + ": cannot open (" + errno_text() + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Expected<DType> parse_safetensors_dtype(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  return invalid_argument("dtype " + std::string(name) +
                          " is not supported (supported: F32, F16, BF16, I32, F8_E4M3)");
}

Expected<SafetensorsHeader> parse_safetensors_header(std::span<const uint8_t> file,
                                                     const std::string& origin) {
  const uint64_t size = file.size();
  if (size < 8) {
    return invalid_argument(origin + ": file is " + std::to_string(size) +
                            " bytes, too short for a safetensors header (truncated?)");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file[i];
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return invalid_argument(origin + ": header length " + std::to_string(header_len) +
                            " is over the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                            "-byte limit (not a safetensors file?)");
  }
  if (header_len > size - 8) {
    return invalid_argument(origin + ": header length " + std::to_string(header_len) +
                            " runs past the end of the file (" + std::to_string(size) +
                            " bytes; truncated, or not a safetensors file)");
  }
  SafetensorsHeader out;
  out.data_offset = 8 + header_len;
  const uint64_t data_size = size - out.data_offset;
  std::string_view text(reinterpret_cast<const char*>(file.data() + 8), header_len);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\0')) text.remove_suffix(1);
  if (text.empty() || text.front() != '{') {
    return invalid_argument(origin + ": header is not a JSON object (not a safetensors file?)");
  }
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    return invalid_argument(origin + ": header is not valid JSON (" + e.what() + ")");
  }
  if (!header.is_object()) return invalid_argument(origin + ": header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return invalid_argument(origin + ": __metadata__ must be an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return invalid_argument(origin + ": __metadata__['" + m.key() + "'] must be a string");
        }
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(SafetensorsEntry e, parse_entry(it.key(), *it, origin, data_size));
    out.entries.push_back(std::move(e));
  }
  std::sort(out.entries.begin(), out.entries.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Sorted by begin, so an overlap is always between neighbours (ignoring empty tensors).
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& e : out.entries) {
    if (e.begin == e.end) continue;
    if (prev != nullptr && e.begin < prev->end) {
      return invalid_argument(origin + ": tensor '" + e.name + "' data_offsets [" +
                              std::to_string(e.begin) + ", " + std::to_string(e.end) +
                              "] overlap tensor '" + prev->name + "' [" +
                              std::to_string(prev->begin) + ", " + std::to_string(prev->end) + "]");
    }
    prev = &e;
  }
  return out;
}

// ---- SafetensorsFile --------------------------------------------------------------------------

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
}

Expected<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    std::string msg = path + ": cannot open (" + std::strerror(err) + ")";
    return err == ENOENT ? not_found(msg) : Status(Code::kPermissionDenied, msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(path + ": not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return invalid_argument(path + ": file is " + std::to_string(size) +
                            " bytes, too short for a safetensors header (truncated?)");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return resource_exhausted(path + ": mmap of " + std::to_string(size) + " bytes failed (" +
                              std::strerror(map_err) + ")");
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = static_cast<const uint8_t*>(map);
  f->size_ = size;
  TESSERA_ASSIGN_OR_RETURN(SafetensorsHeader header,
                           parse_safetensors_header(std::span(f->map_, size), path));
  f->data_offset_ = header.data_offset;
  f->entries_ = std::move(header.entries);
  f->metadata_ = std::move(header.metadata);
  for (size_t i = 0; i < f->entries_.size(); ++i) f->index_[f->entries_[i].name] = i;
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

TensorView SafetensorsFile::view(const SafetensorsEntry& e) const {
  TensorView v;
  v.data = map_ + data_offset_ + e.begin;
  v.dtype = e.dtype;
  v.shape = e.shape;
  return v;
}

Expected<TensorView> SafetensorsFile::tensor(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) {
    return not_found(path_ + ": no tensor '" + std::string(name) + "' (the file has " +
                     std::to_string(entries_.size()) + ")" + similar_names(name, index_));
  }
  return view(*e);
}

// ---- Checkpoint -------------------------------------------------------------------------------

Expected<std::unique_ptr<Checkpoint>> Checkpoint::open(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) {
    return not_found(model_dir + ": no such model directory");
  }
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = model_dir;
  const fs::path dir(model_dir);
  const std::string single = (dir / "model.safetensors").string();
  const std::string index_path = (dir / "model.safetensors.index.json").string();

  if (fs::exists(single, ec)) {
    TESSERA_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(single));
    for (const SafetensorsEntry& e : file->entries()) {
      ckpt->tensors_.emplace(e.name, Slot{file.get(), &e});
    }
    ckpt->files_.push_back(std::move(file));
    return ckpt;
  }
  if (!fs::exists(index_path, ec)) {
    std::string hint;
    if (fs::exists(dir / "pytorch_model.bin", ec) ||
        fs::exists(dir / "pytorch_model.bin.index.json", ec)) {
      hint =
          " (it has pytorch_model.bin: only safetensors checkpoints are supported; convert it "
          "with transformers' save_pretrained(safe_serialization=True))";
    }
    return not_found(model_dir + ": neither model.safetensors nor model.safetensors.index.json" +
                     hint);
  }

  ckpt->sharded_ = true;
  TESSERA_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path));
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    return invalid_argument(index_path + ": not valid JSON (" + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return invalid_argument(index_path + ": expected an object with a \"weight_map\" object");
  }
  const json& weight_map = index["weight_map"];
  if (weight_map.empty()) return invalid_argument(index_path + ": weight_map is empty");

  // Shard file → the tensors the index puts there (in name order).
  std::map<std::string, std::vector<std::string>> shards;
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    if (!it->is_string()) {
      return invalid_argument(index_path + ": weight_map['" + it.key() +
                              "'] must be a file name, got " + describe_json(*it));
    }
    const std::string shard = it->get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return invalid_argument(index_path + ": weight_map['" + it.key() + "'] = '" + shard +
                              "' is not a plain file name in the model directory");
    }
    shards[shard].push_back(it.key());
  }
  for (const auto& [shard, names] : shards) {
    const std::string path = (dir / shard).string();
    if (!fs::exists(path, ec)) {
      return not_found(index_path + " lists shard '" + shard + "' (for " +
                       std::to_string(names.size()) + " tensors, e.g. '" + names.front() +
                       "'), which does not exist in " + model_dir);
    }
  }
  for (const auto& [shard, names] : shards) {
    const std::string path = (dir / shard).string();
    TESSERA_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
    for (const std::string& name : names) {
      const SafetensorsEntry* e = file->find(name);
      if (e == nullptr) {
        return invalid_argument(path + ": tensor '" + name + "' is listed in " + index_path +
                                " under this file, which does not contain it");
      }
      ckpt->tensors_.emplace(name, Slot{file.get(), e});
    }
    ckpt->files_.push_back(std::move(file));
  }
  return ckpt;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, slot] : tensors_) n += slot.entry->end - slot.entry->begin;
  return n;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, slot] : tensors_) out.push_back(name);
  return out;
}

const SafetensorsFile* Checkpoint::file_of(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.file;
}

Expected<TensorView> Checkpoint::tensor(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return not_found("tensor '" + std::string(name) + "' not found in the checkpoint in " + dir_ +
                     " (" + std::to_string(tensors_.size()) + " tensors)" +
                     similar_names(name, tensors_));
  }
  return it->second.file->view(*it->second.entry);
}

Expected<TensorView> Checkpoint::require(std::string_view name,
                                         const std::vector<int64_t>& shape) const {
  TESSERA_ASSIGN_OR_RETURN(TensorView v, tensor(name));
  if (v.shape != shape) {
    return invalid_argument(file_of(name)->path() + ": tensor '" + std::string(name) +
                            "' has shape " + shape_text(v.shape) + ", expected " +
                            shape_text(shape));
  }
  return v;
}

}  // namespace tessera
