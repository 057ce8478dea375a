#include "actors/heap_trim.h"

#include <unistd.h>

#include <cstdio>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace tessera {

namespace {

// Resident bytes of this process (/proc/self/statm), 0 when unknown.
uint64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  if (n != 2) return 0;
  return static_cast<uint64_t>(resident) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace

bool HeapTrimSchedule::due(std::chrono::milliseconds busy, uint64_t steps, Clock::time_point now) {
  const bool active = busy.count() > 0 || (seen_ && steps != last_steps_);
  if (!seen_) {
    seen_ = true;
    last_steps_ = steps;
    last_active_ = now;
  }
  if (active) {
    dirty_ = true;
    last_steps_ = steps;
    last_active_ = now;
    return false;
  }
  if (!dirty_ || now - last_active_ < idle_after_) return false;
  dirty_ = false;
  return true;
}

HeapTrimResult trim_heap() {
  HeapTrimResult r;
  r.rss_before = resident_bytes();
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
  r.rss_after = resident_bytes();
  return r;
}

}  // namespace tessera
