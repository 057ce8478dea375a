// A named POSIX shared-memory segment (shm_open + mmap), owned RAII-style.
//
// Ownership of the *name*: the process that creates a segment owns its name and unlinks it when
// its ShmSegment is destroyed, so a segment never outlives the process that made it by accident.
// Segments obtained with open() only map an existing name and never unlink it. Ownership moves
// with the object (ShmSegment is movable, not copyable) and can be given up with
// release_ownership(), after which the name stays in /dev/shm until someone calls unlink().
//
// The mapping itself always belongs to the object: destruction (or move-assignment over it)
// unmaps. The address returned by data() is stable for the object's life, moves included, so
// views that borrow the mapping (RingWriter, RingReader) stay valid while any ShmSegment holding
// it is alive.
//
// fork(): a child inherits a copy of the object. If the child runs destructors (exit(), return
// from main) an owning copy unlinks the name under the parent; children should _exit() or call
// release_ownership() on inherited owning segments.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"

namespace tessera {

class ShmSegment {
 public:
  // Longest accepted name, the leading '/' included (Linux: one file name in /dev/shm).
  static constexpr size_t kMaxNameLength = 255;

  // Creates a new segment of `bytes` bytes (> 0) and maps it read-write. Fails with
  // ALREADY_EXISTS if the name is taken (O_EXCL: an existing segment is never reused or
  // truncated). The memory is reserved up front with posix_fallocate, so a segment larger than
  // the free space of /dev/shm fails here with RESOURCE_EXHAUSTED instead of killing a process
  // with SIGBUS on first touch; it reads as zeros. The result owns the name (see above); on any
  // failure nothing is left behind. Permissions are 0600: the same user's processes only.
  static Expected<ShmSegment> create(const std::string& name, size_t bytes);

  // Maps the whole of an existing segment (its size comes from fstat), read-write if
  // `writable`, else read-only (writing to it then faults). NOT_FOUND if there is no such
  // segment, PERMISSION_DENIED if it may not be opened that way, FAILED_PRECONDITION if it has
  // size 0 (its creator has not sized it yet). The result does not own the name.
  static Expected<ShmSegment> open(const std::string& name, bool writable);

  // Removes a name from the system (existing mappings stay valid until unmapped). NOT_FOUND if
  // there is no such segment.
  static Status unlink(const std::string& name);

  // OK if `name` is a portable segment name: a leading '/', then 1 to kMaxNameLength - 1
  // characters of [A-Za-z0-9._-] (so no other '/'), and not "/." or "/..". INVALID_ARGUMENT
  // naming the problem otherwise. create(), open() and unlink() check this first.
  static Status validate_name(std::string_view name);

  ShmSegment() = default;  // empty: valid() is false, data() is null
  ~ShmSegment();           // unmaps; unlinks the name if this object owns it
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // True when this object holds a mapping (it came from create() or open() and was not moved
  // from).
  bool valid() const { return data_ != nullptr; }
  // Start of the mapping (page-aligned), or null when !valid(). Read-only mappings must not be
  // written through this pointer.
  void* data() const { return data_; }
  // Bytes mapped: the whole segment.
  size_t size() const { return size_; }
  // The segment's name, e.g. "/tessera-s1a2b3c-ring"; empty when !valid().
  const std::string& name() const { return name_; }
  bool writable() const { return writable_; }
  // True when destruction will unlink the name (created here and not released).
  bool owns_name() const { return owns_name_; }
  // Gives up ownership of the name: destruction still unmaps but no longer unlinks. Use it when
  // another party (another process, or a later unlink()) becomes responsible for the name.
  void release_ownership() { owns_name_ = false; }

 private:
  ShmSegment(std::string name, void* data, size_t size, bool writable, bool owns_name)
      : name_(std::move(name)),
        data_(data),
        size_(size),
        writable_(writable),
        owns_name_(owns_name) {}
  void reset();  // unmap, unlink if owned, become empty

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool writable_ = false;
  bool owns_name_ = false;
};

}  // namespace tessera
