// Types shared by Penumbra's Thrift APIs: the public API (penumbra.thrift,
// clients -> coordinator) and the control API (worker.thrift, coordinator ->
// worker). Framed binary protocol on every port; sizes bounded by the
// server's configuration (transport/thrift_util.h).
namespace cpp penumbra.rpc
namespace py penumbra.rpc.common

// Typed errors. Every call that can fail throws PenumbraError; its code says
// what the client should do: fix the request (INVALID_ARGUMENT, NOT_FOUND,
// PERMISSION_DENIED, FAILED_PRECONDITION), retry later (RESOURCE_EXHAUSTED,
// with retry_after_ms; UNAVAILABLE), or give up (DEADLINE_EXCEEDED,
// CANCELLED, INTERNAL).
enum ErrorCode {
  INVALID_ARGUMENT = 1,
  NOT_FOUND = 2,
  PERMISSION_DENIED = 3,
  RESOURCE_EXHAUSTED = 4,
  UNAVAILABLE = 5,
  DEADLINE_EXCEEDED = 6,
  FAILED_PRECONDITION = 7,
  CANCELLED = 8,
  INTERNAL = 9,
}

exception PenumbraError {
  1: ErrorCode code,
  2: string message,
  3: optional i32 retry_after_ms,
}

struct SamplingOptions {
  1: double temperature = 0.0,  // [0, 100]; 0: greedy
  2: i32 top_k = 0,             // >= 0; 0: off
  3: double top_p = 1.0,        // (0, 1]
  4: i64 seed = 0,              // >= 0; seeds this request's draws
}

// Usage, on every answer.
struct Usage {
  1: i64 prompt_tokens,
  2: i64 cached_prompt_tokens,  // of them, attached from the document cache
  3: i64 generated_tokens,
  4: double queue_seconds,      // submitted -> admitted; < 0 until admitted
  5: double ttft_seconds,       // submitted -> first token; < 0 until then
  6: i64 prefilled_tokens,      // prompt tokens in the sequence so far (attached or prefilled)
}

// Tokens from an offset, as they are made (long polling).
struct TokenChunk {
  1: list<i32> ids,             // generated ids from `offset`
  2: i64 offset,
  3: bool done,
  4: string finish_reason,      // once done: stop, length, cancelled, deadline, error
  5: optional ErrorCode error_code,   // for error and deadline
  6: optional string error_message,
  7: Usage usage,
}
