// Coordinator internals shared by its files (coordinator*.cc): the state of
// one generation (Coordinator::Request) and small helpers. Not part of the
// coordinator's interface: include coordinator.h.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/counter.h>

#include "common/status.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/document_registry.h"
#include "coordinator/tenants/tenants.h"
#include "coordinator/tokenizer/text_codec.h"
#include "gen-cpp/Penumbra.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {
namespace internal {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A Thrift handler's error: thrown as the public API's PenumbraError.
[[noreturn]] inline void Throw(const Status& s) { throw transport::ToRpcError(s); }

template <typename T>
T OrThrow(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(*r);
}

inline void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}

inline milliseconds Left(Clock::time_point deadline) {
  return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

// A quota's refusal as a Status that carries its retry-after.
inline Status QuotaStatus(const tenants::QuotaDecision& d, prometheus::Family<prometheus::Counter>* refusals,
                          const std::string& tenant) {
  if (d.ok()) return Status::OK();
  if (d.status.code() == StatusCode::kResourceExhausted) refusals->Add({{"tenant", tenant}}).Increment();
  return d.status.WithRetryAfter(d.retry_after_ms());
}

inline int64_t UnixMs() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace internal

struct Coordinator::Request {
  std::string id, tenant;
  int worker = -1;
  std::string wid;  // the worker's handle of its generation
  std::vector<std::string> stop;
  internal::Clock::time_point created, finished;
  std::optional<internal::Clock::time_point> deadline;  // enforced here too (the worker checks between steps)
  std::mutex mu;                                        // the fields below
  std::vector<int32_t> ids;
  std::string text;
  IncrementalText detok;  // ids -> text, a window at a time
  bool done = false;
  std::string finish_reason;
  Status error;
  rpc::Usage usage;
  tenants::Lease sequence;           // the tenant's concurrent-sequence quota, held until Finalize
  tenants::TokenReservation tokens;  // its generated tokens, reserved at admission; settled by Finalize
  // To resume it on another worker when its worker is lost: what was sent,
  // its documents and policy, the tokens it had made before the current
  // worker's (base), and how often it moved.
  rpc::WorkerGenerateRequest gen;
  std::vector<DocumentView> docs;
  std::string kv_policy;
  int64_t base = 0;
  int resumes = 0;
  bool by_digest = false;  // its worker got its documents by digest alone (may answer that it lacks one)
  bool job_item = false;
  bool recovered = false;  // taken over from the journal at a restart
  int64_t created_unix_ms = 0;
  internal::Clock::time_point last_poll;  // a client's latest Poll (abandon_timeout)
  // Where it runs, readable without mu (a drain cancels generations whose
  // mu a waiting Complete holds).
  std::mutex where_mu;
  int where_worker = -1;
  std::string where_wid;
  void SetWhere(int w, const std::string& h) {
    std::lock_guard<std::mutex> lk(where_mu);
    worker = where_worker = w;
    wid = where_wid = h;
  }
};

}  // namespace penumbra::coordinator
