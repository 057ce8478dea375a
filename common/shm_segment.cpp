#include "common/shm_segment.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace tessera {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// Maps an errno from shm_open/ftruncate/posix_fallocate/mmap to our codes.
Code code_for_errno(int err) {
  switch (err) {
    case ENOENT:
      return Code::kNotFound;
    case EEXIST:
      return Code::kAlreadyExists;
    case EACCES:
    case EPERM:
      return Code::kPermissionDenied;
    case ENOSPC:
    case ENOMEM:
    case EFBIG:
    case EMFILE:
    case ENFILE:
      return Code::kResourceExhausted;
    case ENAMETOOLONG:
    case EINVAL:
      return Code::kInvalidArgument;
    default:
      return Code::kInternal;
  }
}

Status errno_status(int err, const std::string& what) {
  return Status(code_for_errno(err), what + ": " + errno_text(err));
}

bool name_char_ok(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

}  // namespace

Status ShmSegment::validate_name(std::string_view name) {
  const std::string shown = "shared-memory segment name '" + std::string(name) + "'";
  if (name.size() < 2 || name[0] != '/') {
    return invalid_argument(shown + " must be '/' followed by at least one character");
  }
  if (name.size() > kMaxNameLength) {
    return invalid_argument("shared-memory segment name '" + std::string(name.substr(0, 40)) +
                            "...' is " + std::to_string(name.size()) +
                            " characters long; the limit is " + std::to_string(kMaxNameLength));
  }
  if (name == "/." || name == "/..") return invalid_argument(shown + " is reserved");
  for (size_t i = 1; i < name.size(); ++i) {
    if (!name_char_ok(name[i])) {
      return invalid_argument(shown + " has a bad character at position " + std::to_string(i) +
                              " (allowed after the leading '/': A-Z a-z 0-9 . _ -)");
    }
  }
  return Status::ok();
}

Expected<ShmSegment> ShmSegment::create(const std::string& name, size_t bytes) {
  TESSERA_RETURN_IF_ERROR(validate_name(name));
  if (bytes == 0)
    return invalid_argument("cannot create shared-memory segment " + name + " of 0 bytes");
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    if (err == EEXIST) {
      return Status(Code::kAlreadyExists, "shared-memory segment " + name +
                                              " already exists (a stale one can be removed "
                                              "from /dev/shm)");
    }
    return errno_status(err, "cannot create shared-memory segment " + name);
  }
  // From here on, failure must close the descriptor and remove the half-made segment.
  auto fail = [&](Status st) -> Status {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return st;
  };
  const std::string sized =
      "shared-memory segment " + name + " of " + std::to_string(bytes) + " bytes";
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(errno_status(errno, "cannot size " + sized));
  }
  // posix_fallocate returns the error number instead of setting errno. It reserves the pages
  // now, so running out of /dev/shm is a clean error here and not SIGBUS on first touch.
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    Status st = errno_status(err, "cannot reserve memory for " + sized);
    if (err == ENOSPC || err == ENOMEM) {
      st = resource_exhausted("cannot reserve memory for " + sized + ": " + errno_text(err) +
                              " (is /dev/shm full or too small?)");
    }
    return fail(st);
  }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return fail(errno_status(errno, "cannot map " + sized));
  ::close(fd);
  return ShmSegment(name, data, bytes, /*writable=*/true, /*owns_name=*/true);
}

Expected<ShmSegment> ShmSegment::open(const std::string& name, bool writable) {
  TESSERA_RETURN_IF_ERROR(validate_name(name));
  const char* mode = writable ? "read-write" : "read-only";
  int fd = ::shm_open(name.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return not_found("shared-memory segment " + name + " does not exist");
    return errno_status(err, std::string("cannot open shared-memory segment ") + name + " " + mode);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return errno_status(err, "cannot stat shared-memory segment " + name);
  }
  if (st.st_size <= 0) {
    ::close(fd);
    return failed_precondition("shared-memory segment " + name +
                               " has size 0 (its creator has not sized it yet)");
  }
  size_t bytes = static_cast<size_t>(st.st_size);
  int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* data = ::mmap(nullptr, bytes, prot, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    return errno_status(err, std::string("cannot map shared-memory segment ") + name + " (" +
                                 std::to_string(bytes) + " bytes) " + mode);
  }
  return ShmSegment(name, data, bytes, writable, /*owns_name=*/false);
}

Status ShmSegment::unlink(const std::string& name) {
  TESSERA_RETURN_IF_ERROR(validate_name(name));
  if (::shm_unlink(name.c_str()) != 0) {
    int err = errno;
    if (err == ENOENT) return not_found("shared-memory segment " + name + " does not exist");
    return errno_status(err, "cannot unlink shared-memory segment " + name);
  }
  return Status::ok();
}

ShmSegment::~ShmSegment() { reset(); }

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      writable_(std::exchange(other.writable_, false)),
      owns_name_(std::exchange(other.owns_name_, false)) {
  other.name_.clear();
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    reset();
    name_ = std::move(other.name_);
    other.name_.clear();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    writable_ = std::exchange(other.writable_, false);
    owns_name_ = std::exchange(other.owns_name_, false);
  }
  return *this;
}

void ShmSegment::reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (owns_name_ && ::shm_unlink(name_.c_str()) != 0) {
    int err = errno;
    if (err != ENOENT) {
      spdlog::warn("cannot unlink shared-memory segment {}: {}", name_, errno_text(err));
    }
  }
  name_.clear();
  data_ = nullptr;
  size_ = 0;
  writable_ = false;
  owns_name_ = false;
}

}  // namespace tessera
