// The node's object store, managed by the daemon: immutable blobs (weights shards, large
// tensors, prompts) shared between the driver and local actors, like Ray's Plasma but with one
// POSIX shared-memory segment per object, named <segment prefix><object id>.
//
// Life of an object:
//   create(owner, id, size)  the daemon creates and sizes the segment; the owner (a lease) maps
//                            it by the returned name, writable, and fills it;
//   seal(owner, id)          the creator declares it complete: from now on it is immutable
//                            (by contract: mappings made before sealing stay writable) and others
//                            may get() it;
//   get(owner, id)           returns {segment, size} and counts one reference for the owner,
//                            who maps the segment read-only;
//   release(owner, id)       drops one of the owner's references;
//   remove(owner, id)        deletes and unlinks once no references are held.
// An object belongs to the lease that created it: get, release, remove and seal by any other
// owner fail with PERMISSION_DENIED. To share an object with its own actors, a lease hands them
// the segment name (the segment is mode 0600: this user's processes only).
// Objects are never evicted: a sealed object stays until remove(), even with no references.
// The daemon holds each segment (ShmSegment owns the name); the store unlinks every segment it
// created when destroyed, so a daemon's objects do not outlive it (mappings already made by
// other processes remain valid until they unmap).
//
// Capacity counts the requested bytes of every live object, sealed or not (tmpfs rounds each
// up to whole pages), and the bytes other segments of the node (broadcast rings) reserve();
// the node as a whole, each owner, and the number of segments are capped. A create() or
// reserve() that would exceed a cap fails; nothing is evicted to make room.
//
// Threading: the store is single-threaded. It is used from the daemon's event loop only and
// does no locking; callbacks run on the calling thread, inside the call that triggers them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/shm_segment.h"
#include "common/status.h"

namespace tessera {

struct ObjectStoreOptions {
  // Prefix of every segment name, e.g. "/tessera-s1a2b3c-obj-" (from the session, so two daemons
  // on one machine never collide). A valid segment name once an id is appended.
  std::string segment_prefix;
  // Most bytes the live objects and reservations may take together.
  uint64_t capacity_bytes = 0;
  // Most bytes one owner (lease) may hold; 0 = capacity_bytes.
  uint64_t owner_capacity_bytes = 0;
  // Most segments (objects and reservations) alive at once.
  uint64_t max_segments = 4096;
};

// What get() hands out: where to map the object and how many bytes it has.
struct ObjectRef {
  std::string segment;
  uint64_t size = 0;  // bytes
};

// One line of list().
struct ObjectInfo {
  std::string id;
  std::string segment;
  uint64_t bytes = 0;
  uint64_t refs = 0;  // references held, all owners together
  bool sealed = false;
  std::string owner;  // the creator
};

struct ObjectStoreStats {
  uint64_t capacity = 0;
  uint64_t used = 0;     // bytes of live objects (sealed or not) and reservations
  uint64_t objects = 0;  // live objects (sealed or not) and reservations
  uint64_t owner_capacity = 0;
};

class ObjectStore {
 public:
  // Longest object id.
  static constexpr size_t kMaxIdLength = 64;
  // Identifies a pending on_sealed() callback, for cancel_seal_waiter(). Never 0.
  using SealWaiterId = uint64_t;

  // No system call happens here. An invalid prefix makes every create() fail with
  // INVALID_ARGUMENT; the daemon should check its options with validate() at start-up.
  explicit ObjectStore(ObjectStoreOptions options);
  ObjectStore(std::string segment_prefix, uint64_t capacity_bytes)
      : ObjectStore(ObjectStoreOptions{std::move(segment_prefix), capacity_bytes, 0}) {}
  // Unlinks every segment still held. Pending on_sealed() callbacks fire with UNAVAILABLE;
  // they must not call back into the store.
  ~ObjectStore();
  ObjectStore(const ObjectStore&) = delete;
  ObjectStore& operator=(const ObjectStore&) = delete;

  // OK if the prefix plus a longest id is a valid segment name and the capacity is non-zero;
  // INVALID_ARGUMENT otherwise.
  static Status validate(const ObjectStoreOptions& options);
  // OK if `id` has 1 to kMaxIdLength characters of [A-Za-z0-9._-]; INVALID_ARGUMENT otherwise.
  static Status validate_id(std::string_view id);

  // Creates object `id` of `bytes` bytes (> 0) for `owner` and returns its segment name; the
  // memory is reserved and zeroed. INVALID_ARGUMENT for a bad id, empty owner or size 0;
  // ALREADY_EXISTS if the id is live; RESOURCE_EXHAUSTED if a cap would be exceeded
  // ("object store full: 'id' needs N bytes but only M of C bytes are free; ...") or if
  // /dev/shm itself is full.
  Expected<std::string> create(const std::string& owner, const std::string& id, uint64_t bytes);

  // Marks the object complete and fires its on_sealed() callbacks with OK. NOT_FOUND if unknown,
  // PERMISSION_DENIED if `owner` is not the creator, FAILED_PRECONDITION if already sealed.
  Status seal(const std::string& owner, const std::string& id);

  // Counts one reference for `owner` and returns where the object is. NOT_FOUND if unknown,
  // PERMISSION_DENIED if `owner` did not create it, FAILED_PRECONDITION "not sealed yet" if it
  // is not sealed.
  Expected<ObjectRef> get(const std::string& owner, const std::string& id);

  // Drops one of `owner`'s references. NOT_FOUND if unknown, PERMISSION_DENIED if `owner` did
  // not create it, FAILED_PRECONDITION if `owner` holds none.
  Status release(const std::string& owner, const std::string& id);

  // Deletes the object, unlinks its segment and frees its bytes. NOT_FOUND if unknown,
  // PERMISSION_DENIED if `owner` did not create it, FAILED_PRECONDITION naming the number of
  // references while any are held. Removing an unsealed object fires its on_sealed()
  // callbacks with NOT_FOUND.
  Status remove(const std::string& owner, const std::string& id);

  // Counts `bytes` of another shared-memory segment of `owner` (`what` names it in errors)
  // against the caps, or fails with RESOURCE_EXHAUSTED like create(). unreserve() gives them
  // back.
  Status reserve(const std::string& owner, uint64_t bytes, const std::string& what);
  void unreserve(const std::string& owner, uint64_t bytes);

  // Called when lease `owner` ends: drops every reference it holds and removes the objects it
  // created but never sealed. Sealed objects it created stay (others may use them).
  void release_all(const std::string& owner);

  // Calls `callback` exactly once: with OK when object `id` is sealed, or with an error if it
  // can never be — NOT_FOUND when it is removed unsealed (directly or by release_all of its
  // creator), UNAVAILABLE when the store is destroyed. If the object is already sealed, or does
  // not exist, the callback runs before on_sealed() returns (with OK, resp. NOT_FOUND) and the
  // result is 0. Otherwise it runs inside the seal()/remove()/release_all() that decides it,
  // after the store's state is updated (so it may call into the store), and the result
  // identifies the pending wait. This lets the RPC layer answer "wait until sealed" without
  // polling; it enforces its own timeout with cancel_seal_waiter().
  SealWaiterId on_sealed(const std::string& id, std::function<void(Status)> callback);
  // Drops a pending callback without calling it. False if it already ran or was cancelled.
  bool cancel_seal_waiter(SealWaiterId waiter);

  // Every live object, ordered by id.
  std::vector<ObjectInfo> list() const;
  ObjectStoreStats stats() const;

 private:
  struct Object {
    std::string owner;  // creator
    ShmSegment segment;
    uint64_t bytes = 0;
    bool sealed = false;
    std::map<std::string, uint64_t> refs;  // owner -> references held (> 0)
    uint64_t total_refs = 0;
  };
  // Erases the object (unlinking its segment) and returns its pending seal waiters' callbacks,
  // for the caller to fire once its own bookkeeping is done.
  std::vector<std::function<void(Status)>> erase(std::map<std::string, Object>::iterator it);
  std::vector<std::function<void(Status)>> take_waiters(const std::string& id);

  // RESOURCE_EXHAUSTED when `owner` may not take `bytes` more in one more segment.
  Status check_room(const std::string& owner, uint64_t bytes, const std::string& what) const;
  void charge(const std::string& owner, uint64_t bytes);
  void refund(const std::string& owner, uint64_t bytes);

  ObjectStoreOptions options_;
  std::map<std::string, Object> objects_;
  uint64_t used_ = 0;
  uint64_t segments_ = 0;                          // objects and reservations
  std::map<std::string, uint64_t> used_by_owner_;  // bytes, owners holding some only
  // Pending seal waiters: object id -> (waiter id -> callback), in registration order.
  std::map<std::string, std::map<SealWaiterId, std::function<void(Status)>>> waiters_;
  std::map<SealWaiterId, std::string> waiter_objects_;  // waiter id -> object id
  SealWaiterId next_waiter_ = 1;
};

}  // namespace tessera
