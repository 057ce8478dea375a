#include "actors/comm/communicator.h"

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
  Status all_gather(const void* in, int64_t count, DType dtype, void* out, void* stream) override {
    const uint64_t bytes =
        static_cast<uint64_t>(count) * dtype_size(dtype) * static_cast<uint64_t>(size());
    return (bytes <= small_max_ ? small_ : large_)->all_gather(in, count, dtype, out, stream);
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
