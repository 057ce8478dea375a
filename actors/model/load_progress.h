// How far this process has come loading its model's weights, for the driver's progress display
// (the actor's loadProgress call reads it while loadModel runs on the loading thread).
#pragma once

#include <atomic>
#include <cstdint>

namespace tessera {

struct LoadProgress {
  std::atomic<uint64_t> bytes_done{0};   // weight bytes in place on the device
  std::atomic<uint64_t> bytes_total{0};  // this rank's weight bytes (0 until known; stays 0 on
                                         // the CPU backend, which maps the checkpoint instead)
  void start(uint64_t total) {
    bytes_done = 0;
    bytes_total = total;
  }
};

// The one per process.
inline LoadProgress& load_progress() {
  static LoadProgress progress;
  return progress;
}

}  // namespace tessera
