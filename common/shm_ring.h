// A single-writer, multi-reader broadcast ring in one shared-memory region: the per-step channel
// from the driver (or a relaying daemon) to the GPU actors of one node. Every message reaches
// every reader, in order; none is lost or overwritten. A slow reader slows the writer down
// (back-pressure) instead of missing messages.
//
// Layout (all offsets from the start of the region, which must be 128-byte aligned; mmap gives
// page alignment). kCacheLine = 128 keeps every independently written word on its own line,
// adjacent-line prefetch included:
//   header        magic, version, readers, slot_bytes, slots, slot stride, total bytes, flags
//                 (closed bit)                                             [1 line]
//                 atomic<u64> write_seq: messages published so far          [own line]
//                 atomic<u32> data_gen, data_waiters: readers' futex word   [own line]
//                 atomic<u32> space_gen, space_waiters: writer's futex word [own line]
//   cursors       readers x atomic<u64> read_seq: messages reader i has consumed [own line each]
//   slots         slots x { u32 length; u32 reserved; std::byte payload[slot_bytes] },
//                 each padded to a multiple of 64 bytes
// Message #s (s = 0, 1, ...) lives in slot s % slots.
//
// Memory ordering — why it is safe:
//  1. Publish. The writer fills slot s % slots (length + payload, plain stores), then
//     store-releases write_seq = s + 1. A reader load-acquires write_seq and touches slot
//     r % slots only when write_seq > r, so every byte of message r happens-before its copy:
//     a reader can never see a half-written slot.
//  2. Consume. A reader copies the slot out (plain loads), then store-releases read_seq = r + 1.
//  3. Reuse. Before writing message s, the writer load-acquires every read_seq and proceeds only
//     when all are > s - slots, i.e. every reader has finished copying message s - slots, the
//     previous occupant of the slot. Those copies happen-before the overwrite (2 → 3), so the
//     writer never overwrites a slot a reader is still copying.
//  4. Sleep/wake. Blocking uses Linux futexes on 32-bit generation words in the region
//     (FUTEX_WAIT / FUTEX_WAKE, not the _PRIVATE variants, since waiters are in other
//     processes). A waiter spins briefly, then increments the waiters count, reads the
//     generation, re-checks its condition behind a seq_cst fence and FUTEX_WAITs on that
//     generation. The waker changes the condition (write_seq, read_seq or closed), bumps the
//     generation, then behind a seq_cst fence reads the waiters count and FUTEX_WAKEs all if it
//     is non-zero. The two fences make it impossible for the waiter to miss the new condition
//     while the waker sees no waiters; a bump between the waiter's read of the generation and
//     its FUTEX_WAIT makes the kernel return at once. So no wake-up is lost, and an uncontended
//     ring makes no system calls.
//  5. Distrust. The geometry (readers, slot_bytes, slots) is validated at attach and copied into
//     the process; no later access takes a size or offset from shared memory except a slot's
//     length, which is checked against slot_bytes before use. A corrupt region gives an error
//     status, never an out-of-bounds access.
//
// Roles: exactly one RingWriter and at most one RingReader per reader index may be attached at a
// time (the caller guarantees it; it is configuration, not negotiated here). A reader's cursor
// lives in the region, so a reader that re-attaches resumes where its predecessor stopped, and a
// re-attached writer continues from write_seq. The classes are views: they borrow the memory,
// which must outlive them, and are movable but not copyable (a copy would be a second writer).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/shm_segment.h"
#include "common/status.h"

namespace tessera {

namespace ring_internal {
struct RingHeader;
struct ReaderCursor;
}  // namespace ring_internal

class BroadcastRing {
 public:
  static constexpr uint32_t kVersion = 1;  // bump on any layout change
  static constexpr size_t kCacheLine = 128;
  static constexpr size_t kMaxSlotBytes = size_t{1} << 30;  // lengths are stored as u32
  static constexpr size_t kMaxSlots = size_t{1} << 20;
  static constexpr uint32_t kMaxReaders = 1024;

  // Bytes a region needs for this geometry. INVALID_ARGUMENT if a value is 0 or above its
  // kMax* limit.
  static Expected<size_t> layout_bytes(size_t slot_bytes, size_t slots, uint32_t readers);

  // Initialises a ring in place over `bytes` bytes at `mem` (128-byte aligned, at least
  // layout_bytes(...)): an empty, open ring with every cursor at 0. Done once, by the region's
  // owner, before anyone attaches; the magic number is stored last (with release), so an
  // attacher racing with format() sees "not a ring" rather than a half-made header.
  // Formatting a region that readers or a writer are attached to is a bug.
  static Status format(void* mem, size_t bytes, size_t slot_bytes, size_t slots, uint32_t readers);
};

// Point-in-time counters, e.g. for `tessera status`. Read with relaxed loads: a snapshot of
// moving values, not a synchronisation point.
struct RingStats {
  uint64_t written = 0;        // messages published (write_seq)
  std::vector<uint64_t> read;  // messages consumed, per reader index
  bool closed = false;
  size_t slots = 0;
  size_t slot_bytes = 0;
};

class RingWriter {
 public:
  // Validates the header of a formatted region of `bytes` mapped bytes and attaches as its
  // writer. FAILED_PRECONDITION if the region is not a ring of this version, or its recorded
  // geometry does not fit `bytes` or is inconsistent (corrupt). `label` names the ring in error
  // messages (e.g. its segment name).
  static Expected<RingWriter> attach(void* mem, size_t bytes, std::string_view label = "ring");

  RingWriter(RingWriter&&) noexcept = default;
  RingWriter& operator=(RingWriter&&) noexcept = default;
  RingWriter(const RingWriter&) = delete;
  RingWriter& operator=(const RingWriter&) = delete;

  // Publishes one message (0 to slot_bytes bytes) to every reader. Blocks while the ring is
  // full, i.e. until the slowest reader has consumed the message written `slots` messages ago.
  // INVALID_ARGUMENT if msg is larger than slot_bytes (both sizes named); FAILED_PRECONDITION
  // after close(); DEADLINE_EXCEEDED if space does not free up within `timeout`, naming each
  // reader that holds it up, how far behind it is and for how long it has not advanced. A
  // timeout of 0 only tries. On error nothing was published.
  Status write(std::span<const std::byte> msg, std::chrono::milliseconds timeout);

  // Marks the ring closed and wakes every reader. Readers still receive every message published
  // before, then UNAVAILABLE. Idempotent. Writes after close fail.
  void close();

  // Messages published so far (write_seq).
  uint64_t written() const { return next_seq_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t slots() const { return slots_; }
  uint32_t readers() const { return readers_; }
  RingStats stats() const;

 private:
  RingWriter() = default;
  uint64_t min_read_seq() const;
  Status timeout_status(uint64_t seq, std::chrono::milliseconds waited,
                        const std::vector<uint64_t>& seen,
                        const std::vector<std::chrono::steady_clock::time_point>& since) const;

  ring_internal::RingHeader* header_ = nullptr;
  ring_internal::ReaderCursor* cursors_ = nullptr;
  std::byte* slots_base_ = nullptr;
  size_t slot_bytes_ = 0;
  size_t slots_ = 0;
  size_t stride_ = 0;
  uint32_t readers_ = 0;
  uint64_t next_seq_ = 0;  // local copy of write_seq: only this writer changes it
  std::string label_;
};

class RingReader {
 public:
  // Validates the header (as RingWriter::attach) and attaches as reader `reader_index`
  // (< readers, else INVALID_ARGUMENT). The reader's position is its cursor in the region
  // (0 for a fresh ring). The mapping must be writable: consuming stores the cursor.
  static Expected<RingReader> attach(void* mem, size_t bytes, uint32_t reader_index,
                                     std::string_view label = "ring");

  RingReader(RingReader&&) noexcept = default;
  RingReader& operator=(RingReader&&) noexcept = default;
  RingReader(const RingReader&) = delete;
  RingReader& operator=(const RingReader&) = delete;

  // Copies the next message into `out` and consumes it; returns its length. Waits up to
  // `timeout` for one to be published (0: only tries). Errors:
  //  DEADLINE_EXCEEDED  nothing arrived in time (the message says which message was awaited);
  //  UNAVAILABLE        the writer closed the ring and every message has been read: the end;
  //  INVALID_ARGUMENT   `out` is smaller than the message (both sizes named); the message is
  //                     NOT consumed, so a retry with a buffer of slot_bytes() succeeds;
  //  INTERNAL           the region is corrupt (a length above slot_bytes, inconsistent cursors).
  // poll_from: when the caller expects the message (the driver: its last step's round trip
  // after this step's submission); from then on the reader polls for up to 2 ms instead of
  // sleeping on the futex, whose wake-up after a long sleep costs tens of microseconds.
  Expected<size_t> read(std::span<std::byte> out, std::chrono::milliseconds timeout,
                        std::chrono::steady_clock::time_point poll_from =
                            std::chrono::steady_clock::time_point::min());
  // As above, returning the message in a new vector.
  Expected<std::vector<std::byte>> read(std::chrono::milliseconds timeout);

  uint32_t index() const { return index_; }
  // Messages this reader has consumed (its cursor).
  uint64_t position() const { return next_seq_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t slots() const { return slots_; }

 private:
  RingReader() = default;
  // Waits for message next_seq_ to be published; OK, DEADLINE_EXCEEDED, UNAVAILABLE or INTERNAL.
  Status wait_for_message(std::chrono::milliseconds timeout,
                          std::chrono::steady_clock::time_point poll_from);

  ring_internal::RingHeader* header_ = nullptr;
  ring_internal::ReaderCursor* cursor_ = nullptr;
  std::byte* slots_base_ = nullptr;
  size_t slot_bytes_ = 0;
  size_t slots_ = 0;
  size_t stride_ = 0;
  uint32_t index_ = 0;
  uint64_t next_seq_ = 0;  // local copy of this reader's read_seq
  std::string label_;
};

// A ring in its own named shared-memory segment. The node daemon create()s it (and owns the
// name: it is unlinked when the ShmRing is destroyed); the writer and the actors open() it by
// name. writer() and reader() return views borrowing this object's mapping: the ShmRing must
// outlive them (moving the ShmRing is fine, the mapping does not move).
class ShmRing {
 public:
  // Creates segment `name` sized by layout_bytes and formats it. Errors as ShmSegment::create
  // and BroadcastRing::layout_bytes.
  static Expected<ShmRing> create(const std::string& name, size_t slot_bytes, size_t slots,
                                  uint32_t readers);
  // Maps an existing ring read-write (readers store their cursors) and validates its header.
  static Expected<ShmRing> open(const std::string& name);

  ShmRing(ShmRing&&) noexcept = default;
  ShmRing& operator=(ShmRing&&) noexcept = default;

  // Attach views; errors as RingWriter::attach / RingReader::attach, labelled with the name.
  Expected<RingWriter> writer();
  Expected<RingReader> reader(uint32_t reader_index);

  const ShmSegment& segment() const { return segment_; }
  // For ownership decisions (e.g. segment().release_ownership()).
  ShmSegment& segment() { return segment_; }

 private:
  explicit ShmRing(ShmSegment segment) : segment_(std::move(segment)) {}
  ShmSegment segment_;
};

}  // namespace tessera
