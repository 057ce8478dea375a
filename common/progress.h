// Progress of long work measured in bytes (loading weights, writing checkpoints): on a terminal a
// bar redrawn in place on stderr; otherwise a log line at each tenth done (and at least every
// 10 s); then a one-line summary. Not thread-safe: one thread updates it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace tessera {

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  // Where the text goes: `draw` gets the bar (terminal; "" clears it), `line` each log line.
  // The defaults draw on stderr when it is a terminal and log through spdlog otherwise.
  struct Sinks {
    std::function<void(const std::string&)> draw;
    std::function<void(const std::string&)> line;
  };

  explicit Progress(std::string what);
  Progress(std::string what, Sinks sinks, Clock::time_point start);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `done` of `total` bytes at `now` (total 0: not known yet, nothing shown).
  void update(uint64_t done, uint64_t total, Clock::time_point now = Clock::now());
  // Clears the bar and writes "WHAT: 14.96 GiB in 4.1 s (3.65 GiB/s)" plus `detail` when given.
  void finish(uint64_t total, const std::string& detail = {}, Clock::time_point now = Clock::now());

  // "14.96 GiB", "512.0 MiB", "3 KiB", "17 B".
  static std::string bytes(double b);
  // "3 s", "2 min 05 s", "1 h 02 min".
  static std::string duration(double seconds);

 private:
  std::string what_;
  Sinks sinks_;
  Clock::time_point start_;
  Clock::time_point last_line_;
  int last_tenth_ = -1;
  bool drawn_ = false;
  bool finished_ = false;
};

}  // namespace tessera
