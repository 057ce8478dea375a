#include "actors/comm/communicator.h"

#include <string>

namespace tessera::comm {

std::string describe_peer(const RankInfo& peer) {
  std::string who = peer.actor_id;
  if (peer.gpu >= 0) who += (who.empty() ? "GPU " : ", GPU ") + std::to_string(peer.gpu);
  if (!peer.node_id.empty()) who += (who.empty() ? "node " : " on node ") + peer.node_id;
  std::string details = who;
  if (!peer.address.empty()) details += (details.empty() ? "" : ", ") + peer.address;
  std::string out = "rank " + std::to_string(peer.rank);
  if (!details.empty()) out += " (" + details + ")";
  return out;
}

Status check_all_to_all(int size, const void* in, std::span<const int64_t> send_bytes,
                        const void* out, std::span<const int64_t> recv_bytes) {
  if (static_cast<int>(send_bytes.size()) != size || static_cast<int>(recv_bytes.size()) != size) {
    return invalid_argument("all_to_all: " + std::to_string(send_bytes.size()) + " send and " +
                            std::to_string(recv_bytes.size()) + " receive sizes for a group of " +
                            std::to_string(size));
  }
  int64_t sent = 0, received = 0;
  for (int r = 0; r < size; ++r) {
    if (send_bytes[r] < 0 || recv_bytes[r] < 0) {
      return invalid_argument("all_to_all: a negative size for rank " + std::to_string(r));
    }
    sent += send_bytes[r];
    received += recv_bytes[r];
  }
  if ((sent > 0 && in == nullptr) || (received > 0 && out == nullptr)) {
    return invalid_argument("all_to_all: a null buffer");
  }
  return Status::ok();
}

namespace {

class BySize final : public Communicator {
 public:
  BySize(std::unique_ptr<Communicator> small, std::unique_ptr<Communicator> large,
         uint64_t small_max)
      : small_(std::move(small)), large_(std::move(large)), small_max_(small_max) {}
  ~BySize() override {
    small_.reset();  // the IPC buffers before the communicator that might still name them
    large_.reset();
  }

  int rank() const override { return large_->rank(); }
  int size() const override { return large_->size(); }
  Status all_reduce_sum(void* data, int64_t count, DType dtype, void* stream) override {
    const uint64_t bytes = static_cast<uint64_t>(count) * dtype_size(dtype);
    return (bytes <= small_max_ ? small_ : large_)->all_reduce_sum(data, count, dtype, stream);
  }
  // Fused where the size goes through `small`, so the path per size stays the one above.
  bool fuses_add_rms_norm(int64_t rows, int64_t hidden, DType dtype) const override {
    const uint64_t bytes = static_cast<uint64_t>(rows * hidden) * dtype_size(dtype);
    return bytes <= small_max_ && small_->fuses_add_rms_norm(rows, hidden, dtype);
  }
  Status all_reduce_add_rms_norm(const void* x, const AddRmsNorm& norm, DType dtype,
                                 void* stream) override {
    if (!fuses_add_rms_norm(norm.rows, norm.hidden, dtype)) {
      return Communicator::all_reduce_add_rms_norm(x, norm, dtype, stream);
    }
    return small_->all_reduce_add_rms_norm(x, norm, dtype, stream);
  }
  Status all_gather(const void* in, int64_t count, DType dtype, void* out, void* stream) override {
    const uint64_t bytes =
        static_cast<uint64_t>(count) * dtype_size(dtype) * static_cast<uint64_t>(size());
    return (bytes <= small_max_ ? small_ : large_)->all_gather(in, count, dtype, out, stream);
  }
  Status all_to_all(const void* in, std::span<const int64_t> send_bytes, void* out,
                    std::span<const int64_t> recv_bytes, void* stream) override {
    return large_->all_to_all(in, send_bytes, out, recv_bytes, stream);
  }
  Status send(const void* data, int64_t bytes, int peer, void* stream) override {
    return large_->send(data, bytes, peer, stream);
  }
  Status recv(void* data, int64_t bytes, int peer, void* stream) override {
    return large_->recv(data, bytes, peer, stream);
  }
  Status barrier() override { return large_->barrier(); }
  std::string describe(int peer) const override { return large_->describe(peer); }

 private:
  std::unique_ptr<Communicator> small_, large_;
  uint64_t small_max_;
};

}  // namespace

std::unique_ptr<Communicator> by_size(std::unique_ptr<Communicator> small,
                                      std::unique_ptr<Communicator> large,
                                      uint64_t small_max_bytes) {
  return std::make_unique<BySize>(std::move(small), std::move(large), small_max_bytes);
}

}  // namespace tessera::comm
