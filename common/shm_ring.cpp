#include "common/shm_ring.h"

#include <sched.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <new>

namespace tessera {
namespace ring_internal {

constexpr size_t kLine = BroadcastRing::kCacheLine;
constexpr size_t kSlotAlign = 64;
constexpr uint64_t kMagic = 0x31474e4952535354ull;  // "TSRING1" + NUL, little-endian
constexpr uint32_t kClosedFlag = 1u;

// The futex system call reads these words as plain u32 from another process: they must be
// lock-free atomics with exactly the representation of a u32 (and likewise the u64 counters).
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t));

struct alignas(kLine) RingHeader {
  // Line 0: written by format(), read-only afterwards except `flags`.
  std::atomic<uint64_t> magic{0};  // stored last by format(), with release
  uint32_t version = 0;
  uint32_t readers = 0;
  uint64_t slot_bytes = 0;
  uint64_t slots = 0;
  uint64_t stride = 0;       // bytes from one slot to the next
  uint64_t total_bytes = 0;  // layout_bytes() of this geometry
  std::atomic<uint32_t> flags{0};
  // Written by the writer on every publish, read by every reader.
  alignas(kLine) std::atomic<uint64_t> write_seq{0};
  // Readers sleep on data_gen; the writer bumps it on publish and on close.
  alignas(kLine) std::atomic<uint32_t> data_gen{0};
  std::atomic<uint32_t> data_waiters{0};
  // The writer sleeps on space_gen; readers bump it on every consume.
  alignas(kLine) std::atomic<uint32_t> space_gen{0};
  std::atomic<uint32_t> space_waiters{0};
};

struct alignas(kLine) ReaderCursor {
  std::atomic<uint64_t> read_seq{0};
};

struct SlotHeader {
  uint32_t length;
  uint32_t reserved;
};

static_assert(sizeof(RingHeader) % kLine == 0);
static_assert(sizeof(ReaderCursor) == kLine);

}  // namespace ring_internal

namespace {

using namespace ring_internal;  // NOLINT: this file's own internals
using Clock = std::chrono::steady_clock;
// How long a waiter polls before it sleeps on the futex. A futex sleep and wake costs about
// 10 us each way on the machines measured, so a driver <-> actor round trip that slept on both
// sides took ~27 us at TP = 1 and ~50 us at TP = 2 (empty steps, `tessera bench control-plane`);
// polling a little longer than one such wake-up catches a peer that answers at once, and bounds
// the CPU a waiter burns when it does not.
constexpr std::chrono::microseconds kSpinFor{25};
// A reader told when its message should come (RingReader::read's poll_from) polls from then on
// for up to this long instead of sleeping: a futex wake-up after a sleep of milliseconds took
// ~30-60 us on the GPU machines (the driver's collect of a 3 ms decode step), a poll ~1 us.
constexpr std::chrono::milliseconds kPollFor{2};
// Waits longer than this are clamped, so deadline arithmetic cannot overflow.
constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365);

size_t slot_stride(size_t slot_bytes) {
  size_t raw = sizeof(SlotHeader) + slot_bytes;
  return (raw + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

size_t total_bytes(size_t slot_bytes, size_t slots, uint32_t readers) {
  return sizeof(RingHeader) + size_t{readers} * sizeof(ReaderCursor) +
         slots * slot_stride(slot_bytes);
}

Status check_geometry(size_t slot_bytes, size_t slots, uint64_t readers) {
  if (slot_bytes == 0 || slot_bytes > BroadcastRing::kMaxSlotBytes) {
    return invalid_argument("slot size " + std::to_string(slot_bytes) + " is not in 1.." +
                            std::to_string(BroadcastRing::kMaxSlotBytes));
  }
  if (slots == 0 || slots > BroadcastRing::kMaxSlots) {
    return invalid_argument("slot count " + std::to_string(slots) + " is not in 1.." +
                            std::to_string(BroadcastRing::kMaxSlots));
  }
  if (readers == 0 || readers > BroadcastRing::kMaxReaders) {
    return invalid_argument("reader count " + std::to_string(readers) + " is not in 1.." +
                            std::to_string(BroadcastRing::kMaxReaders));
  }
  return Status::ok();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Shared (not _PRIVATE) futex operations: the word lives in memory mapped by several processes.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  if (ns <= 0) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(ns % 1'000'000'000);
  // EAGAIN (the word changed), EINTR and ETIMEDOUT all send the caller back to its checks.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Called after changing a condition others may sleep on (see the header, point 4).
void wake_all(std::atomic<uint32_t>& gen, std::atomic<uint32_t>& waiters) {
  gen.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_relaxed) != 0) futex_wake_all(&gen);
}

// Polls ready() until it holds (true) or `end` (false).
template <typename Ready>
bool poll_until(Clock::time_point end, const Ready& ready) {
  for (int i = 1;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if (i % 32 == 0) {
      if (Clock::now() >= end) return false;
      // Past the first stretch, let a peer that shares this core run (more processes than
      // cores: a driver and two actors on two cores otherwise spin against each other).
      if (i >= 256) sched_yield();
    }
  }
}

// Waits until ready() or the deadline; returns whether ready() held. Spins briefly (unless
// `spin` is false), then sleeps on `gen` (see the header, point 4); from `poll_from` on, for
// kPollFor, it polls instead of sleeping.
template <typename Ready>
bool block_until(std::atomic<uint32_t>& gen, std::atomic<uint32_t>& waiters,
                 Clock::time_point deadline, bool spin, Clock::time_point poll_from,
                 const Ready& ready) {
  if (spin && poll_until(std::min(deadline, Clock::now() + kSpinFor), ready)) return true;
  for (;;) {
    if (ready()) return true;
    Clock::time_point now = Clock::now();
    if (now >= deadline) return false;
    if (now >= poll_from && now < poll_from + kPollFor) {
      if (poll_until(std::min(deadline, poll_from + kPollFor), ready)) return true;
      continue;
    }
    const Clock::time_point wake = now < poll_from ? std::min(deadline, poll_from) : deadline;
    waiters.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen_gen = gen.load(std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!ready()) futex_wait(&gen, seen_gen, wake - now);
    waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  return Clock::now() + std::clamp(timeout, std::chrono::milliseconds(0), kMaxTimeout);
}

long long ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// The validated, process-local view of a formatted region.
struct View {
  RingHeader* header;
  ReaderCursor* cursors;
  std::byte* slots_base;
  size_t slot_bytes;
  size_t slots;
  size_t stride;
  uint32_t readers;
};

Expected<View> validate(void* mem, size_t bytes, const std::string& label) {
  auto bad = [&](const std::string& why) { return failed_precondition(label + ": " + why); };
  if (mem == nullptr) return invalid_argument(label + ": no memory to attach to");
  if (reinterpret_cast<uintptr_t>(mem) % kLine != 0) {
    return invalid_argument(label + ": region is not " + std::to_string(kLine) + "-byte aligned");
  }
  if (bytes < sizeof(RingHeader)) {
    return bad("region of " + std::to_string(bytes) + " bytes is too small to hold a ring header");
  }
  auto* header = static_cast<RingHeader*>(mem);
  uint64_t magic = header->magic.load(std::memory_order_acquire);
  if (magic != kMagic) return bad("not a broadcast ring (no ring magic; not formatted?)");
  // Copy the geometry once; only these copies are used from here on.
  const uint32_t version = header->version;
  const uint32_t readers = header->readers;
  const uint64_t slot_bytes = header->slot_bytes;
  const uint64_t slots = header->slots;
  const uint64_t stride = header->stride;
  const uint64_t recorded_total = header->total_bytes;
  if (version != BroadcastRing::kVersion) {
    return bad("ring layout version " + std::to_string(version) + ", this build reads version " +
               std::to_string(BroadcastRing::kVersion));
  }
  Status geometry = check_geometry(slot_bytes, slots, readers);
  if (!geometry.is_ok()) return bad("corrupt header: " + geometry.message());
  const size_t total = total_bytes(slot_bytes, slots, readers);
  if (stride != slot_stride(slot_bytes) || recorded_total != total) {
    return bad("corrupt header: recorded sizes do not match its geometry");
  }
  if (total > bytes) {
    return bad("corrupt header or short mapping: the ring needs " + std::to_string(total) +
               " bytes but only " + std::to_string(bytes) + " are mapped");
  }
  auto* base = static_cast<std::byte*>(mem);
  View view{header,
            reinterpret_cast<ReaderCursor*>(base + sizeof(RingHeader)),
            base + sizeof(RingHeader) + size_t{readers} * sizeof(ReaderCursor),
            slot_bytes,
            slots,
            stride,
            readers};
  // Every cursor must lie in [write_seq - slots, write_seq].
  const uint64_t written = header->write_seq.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < readers; ++i) {
    uint64_t read = view.cursors[i].read_seq.load(std::memory_order_acquire);
    if (read > written || written - read > slots) {
      return bad("corrupt cursors: reader " + std::to_string(i) + " has read " +
                 std::to_string(read) + " of " + std::to_string(written) + " messages in " +
                 std::to_string(slots) + " slots");
    }
  }
  return view;
}

SlotHeader* slot_at(std::byte* base, size_t stride, size_t slots, uint64_t seq) {
  return reinterpret_cast<SlotHeader*>(base + (seq % slots) * stride);
}

std::byte* payload_of(SlotHeader* slot) {
  return reinterpret_cast<std::byte*>(slot) + sizeof(SlotHeader);
}

}  // namespace

// ---- BroadcastRing ----------------------------------------------------------------------------

Expected<size_t> BroadcastRing::layout_bytes(size_t slot_bytes, size_t slots, uint32_t readers) {
  TESSERA_RETURN_IF_ERROR(check_geometry(slot_bytes, slots, readers));
  return total_bytes(slot_bytes, slots, readers);
}

Status BroadcastRing::format(void* mem, size_t bytes, size_t slot_bytes, size_t slots,
                             uint32_t readers) {
  TESSERA_ASSIGN_OR_RETURN(size_t needed, layout_bytes(slot_bytes, slots, readers));
  if (mem == nullptr) return invalid_argument("cannot format a ring: no memory");
  if (reinterpret_cast<uintptr_t>(mem) % kLine != 0) {
    return invalid_argument("cannot format a ring: region is not " + std::to_string(kLine) +
                            "-byte aligned");
  }
  if (bytes < needed) {
    return invalid_argument("cannot format a ring of " + std::to_string(slots) + " slots of " +
                            std::to_string(slot_bytes) + " bytes for " + std::to_string(readers) +
                            " readers: it needs " + std::to_string(needed) +
                            " bytes, the region has " + std::to_string(bytes));
  }
  auto* base = static_cast<std::byte*>(mem);
  auto* header = new (mem) RingHeader();  // magic 0 until the end
  header->version = kVersion;
  header->readers = readers;
  header->slot_bytes = slot_bytes;
  header->slots = slots;
  header->stride = slot_stride(slot_bytes);
  header->total_bytes = needed;
  for (uint32_t i = 0; i < readers; ++i) {
    new (base + sizeof(RingHeader) + size_t{i} * sizeof(ReaderCursor)) ReaderCursor();
  }
  std::byte* slots_base = base + sizeof(RingHeader) + size_t{readers} * sizeof(ReaderCursor);
  for (size_t s = 0; s < slots; ++s) {
    *slot_at(slots_base, header->stride, slots, s) = SlotHeader{0, 0};
  }
  header->magic.store(kMagic, std::memory_order_release);
  return Status::ok();
}

// ---- RingWriter -------------------------------------------------------------------------------

Expected<RingWriter> RingWriter::attach(void* mem, size_t bytes, std::string_view label) {
  std::string name(label);
  TESSERA_ASSIGN_OR_RETURN(View view, validate(mem, bytes, name));
  RingWriter w;
  w.header_ = view.header;
  w.cursors_ = view.cursors;
  w.slots_base_ = view.slots_base;
  w.slot_bytes_ = view.slot_bytes;
  w.slots_ = view.slots;
  w.stride_ = view.stride;
  w.readers_ = view.readers;
  w.next_seq_ = view.header->write_seq.load(std::memory_order_acquire);
  w.label_ = std::move(name);
  return w;
}

uint64_t RingWriter::min_read_seq() const {
  uint64_t min = UINT64_MAX;
  for (uint32_t i = 0; i < readers_; ++i) {
    min = std::min(min, cursors_[i].read_seq.load(std::memory_order_acquire));
  }
  return min;
}

Status RingWriter::write(std::span<const std::byte> msg, std::chrono::milliseconds timeout) {
  if (msg.size() > slot_bytes_) {
    return invalid_argument(label_ + ": message of " + std::to_string(msg.size()) +
                            " bytes does not fit the slot size of " + std::to_string(slot_bytes_) +
                            " bytes");
  }
  const uint64_t seq = next_seq_;
  if ((header_->flags.load(std::memory_order_acquire) & kClosedFlag) != 0) {
    return failed_precondition(label_ + ": cannot write message #" + std::to_string(seq) +
                               ": the ring is closed");
  }
  // Message #seq may reuse its slot once every reader has consumed message #seq - slots.
  auto has_space = [&] { return seq < slots_ || min_read_seq() > seq - slots_; };
  if (!has_space()) {
    // Slow path: also remember when each reader last moved, for the timeout message.
    const Clock::time_point start = Clock::now();
    std::vector<uint64_t> seen(readers_);
    std::vector<Clock::time_point> since(readers_, start);
    for (uint32_t i = 0; i < readers_; ++i) {
      seen[i] = cursors_[i].read_seq.load(std::memory_order_acquire);
    }
    auto ready = [&] {
      bool ok = true;
      for (uint32_t i = 0; i < readers_; ++i) {
        uint64_t r = cursors_[i].read_seq.load(std::memory_order_acquire);
        if (r != seen[i]) {
          seen[i] = r;
          since[i] = Clock::now();
        }
        if (r <= seq - slots_) ok = false;
      }
      return ok;
    };
    bool ok = block_until(header_->space_gen, header_->space_waiters, deadline_after(timeout),
                          timeout.count() > 0, Clock::time_point::min(), ready);
    if (!ok) {
      auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      return timeout_status(seq, waited, seen, since);
    }
  }
  SlotHeader* slot = slot_at(slots_base_, stride_, slots_, seq);
  slot->length = static_cast<uint32_t>(msg.size());
  if (!msg.empty()) std::memcpy(payload_of(slot), msg.data(), msg.size());
  header_->write_seq.store(seq + 1, std::memory_order_release);  // publish (header point 1)
  next_seq_ = seq + 1;
  wake_all(header_->data_gen, header_->data_waiters);
  return Status::ok();
}

Status RingWriter::timeout_status(uint64_t seq, std::chrono::milliseconds waited,
                                  const std::vector<uint64_t>& seen,
                                  const std::vector<Clock::time_point>& since) const {
  std::string msg = label_ + ": timed out after " + std::to_string(waited.count()) +
                    " ms waiting for a free slot for message #" + std::to_string(seq) + ": ";
  bool first = true;
  for (uint32_t i = 0; i < readers_; ++i) {
    if (seen[i] > seq - slots_) continue;  // not holding the slot
    if (!first) msg += "; ";
    first = false;
    msg += "reader " + std::to_string(i) + " is " + std::to_string(seq - seen[i]) +
           " messages behind (has read " + std::to_string(seen[i]) + " of " + std::to_string(seq) +
           ") and has not advanced for " + std::to_string(ms_since(since[i])) + " ms";
  }
  if (first) msg += "the readers caught up just as the wait ended";
  return deadline_exceeded(msg);
}

void RingWriter::close() {
  header_->flags.fetch_or(kClosedFlag, std::memory_order_seq_cst);
  wake_all(header_->data_gen, header_->data_waiters);
}

RingStats RingWriter::stats() const {
  RingStats stats;
  stats.written = header_->write_seq.load(std::memory_order_relaxed);
  stats.read.resize(readers_);
  for (uint32_t i = 0; i < readers_; ++i) {
    stats.read[i] = cursors_[i].read_seq.load(std::memory_order_relaxed);
  }
  stats.closed = (header_->flags.load(std::memory_order_relaxed) & kClosedFlag) != 0;
  stats.slots = slots_;
  stats.slot_bytes = slot_bytes_;
  return stats;
}

// ---- RingReader -------------------------------------------------------------------------------

Expected<RingReader> RingReader::attach(void* mem, size_t bytes, uint32_t reader_index,
                                        std::string_view label) {
  std::string name(label);
  TESSERA_ASSIGN_OR_RETURN(View view, validate(mem, bytes, name));
  if (reader_index >= view.readers) {
    return invalid_argument(name + ": reader index " + std::to_string(reader_index) +
                            " is out of range; the ring has " + std::to_string(view.readers) +
                            " readers");
  }
  RingReader r;
  r.header_ = view.header;
  r.cursor_ = &view.cursors[reader_index];
  r.slots_base_ = view.slots_base;
  r.slot_bytes_ = view.slot_bytes;
  r.slots_ = view.slots;
  r.stride_ = view.stride;
  r.index_ = reader_index;
  r.next_seq_ = r.cursor_->read_seq.load(std::memory_order_acquire);
  r.label_ = std::move(name);
  return r;
}

Status RingReader::wait_for_message(std::chrono::milliseconds timeout,
                                    Clock::time_point poll_from) {
  const uint64_t seq = next_seq_;
  auto ready = [&] {
    return header_->write_seq.load(std::memory_order_acquire) > seq ||
           (header_->flags.load(std::memory_order_acquire) & kClosedFlag) != 0;
  };
  const Clock::time_point start = Clock::now();
  if (!block_until(header_->data_gen, header_->data_waiters, deadline_after(timeout),
                   timeout.count() > 0, poll_from, ready)) {
    return deadline_exceeded(label_ + ": reader " + std::to_string(index_) + " waited " +
                             std::to_string(ms_since(start)) + " ms for message #" +
                             std::to_string(seq) + " but the writer has published only " +
                             std::to_string(header_->write_seq.load(std::memory_order_relaxed)) +
                             " messages");
  }
  // Reloaded after `closed` was seen (acquire): every message published before close is visible.
  const uint64_t written = header_->write_seq.load(std::memory_order_acquire);
  if (written > seq) {
    if (written - seq > slots_) {
      return internal_error(label_ + ": corrupt ring: reader " + std::to_string(index_) +
                            " is at message #" + std::to_string(seq) + " but " +
                            std::to_string(written) + " were published into " +
                            std::to_string(slots_) + " slots");
    }
    return Status::ok();
  }
  return unavailable(label_ + ": closed by the writer after " + std::to_string(written) +
                     " messages; reader " + std::to_string(index_) + " has read them all");
}

Expected<size_t> RingReader::read(std::span<std::byte> out, std::chrono::milliseconds timeout,
                                  Clock::time_point poll_from) {
  TESSERA_RETURN_IF_ERROR(wait_for_message(timeout, poll_from));
  SlotHeader* slot = slot_at(slots_base_, stride_, slots_, next_seq_);
  const size_t length = slot->length;
  if (length > slot_bytes_) {
    return internal_error(label_ + ": corrupt ring: message #" + std::to_string(next_seq_) +
                          " claims " + std::to_string(length) + " bytes in slots of " +
                          std::to_string(slot_bytes_));
  }
  if (length > out.size()) {
    return invalid_argument(label_ + ": message #" + std::to_string(next_seq_) + " has " +
                            std::to_string(length) + " bytes but the buffer holds only " +
                            std::to_string(out.size()));
  }
  if (length > 0) std::memcpy(out.data(), payload_of(slot), length);
  cursor_->read_seq.store(next_seq_ + 1, std::memory_order_release);  // consume (header point 2)
  ++next_seq_;
  wake_all(header_->space_gen, header_->space_waiters);
  return length;
}

Expected<std::vector<std::byte>> RingReader::read(std::chrono::milliseconds timeout) {
  TESSERA_RETURN_IF_ERROR(wait_for_message(timeout, Clock::time_point::min()));
  // Size the buffer from the slot's length (clamped here, validated by the span overload).
  const size_t length =
      std::min<size_t>(slot_at(slots_base_, stride_, slots_, next_seq_)->length, slot_bytes_);
  std::vector<std::byte> message(length);
  TESSERA_ASSIGN_OR_RETURN(size_t n, read(message, std::chrono::milliseconds(0)));
  message.resize(n);
  return message;
}

// ---- ShmRing ----------------------------------------------------------------------------------

Expected<ShmRing> ShmRing::create(const std::string& name, size_t slot_bytes, size_t slots,
                                  uint32_t readers) {
  Expected<size_t> bytes = BroadcastRing::layout_bytes(slot_bytes, slots, readers);
  if (!bytes) return bytes.status().with_context("ring " + name);
  TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, ShmSegment::create(name, *bytes));
  TESSERA_RETURN_IF_ERROR(
      BroadcastRing::format(segment.data(), segment.size(), slot_bytes, slots, readers));
  return ShmRing(std::move(segment));
}

Expected<ShmRing> ShmRing::open(const std::string& name) {
  TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, ShmSegment::open(name, /*writable=*/true));
  TESSERA_RETURN_IF_ERROR(validate(segment.data(), segment.size(), "ring " + name).status());
  return ShmRing(std::move(segment));
}

Expected<RingWriter> ShmRing::writer() {
  return RingWriter::attach(segment_.data(), segment_.size(), "ring " + segment_.name());
}

Expected<RingReader> ShmRing::reader(uint32_t reader_index) {
  return RingReader::attach(segment_.data(), segment_.size(), reader_index,
                            "ring " + segment_.name());
}

}  // namespace tessera
