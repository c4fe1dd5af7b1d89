// Status and Result<T>: the one way errors cross a module boundary.
//
// A Status is cheap on success (one null pointer) and carries a code and a
// message otherwise. Result<T> holds either a value or a non-OK Status.
// Both are [[nodiscard]]: an ignored error is a compile warning (an error in CI).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include <glog/logging.h>

namespace penumbra {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller's input is wrong; retrying will not help
  kNotFound,            // a named thing (file, tensor, key) does not exist
  kCorruption,          // stored or received bytes fail validation
  kUnavailable,         // a dependency is down or busy; retryable
  kResourceExhausted,   // memory, quota or capacity; retryable later
  kDeadlineExceeded,    // retryable
  kFailedPrecondition,  // the system is not in a state to do this
  kUnimplemented,
  kInternal,  // a bug or an unexpected library failure
  kIOError,
  kCancelled,
  kPermissionDenied,  // the caller may not do this (another tenant's, a bad key)
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status PermissionDenied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  // True when the same call may succeed later (the coordinator retries these).
  bool retryable() const;
  // "InvalidArgument: message", or "OK".
  std::string ToString() const;
  // Returns a copy whose message is "context: message" (no-op when OK).
  Status WithContext(std::string_view context) const;
  // When the same call may succeed again (a quota's refill, a busy server),
  // in milliseconds; 0 when not said. Travels to clients as
  // PenumbraError.retry_after_ms.
  int32_t retry_after_ms() const { return rep_ ? rep_->retry_after_ms : 0; }
  // A copy carrying `ms` as retry_after_ms (no-op when OK).
  Status WithRetryAfter(int32_t ms) const;

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    int32_t retry_after_ms = 0;
  };
  std::shared_ptr<const Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    CHECK(!std::get<Status>(v_).ok()) << "Result constructed from an OK Status";
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    CHECK(ok()) << status();
    return std::get<T>(v_);
  }
  const T& value() const& {
    CHECK(ok()) << status();
    return std::get<T>(v_);
  }
  T&& value() && {
    CHECK(ok()) << status();
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace penumbra

#define PENUMBRA_CONCAT_INNER_(a, b) a##b
#define PENUMBRA_CONCAT_(a, b) PENUMBRA_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function if `expr` is not OK.
#define PENUMBRA_RETURN_IF_ERROR(expr) \
  do {                                 \
    ::penumbra::Status _st = (expr);   \
    if (!_st.ok()) return _st;         \
  } while (0)

// `lhs = value of expr`, or returns its Status. lhs may declare: auto x.
#define PENUMBRA_ASSIGN_OR_RETURN(lhs, expr) \
  PENUMBRA_ASSIGN_OR_RETURN_IMPL_(PENUMBRA_CONCAT_(_res_, __LINE__), lhs, expr)
#define PENUMBRA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()
