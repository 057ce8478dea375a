#include "common/progress.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace tessera {
namespace {

Progress::Sinks default_sinks() {
  Progress::Sinks s;
  if (::isatty(STDERR_FILENO) == 1) {
    s.draw = [](const std::string& bar) {
      // \r, the bar, and erase to the end of the line (a shorter bar leaves nothing behind).
      std::fprintf(stderr, "\r%s\x1b[K", bar.c_str());
      std::fflush(stderr);
    };
  }
  // Through the log where it shows info lines (serve); otherwise (commands that log warnings
  // only, the CLI's default) as plain lines on stderr, so long work is never silent. A log level
  // of error or quieter hides them.
  s.line = [](const std::string& text) {
    if (spdlog::should_log(spdlog::level::info)) {
      spdlog::info("{}", text);
    } else if (spdlog::should_log(spdlog::level::warn)) {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
  };
  return s;
}

double seconds_between(Progress::Clock::time_point a, Progress::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

Progress::Progress(std::string what) : Progress(std::move(what), default_sinks(), Clock::now()) {}

Progress::Progress(std::string what, Sinks sinks, Clock::time_point start)
    : what_(std::move(what)), sinks_(std::move(sinks)), start_(start), last_line_(start) {}

Progress::~Progress() {
  if (drawn_ && sinks_.draw) sinks_.draw("");
}

std::string Progress::bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%.0f B", b);
  } else {
    std::snprintf(buf, sizeof(buf),
                  b < 10    ? "%.2f %s"
                  : b < 100 ? "%.1f %s"
                            : "%.0f %s",
                  b, units[u]);
  }
  return buf;
}

std::string Progress::duration(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%ld s", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%ld min %02ld s", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%ld h %02ld min", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

void Progress::update(uint64_t done, uint64_t total, Clock::time_point now) {
  if (total == 0 || finished_) return;
  if (done > total) done = total;
  const double fraction = static_cast<double>(done) / static_cast<double>(total);
  const double elapsed = seconds_between(start_, now);
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  std::string figures = bytes(static_cast<double>(done)) + " of " +
                        bytes(static_cast<double>(total)) +
                        (rate > 0 ? ", " + bytes(rate) + "/s" : std::string());
  if (rate > 0 && done < total) {
    figures += ", " + duration(static_cast<double>(total - done) / rate) + " left";
  }
  char percent[8];
  std::snprintf(percent, sizeof(percent), "%3.0f%%", std::floor(fraction * 100.0));
  if (sinks_.draw) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar = what_ + " [" + std::string(static_cast<size_t>(filled), '#') +
                      std::string(static_cast<size_t>(kWidth - filled), ' ') + "] " + percent +
                      "  " + figures;
    sinks_.draw(bar);
    drawn_ = true;
    return;
  }
  const int tenth = static_cast<int>(fraction * 10.0);
  if (tenth > last_tenth_ || seconds_between(last_line_, now) >= 10.0) {
    last_tenth_ = std::max(tenth, last_tenth_);
    last_line_ = now;
    if (sinks_.line) sinks_.line(what_ + ": " + std::string(percent) + " (" + figures + ")");
  }
}

void Progress::finish(uint64_t total, const std::string& detail, Clock::time_point now) {
  if (finished_) return;
  finished_ = true;
  if (drawn_ && sinks_.draw) sinks_.draw("");
  drawn_ = false;
  const double elapsed = seconds_between(start_, now);
  char time[32];
  std::snprintf(time, sizeof(time), "%.1f s", elapsed);
  std::string text = what_ + ": " + bytes(static_cast<double>(total)) + " in " + time;
  if (elapsed > 0 && total > 0) {
    text += " (" + bytes(static_cast<double>(total) / elapsed) + "/s)";
  }
  if (!detail.empty()) text += " " + detail;
  if (sinks_.line) sinks_.line(text);
}

}  // namespace tessera
