// The public API's request validation (transport/penumbra.thrift): pure
// functions of a request, the coordinator's limits (RequestLimits, part of
// CoordinatorOptions) and what the workers report about the model
// (ModelLimits). Generate, Complete and every item of SubmitJob go through
// ValidateGenerateRequest; the other calls through the functions below.
// None of them touches the service, so they are fuzzed without one
// (coordinator/server/fuzz/public_api_fuzz.cc).
//
// Every refusal is InvalidArgument naming the field and the limit. The checks
// run in an order that keeps each one's work bounded by a limit already
// checked: a list's length before its elements, a string's size before its
// contents; nothing proportional to an unchecked input is allocated. Values
// the caller sent are echoed only once their size is known to be small.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "gen-cpp/penumbra_types.h"

namespace penumbra::coordinator {

// Bounds on what one call may ask. Every field is checked by Validate().
struct RequestLimits {
  // Documents one generation may follow (document_ids), each at most once. Default: 64.
  int max_document_ids = 64;
  // Bytes of one document's or question's text. Default: 32 MiB.
  int64_t max_text_bytes = 32 << 20;
  // A generation's max_new_tokens, in [1, this] (and within the model's context). Default: 1 << 20.
  int max_new_tokens = 1 << 20;
  // Stop strings of one generation. Default: 16.
  int max_stop_strings = 16;
  // Bytes of one stop string. Default: 256.
  int max_stop_string_bytes = 256;
  // stop_ids of one generation, each in the vocabulary; at most kMaxStopIdsLimit (the worker takes 1024, the
  // model's end-of-text ids included). Default: 1000.
  int max_stop_ids = 1000;
  // deadline_ms of any call, in [0, this]. Default: 7 days.
  int64_t max_deadline_ms = int64_t{7} * 24 * 3600 * 1000;
  // Poll's wait_ms, in [0, this]. Default: 60000.
  int32_t max_wait_ms = 60000;
  // page_size of ListDocuments, ListJobs and GetJobResults, in [1, this]. Default: 1000.
  int32_t max_page_size = 1000;
  // Bytes of a document's name (at least 1). Default: 256.
  int max_name_bytes = 256;
  // Bytes of an id or page token a caller sends (document, request, job ids; page tokens; after_custom_id).
  // Default: 256.
  int max_id_bytes = 256;
  // Bytes of a job's metadata. Default: 16 KiB.
  int64_t max_job_metadata_bytes = 16 << 10;
  // Items of one job, in [1, this]. Default: 50000.
  int64_t max_job_items = 50000;
  // Bytes of a job item's custom_id (at least 1). Default: 256.
  int max_custom_id_bytes = 256;
  // A job's completion_window_s, in [0, this] (0: the store's default). Default: 7 days.
  int64_t max_completion_window_s = int64_t{7} * 24 * 3600;

  // The most max_stop_ids may be: the worker's 1024 less room for end-of-text ids.
  static constexpr int kMaxStopIdsLimit = 1000;
  // InvalidArgument naming the field when one is out of its range.
  Status Validate() const;
};

// What the coordinator knows about the model the workers serve (from their
// health reports); 0 where no worker has reported yet (those checks are then
// left to the worker).
struct ModelLimits {
  int32_t vocab_size = 0;   // token ids are in [0, vocab_size)
  int64_t max_context = 0;  // prompt + max_new_tokens at most this
  bool can_encode = false;  // text can be tokenized here (a tokenizer.json)
  bool can_decode = false;  // answers can be decoded here (stop strings apply to the text)
};

// A generation's request before its documents are looked up: document_ids
// (count, size, duplicates), the question (exactly one of text and
// token_ids; text size; token ids' count against the context, then each in
// the vocabulary), max_new_tokens, stop strings, stop_ids (count, then
// vocabulary), kv_policy, deadline_ms and the sampling options. api_key is
// not looked at (authentication is separate).
Status ValidateGenerateRequest(const rpc::GenerateRequest& r, const RequestLimits& limits, const ModelLimits& model);

// The whole prompt fits: `prompt_tokens` (the documents' tokens as they will
// be concatenated, plus the question's) and max_new_tokens within the
// context. Called with counts, before anything is concatenated.
Status ValidatePromptLength(int64_t prompt_tokens, int32_t max_new_tokens, const ModelLimits& model);

// Tokens a generation of `prompt_tokens` may produce: max_new_tokens, capped
// by the context left after the prompt (when the context is known); what is
// reserved from the tenant's generated-tokens quota before it runs.
int64_t GeneratedTokensBound(int64_t prompt_tokens, int32_t max_new_tokens, const ModelLimits& model);

// A put: name, deadline_ms, exactly one of text and token_ids (text size;
// ids' count below the context, then each in the vocabulary).
Status ValidatePutDocumentRequest(const rpc::PutDocumentRequest& r, const RequestLimits& limits,
                                  const ModelLimits& model);

// A job: item count, metadata size, completion_window_s, deadline_ms, and
// each item's custom_id (size, unique in the job) and request (as
// ValidateGenerateRequest, its deadline_ms aside: the job's window applies).
// Errors of an item name it: "items[3] (custom_id 'q3'): ...".
Status ValidateSubmitJobRequest(const rpc::SubmitJobRequest& r, const RequestLimits& limits, const ModelLimits& model);

// An id or page token (`field` names it): at most max_id_bytes.
Status ValidateId(std::string_view field, const std::string& id, const RequestLimits& limits);
// `field` (a deadline_ms) in [0, max_deadline_ms].
Status ValidateDeadline(std::string_view field, int64_t deadline_ms, const RequestLimits& limits);
Status ValidateWaitMs(int32_t wait_ms, const RequestLimits& limits);
Status ValidatePageSize(int32_t page_size, const RequestLimits& limits);

// At most `max` bytes of `s` for an error message, marked when cut.
std::string Excerpt(std::string_view s, size_t max = 64);

}  // namespace penumbra::coordinator
