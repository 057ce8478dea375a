#include "daemon/object_store.h"

#include <spdlog/spdlog.h>

#include <utility>

namespace tessera {
namespace {

bool id_char_ok(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

std::string quoted(const std::string& id) { return "'" + id + "'"; }

Status check_owner(const std::string& owner) {
  if (owner.empty()) return invalid_argument("object store: the owner (lease) must not be empty");
  return Status::ok();
}

void fire(std::vector<std::function<void(Status)>>& callbacks, const Status& status) {
  for (auto& callback : callbacks) callback(status);
}

}  // namespace

ObjectStore::ObjectStore(ObjectStoreOptions options) : options_(std::move(options)) {
  if (options_.owner_capacity_bytes == 0 ||
      options_.owner_capacity_bytes > options_.capacity_bytes) {
    options_.owner_capacity_bytes = options_.capacity_bytes;
  }
}

Status ObjectStore::check_room(const std::string& owner, uint64_t bytes,
                               const std::string& what) const {
  const uint64_t free = options_.capacity_bytes - used_;
  if (bytes > free) {
    return resource_exhausted("object store full: " + what + " needs " + std::to_string(bytes) +
                              " bytes but only " + std::to_string(free) + " of " +
                              std::to_string(options_.capacity_bytes) +
                              " bytes are free; release or delete objects, or start the daemon "
                              "with a larger --object-store-memory");
  }
  auto mine = used_by_owner_.find(owner);
  const uint64_t held = mine == used_by_owner_.end() ? 0 : mine->second;
  if (bytes > options_.owner_capacity_bytes - held) {
    return resource_exhausted(what + " needs " + std::to_string(bytes) + " bytes but " + owner +
                              " already holds " + std::to_string(held) + " of the " +
                              std::to_string(options_.owner_capacity_bytes) +
                              " bytes one lease may hold (--shm-per-lease); free some first");
  }
  if (segments_ >= options_.max_segments) {
    return resource_exhausted(what + ": the node already has " + std::to_string(segments_) +
                              " shared-memory segments, the most it keeps; delete objects first");
  }
  return Status::ok();
}

void ObjectStore::charge(const std::string& owner, uint64_t bytes) {
  used_ += bytes;
  ++segments_;
  used_by_owner_[owner] += bytes;
}

void ObjectStore::refund(const std::string& owner, uint64_t bytes) {
  used_ -= bytes;
  --segments_;
  auto it = used_by_owner_.find(owner);
  if (it == used_by_owner_.end()) return;
  it->second -= std::min(it->second, bytes);
  if (it->second == 0) used_by_owner_.erase(it);
}

Status ObjectStore::reserve(const std::string& owner, uint64_t bytes, const std::string& what) {
  TESSERA_RETURN_IF_ERROR(check_owner(owner));
  TESSERA_RETURN_IF_ERROR(check_room(owner, bytes, what));
  charge(owner, bytes);
  return Status::ok();
}

void ObjectStore::unreserve(const std::string& owner, uint64_t bytes) { refund(owner, bytes); }

namespace {

Status not_yours(const std::string& action, const std::string& id) {
  return Status(Code::kPermissionDenied,
                "cannot " + action + " object " + quoted(id) + ": it belongs to another lease");
}

}  // namespace

ObjectStore::~ObjectStore() {
  // Segments unlink themselves (each ShmSegment owns its name); pending waiters learn why.
  std::vector<std::function<void(Status)>> pending;
  for (auto& [id, waiters] : waiters_) {
    for (auto& [waiter, callback] : waiters) pending.push_back(std::move(callback));
  }
  waiters_.clear();
  waiter_objects_.clear();
  fire(pending, unavailable("the object store is shutting down"));
}

Status ObjectStore::validate(const ObjectStoreOptions& options) {
  Status name = ShmSegment::validate_name(options.segment_prefix + std::string(kMaxIdLength, 'x'));
  if (!name.is_ok()) return name.with_context("object store segment prefix");
  if (options.capacity_bytes == 0) return invalid_argument("object store capacity must not be 0");
  return Status::ok();
}

Status ObjectStore::validate_id(std::string_view id) {
  if (id.empty() || id.size() > kMaxIdLength) {
    return invalid_argument("object id '" + std::string(id.substr(0, kMaxIdLength)) +
                            (id.size() > kMaxIdLength ? "...'" : "'") + " must have 1 to " +
                            std::to_string(kMaxIdLength) + " characters, it has " +
                            std::to_string(id.size()));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    if (!id_char_ok(id[i])) {
      return invalid_argument("object id '" + std::string(id) +
                              "' has a bad character at position " + std::to_string(i) +
                              " (allowed: A-Z a-z 0-9 . _ -)");
    }
  }
  return Status::ok();
}

Expected<std::string> ObjectStore::create(const std::string& owner, const std::string& id,
                                          uint64_t bytes) {
  TESSERA_RETURN_IF_ERROR(check_owner(owner));
  TESSERA_RETURN_IF_ERROR(validate_id(id));
  if (bytes == 0) return invalid_argument("object " + quoted(id) + ": size must not be 0");
  if (objects_.count(id) != 0) {
    return Status(Code::kAlreadyExists, "object " + quoted(id) + " already exists");
  }
  TESSERA_RETURN_IF_ERROR(check_room(owner, bytes, quoted(id)));
  Expected<ShmSegment> segment = ShmSegment::create(options_.segment_prefix + id, bytes);
  if (!segment) return segment.status().with_context("object " + quoted(id));
  std::string name = segment->name();
  Object object;
  object.owner = owner;
  object.segment = std::move(*segment);
  object.bytes = bytes;
  objects_.emplace(id, std::move(object));
  charge(owner, bytes);
  spdlog::debug("object store: {} created {} ({} bytes) in {}", owner, id, bytes, name);
  return name;
}

Status ObjectStore::seal(const std::string& owner, const std::string& id) {
  auto it = objects_.find(id);
  if (it == objects_.end())
    return not_found("cannot seal object " + quoted(id) + ": no such object");
  Object& object = it->second;
  if (object.owner != owner) return not_yours("seal", id);
  if (object.sealed) {
    return failed_precondition("cannot seal object " + quoted(id) + ": it is already sealed");
  }
  object.sealed = true;
  auto callbacks = take_waiters(id);
  fire(callbacks, Status::ok());
  return Status::ok();
}

Expected<ObjectRef> ObjectStore::get(const std::string& owner, const std::string& id) {
  TESSERA_RETURN_IF_ERROR(check_owner(owner));
  auto it = objects_.find(id);
  if (it == objects_.end()) return not_found("object " + quoted(id) + " does not exist");
  Object& object = it->second;
  if (object.owner != owner) return not_yours("get", id);
  if (!object.sealed) {
    return failed_precondition("object " + quoted(id) + " is not sealed yet (its creator " +
                               object.owner + " is still writing it)");
  }
  ++object.refs[owner];
  ++object.total_refs;
  return ObjectRef{object.segment.name(), object.bytes};
}

Status ObjectStore::release(const std::string& owner, const std::string& id) {
  auto it = objects_.find(id);
  if (it == objects_.end())
    return not_found("cannot release object " + quoted(id) + ": no such object");
  Object& object = it->second;
  if (object.owner != owner) return not_yours("release", id);
  auto ref = object.refs.find(owner);
  if (ref == object.refs.end()) {
    return failed_precondition("cannot release object " + quoted(id) + ": " + owner +
                               " holds no reference to it");
  }
  if (--ref->second == 0) object.refs.erase(ref);
  --object.total_refs;
  return Status::ok();
}

Status ObjectStore::remove(const std::string& owner, const std::string& id) {
  auto it = objects_.find(id);
  if (it == objects_.end())
    return not_found("cannot delete object " + quoted(id) + ": no such object");
  const Object& object = it->second;
  if (object.owner != owner) return not_yours("delete", id);
  if (object.total_refs > 0) {
    std::string holders;
    for (const auto& [holder, count] : object.refs) {
      holders += (holders.empty() ? "" : ", ") + holder + ": " + std::to_string(count);
    }
    return failed_precondition("cannot delete object " + quoted(id) + ": " +
                               std::to_string(object.total_refs) + " reference" +
                               (object.total_refs == 1 ? " is" : "s are") + " still held (" +
                               holders + ")");
  }
  auto callbacks = erase(it);
  fire(callbacks, not_found("object " + quoted(id) + " was deleted before it was sealed"));
  return Status::ok();
}

void ObjectStore::release_all(const std::string& owner) {
  std::vector<std::pair<std::string, std::vector<std::function<void(Status)>>>> dropped;
  for (auto it = objects_.begin(); it != objects_.end();) {
    Object& object = it->second;
    auto ref = object.refs.find(owner);
    if (ref != object.refs.end()) {
      object.total_refs -= ref->second;
      object.refs.erase(ref);
    }
    if (!object.sealed && object.owner == owner) {
      // An unsealed object has no references (get() needs it sealed): nothing else uses it.
      std::string id = it->first;
      auto next = std::next(it);
      dropped.emplace_back(id, erase(it));
      it = next;
    } else {
      ++it;
    }
  }
  for (auto& [id, callbacks] : dropped) {
    fire(callbacks, not_found("object " + quoted(id) +
                              " was deleted before it was sealed: its "
                              "creator " +
                              owner + " ended"));
  }
}

ObjectStore::SealWaiterId ObjectStore::on_sealed(const std::string& id,
                                                 std::function<void(Status)> callback) {
  auto it = objects_.find(id);
  if (it == objects_.end()) {
    callback(not_found("object " + quoted(id) + " does not exist"));
    return 0;
  }
  if (it->second.sealed) {
    callback(Status::ok());
    return 0;
  }
  SealWaiterId waiter = next_waiter_++;
  waiters_[id].emplace(waiter, std::move(callback));
  waiter_objects_.emplace(waiter, id);
  return waiter;
}

bool ObjectStore::cancel_seal_waiter(SealWaiterId waiter) {
  auto it = waiter_objects_.find(waiter);
  if (it == waiter_objects_.end()) return false;
  auto per_object = waiters_.find(it->second);
  if (per_object != waiters_.end()) {
    per_object->second.erase(waiter);
    if (per_object->second.empty()) waiters_.erase(per_object);
  }
  waiter_objects_.erase(it);
  return true;
}

std::vector<ObjectInfo> ObjectStore::list() const {
  std::vector<ObjectInfo> out;
  out.reserve(objects_.size());
  for (const auto& [id, object] : objects_) {
    out.push_back(ObjectInfo{id, object.segment.name(), object.bytes, object.total_refs,
                             object.sealed, object.owner});
  }
  return out;
}

ObjectStoreStats ObjectStore::stats() const {
  return ObjectStoreStats{options_.capacity_bytes, used_, segments_, options_.owner_capacity_bytes};
}

std::vector<std::function<void(Status)>> ObjectStore::erase(
    std::map<std::string, Object>::iterator it) {
  std::string id = it->first;
  refund(it->second.owner, it->second.bytes);
  spdlog::debug("object store: deleted {} ({} bytes)", id, it->second.bytes);
  objects_.erase(it);  // ~ShmSegment unmaps and unlinks
  return take_waiters(id);
}

std::vector<std::function<void(Status)>> ObjectStore::take_waiters(const std::string& id) {
  std::vector<std::function<void(Status)>> callbacks;
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return callbacks;
  for (auto& [waiter, callback] : it->second) {
    waiter_objects_.erase(waiter);
    callbacks.push_back(std::move(callback));
  }
  waiters_.erase(it);
  return callbacks;
}

}  // namespace tessera
