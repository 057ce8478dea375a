// Typed results for expected failures (a peer died, out of memory, timeout, bad request).
//
// `Status` is an error code plus a human message; `Expected<T>` holds a value or a failed Status.
// Invariants use TESSERA_CHECK (a bug in this program); validation of user input returns a
// Status and never asserts.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace tessera {

enum class Code {
  kOk = 0,
  kInvalidArgument,     // caller's input is malformed (bad flag, bad request field)
  kNotFound,            // a named thing (actor, object, binary, node) does not exist
  kAlreadyExists,       // a name is taken
  kUnavailable,         // a peer cannot be reached or went away; retrying may help
  kDeadlineExceeded,    // a wait ran past its timeout
  kResourceExhausted,   // a capacity limit (shared memory, GPU memory) was hit
  kFailedPrecondition,  // the system is not in a state that allows this (e.g. version mismatch)
  kPermissionDenied,    // the caller does not own the thing it asked for
  kInternal,            // a bug or an unexpected system error
};

// Name of a code, e.g. "UNAVAILABLE".
std::string_view code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "UNAVAILABLE: cannot reach head at 10.0.0.1:6380 (connection refused)"
  std::string to_string() const;
  // Returns a copy with "context: " prefixed to the message.
  Status with_context(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
inline Status deadline_exceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }

// The exit code of a command that ended with `st`: 0, or 1 after "<command>: <message>" on
// stderr (e.g. command_exit(st, "tessera generate")).
int command_exit(const Status& st, const std::string& command);
inline Status failed_precondition(std::string m) {
  return {Code::kFailedPrecondition, std::move(m)};
}
inline Status internal_error(std::string m) { return {Code::kInternal, std::move(m)}; }

// A value of type T, or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Expected(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).is_ok()) {
      v_ = Status(Code::kInternal, "Expected constructed from an OK status without a value");
    }
  }

  bool has_value() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return has_value(); }
  // Precondition: has_value().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  // OK when there is a value.
  Status status() const { return has_value() ? Status() : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

[[noreturn]] void check_failed(const char* expr, const char* file, int line, std::string_view msg);

}  // namespace tessera

// An invariant of this program: failure is a bug here, never a user's mistake.
#define TESSERA_CHECK(cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) ::tessera::check_failed(#cond, __FILE__, __LINE__, "" __VA_ARGS__); \
  } while (0)

// Propagates a failed Status from an expression returning Status.
#define TESSERA_RETURN_IF_ERROR(expr) \
  do {                                \
    ::tessera::Status _st = (expr);   \
    if (!_st.is_ok()) return _st;     \
  } while (0)

#define TESSERA_CONCAT_INNER(a, b) a##b
#define TESSERA_CONCAT(a, b) TESSERA_CONCAT_INNER(a, b)
// TESSERA_ASSIGN_OR_RETURN(auto x, expr): x = expr's value, or return its Status.
#define TESSERA_ASSIGN_OR_RETURN(decl, expr) \
  TESSERA_ASSIGN_OR_RETURN_IMPL(TESSERA_CONCAT(_exp_, __LINE__), decl, expr)
#define TESSERA_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.has_value()) return tmp.status();           \
  decl = std::move(tmp).value()
