// SafetensorsWriter: streamed writing of safetensors files and sharded sets.
#include "common/checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace tessera {
namespace {

// Buffer for streaming tensor data to disk; a multiple of 8 so pieces stay element-aligned.
constexpr size_t kWriteBufferBytes = 16u << 20;

// The safetensors library lays tensors out by dtype, larger alignment first (its Dtype enum
// order, descending: F32 > I32 > BF16 > F16 > F8_E4M3), then by name.
int dtype_rank(DType d) {
  switch (d) {
    case DType::kF32:
      return 4;
    case DType::kI32:
      return 3;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 1;
    case DType::kF8E4M3:
      return 0;
  }
  return 0;
}

// An open output file that writes fully or reports why not.
class OutFile {
 public:
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status open(const std::string& path) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) return error("cannot create");
    return Status::ok();
  }
  Status write(const uint8_t* data, size_t n) {
    while (n > 0) {
      ssize_t w = ::write(fd_, data, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return error("write failed");
      }
      data += w;
      n -= static_cast<size_t>(w);
    }
    return Status::ok();
  }
  Status close() {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return error("close failed");
    return Status::ok();
  }

 private:
  Status error(const char* what) {
    int err = errno;
    Code code = err == ENOSPC || err == EDQUOT ? Code::kResourceExhausted : Code::kInternal;
    if (err == EACCES || err == EPERM || err == EROFS) code = Code::kPermissionDenied;
    if (err == ENOENT) code = Code::kNotFound;
    return Status(code, path_ + ": " + what + " (" + std::strerror(err) + ")");
  }
  std::string path_;
  int fd_ = -1;
};

std::string shard_name(const std::string& prefix, size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "-%05zu-of-%05zu.safetensors", i, n);
  return prefix + buf;
}

}  // namespace

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsWriter::SafetensorsWriter() : metadata_{{"format", "pt"}} {}

Status SafetensorsWriter::add(TensorSpec spec, TensorSource source) {
  if (spec.name.empty()) return invalid_argument("safetensors writer: empty tensor name");
  if (spec.name == "__metadata__") {
    return invalid_argument("safetensors writer: '__metadata__' is reserved, not a tensor name");
  }
  if (names_.count(spec.name) != 0) {
    return invalid_argument("safetensors writer: tensor '" + spec.name + "' added twice");
  }
  for (int64_t d : spec.shape) {
    if (d < 0) {
      return invalid_argument("safetensors writer: tensor '" + spec.name +
                              "' has a negative dimension");
    }
  }
  if (!source)
    return invalid_argument("safetensors writer: tensor '" + spec.name + "' has no data");
  names_.emplace(spec.name, tensors_.size());
  tensors_.push_back({std::move(spec), std::move(source)});
  return Status::ok();
}

Status SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                              std::span<const uint8_t> bytes) {
  TensorSpec spec{std::move(name), dtype, std::move(shape)};
  for (int64_t d : spec.shape) {
    if (d < 0) return add(std::move(spec), nullptr);  // reports the bad dimension
  }
  if (bytes.size() != spec.bytes()) {
    return invalid_argument("safetensors writer: tensor '" + spec.name + "' of shape " +
                            TensorView{nullptr, dtype, spec.shape}.describe() + " needs " +
                            std::to_string(spec.bytes()) + " bytes, got " +
                            std::to_string(bytes.size()));
  }
  return add(std::move(spec), [bytes](uint64_t offset, std::span<uint8_t> out) {
    std::memcpy(out.data(), bytes.data() + offset, out.size());
    return Status::ok();
  });
}

uint64_t SafetensorsWriter::total_bytes() const {
  uint64_t n = 0;
  for (const Pending& p : tensors_) n += p.spec.bytes();
  return n;
}

Status SafetensorsWriter::write_file(const std::string& path,
                                     const std::vector<const Pending*>& unordered,
                                     uint64_t* bytes_done, uint64_t bytes_total) const {
  std::vector<const Pending*> tensors = unordered;
  std::sort(tensors.begin(), tensors.end(), [](const Pending* a, const Pending* b) {
    int ra = dtype_rank(a->spec.dtype), rb = dtype_rank(b->spec.dtype);
    return ra != rb ? ra > rb : a->spec.name < b->spec.name;
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Pending* p : tensors) {
    const uint64_t n = p->spec.bytes();
    header[p->spec.name] = {{"dtype", dtype_name(p->spec.dtype)},
                            {"shape", p->spec.shape},
                            {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));

  const std::string tmp = path + ".tmp";
  Status st = [&]() -> Status {
    OutFile out;
    TESSERA_RETURN_IF_ERROR(out.open(tmp));
    TESSERA_RETURN_IF_ERROR(out.write(len, 8));
    TESSERA_RETURN_IF_ERROR(out.write(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
    std::vector<uint8_t> buf(kWriteBufferBytes);
    size_t used = 0;
    for (const Pending* p : tensors) {
      const uint64_t total = p->spec.bytes();
      const size_t elem = dtype_size(p->spec.dtype);
      for (uint64_t done = 0; done < total;) {
        if (buf.size() - used < elem) {
          TESSERA_RETURN_IF_ERROR(out.write(buf.data(), used));
          used = 0;
        }
        const uint64_t room = (buf.size() - used) / elem * elem;
        const size_t n = static_cast<size_t>(std::min<uint64_t>(room, total - done));
        Status fill = p->source(done, std::span<uint8_t>(buf.data() + used, n));
        if (!fill.is_ok()) return fill.with_context(path + ": tensor '" + p->spec.name + "'");
        used += n;
        done += n;
      }
      *bytes_done += total;
    }
    TESSERA_RETURN_IF_ERROR(out.write(buf.data(), used));
    return out.close();
  }();
  if (st.is_ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = internal_error(path + ": cannot rename " + tmp + " into place (" + std::strerror(errno) +
                        ")");
  }
  if (!st.is_ok()) {
    std::remove(tmp.c_str());
    return st;
  }
  if (progress_) progress_(path, *bytes_done, bytes_total);
  return Status::ok();
}

Status SafetensorsWriter::write(const std::string& path) const {
  std::vector<const Pending*> all;
  for (const Pending& p : tensors_) all.push_back(&p);
  uint64_t done = 0;
  return write_file(path, all, &done, total_bytes());
}

Expected<std::vector<std::string>> SafetensorsWriter::write_sharded(
    const std::string& dir, uint64_t max_shard_bytes, const std::string& prefix) const {
  namespace fs = std::filesystem;
  if (max_shard_bytes == 0) return invalid_argument("max shard size must be positive");
  // huggingface_hub's split_state_dict_into_shards_factory.
  std::vector<std::vector<const Pending*>> shards;
  std::vector<const Pending*> current;
  uint64_t current_bytes = 0;
  for (const Pending& p : tensors_) {
    const uint64_t n = p.spec.bytes();
    if (n > max_shard_bytes) {
      shards.push_back({&p});
      continue;
    }
    if (current_bytes + n > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(&p);
    current_bytes += n;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));

  std::vector<std::string> written;
  uint64_t done = 0;
  const uint64_t total = total_bytes();
  if (shards.size() == 1) {
    const std::string name = prefix + ".safetensors";
    TESSERA_RETURN_IF_ERROR(write_file((fs::path(dir) / name).string(), shards[0], &done, total));
    written.push_back(name);
    return written;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shard_name(prefix, i + 1, shards.size());
    TESSERA_RETURN_IF_ERROR(write_file((fs::path(dir) / name).string(), shards[i], &done, total));
    for (const Pending* p : shards[i]) weight_map[p->spec.name] = name;
    written.push_back(name);
  }
  // As transformers writes it: sorted keys, indent 2, trailing newline.
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string index_name = prefix + ".safetensors.index.json";
  const std::string text = index.dump(2) + "\n";
  OutFile out;
  TESSERA_RETURN_IF_ERROR(out.open((fs::path(dir) / index_name).string()));
  TESSERA_RETURN_IF_ERROR(out.write(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  TESSERA_RETURN_IF_ERROR(out.close());
  written.push_back(index_name);
  return written;
}

}  // namespace tessera
