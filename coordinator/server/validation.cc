#include "coordinator/server/validation.h"

#include <algorithm>
#include <cstdio>
#include <unordered_set>
#include <vector>

#include "common/kv_policies.h"

namespace penumbra::coordinator {
namespace {

std::string Str(std::string_view s) { return std::string(s); }

Status Bad(const std::string& message) { return Status::InvalidArgument(message); }

// "FIELD must be in [lo, hi], got v".
Status OutOfRange(std::string_view field, int64_t lo, int64_t hi, int64_t v) {
  return Bad(Str(field) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
             std::to_string(v));
}

std::string Double(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Every id in [0, vocab) (when the vocabulary is known). `what` names the list.
Status CheckVocabulary(std::string_view what, const std::vector<int32_t>& ids, const ModelLimits& model) {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || (model.vocab_size > 0 && id >= model.vocab_size)) {
      return Bad(Str(what) + ": token id " + std::to_string(id) + " at position " + std::to_string(i) +
                 " is outside the vocabulary [0, " +
                 (model.vocab_size > 0 ? std::to_string(model.vocab_size) : std::string("...")) + ")");
    }
  }
  return Status::OK();
}

// Exactly one of text and token ids, the text within max_text_bytes and
// encodable, the ids (at most `max_ids` when > 0) in the vocabulary.
Status CheckTextOrIds(std::string_view what, bool has_text, const std::string& text, bool has_ids,
                      const std::vector<int32_t>& ids, int64_t max_ids, std::string_view max_ids_reason,
                      const RequestLimits& limits, const ModelLimits& model) {
  if (has_text == has_ids) return Bad(Str(what) + ": give exactly one of text and token_ids");
  if (has_text) {
    if (text.empty()) return Bad(Str(what) + ": the text is empty");
    if (static_cast<int64_t>(text.size()) > limits.max_text_bytes) {
      return Bad(Str(what) + ": text of " + std::to_string(text.size()) + " bytes is over the limit of " +
                 std::to_string(limits.max_text_bytes) + " (max_text_bytes)");
    }
    if (!model.can_encode) {
      return Bad(Str(what) + ": the coordinator has no tokenizer for this model (no tokenizer.json); send token_ids");
    }
    return Status::OK();
  }
  if (ids.empty()) return Bad(Str(what) + ": token_ids is empty");
  if (max_ids > 0 && static_cast<int64_t>(ids.size()) > max_ids) {
    return Bad(Str(what) + ": " + std::to_string(ids.size()) + " token ids, at most " + std::to_string(max_ids) + " (" +
               Str(max_ids_reason) + ")");
  }
  return CheckVocabulary(Str(what) + " token_ids", ids, model);
}

// "" or a policy's name (a request's or a document's pin, common/kv_policies.h).
Status CheckKvPolicy(const std::string& kv_policy) {
  if (kv_policy.empty() || IsKvPolicyPin(kv_policy)) return Status::OK();
  return Bad("kv_policy must be \"\", " + std::string(KvPolicyPins()) + ", got \"" + Excerpt(kv_policy, 32) + "\"");
}

Status CheckSampling(const rpc::SamplingOptions& sp) {
  // The ranges of common.thrift; written so that NaN fails.
  if (!(sp.temperature >= 0 && sp.temperature <= 100)) {
    return Bad("sampling.temperature must be in [0, 100], got " + Double(sp.temperature));
  }
  if (!(sp.top_p > 0 && sp.top_p <= 1)) return Bad("sampling.top_p must be in (0, 1], got " + Double(sp.top_p));
  if (sp.top_k < 0) return Bad("sampling.top_k must be >= 0, got " + std::to_string(sp.top_k));
  if (sp.seed < 0) return Bad("sampling.seed must be >= 0, got " + std::to_string(sp.seed));
  return Status::OK();
}

// A generation's checks, deadline aside (job items have none of their own).
Status CheckGenerate(const rpc::GenerateRequest& r, const RequestLimits& limits, const ModelLimits& model) {
  const auto& ids = r.document_ids;
  if (static_cast<int64_t>(ids.size()) > limits.max_document_ids) {
    return Bad("document_ids: " + std::to_string(ids.size()) + " documents, at most " +
               std::to_string(limits.max_document_ids) + " (max_document_ids)");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    PENUMBRA_RETURN_IF_ERROR(ValidateId("document_ids[" + std::to_string(i) + "]", ids[i], limits));
  }
  // At most max_document_ids short strings: quadratic is bounded and allocates nothing.
  for (size_t i = 0; i < ids.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (ids[i] == ids[j]) {
        return Bad("document_ids[" + std::to_string(i) + "]: '" + ids[i] + "' is also document_ids[" +
                   std::to_string(j) + "]; each document may be given once");
      }
    }
  }
  // The question alone must leave room for the documents' tokens and one generated token.
  const int64_t max_question_ids = model.max_context > 0 ? model.max_context - 1 : 0;
  PENUMBRA_RETURN_IF_ERROR(CheckTextOrIds("question", r.__isset.text, r.text, r.__isset.token_ids, r.token_ids,
                                          max_question_ids, "the model's context less one generated token", limits,
                                          model));
  if (r.max_new_tokens < 1 || r.max_new_tokens > limits.max_new_tokens) {
    return Bad("max_new_tokens must be in [1, " + std::to_string(limits.max_new_tokens) + "] (max_new_tokens), got " +
               std::to_string(r.max_new_tokens));
  }
  if (model.max_context > 0 && !r.fit_context && r.max_new_tokens >= model.max_context) {
    return Bad("max_new_tokens " + std::to_string(r.max_new_tokens) + " leaves no room for a prompt in the model's " +
               std::to_string(model.max_context) + "-token context");
  }
  if (static_cast<int64_t>(r.stop.size()) > limits.max_stop_strings) {
    return Bad("stop: " + std::to_string(r.stop.size()) + " stop strings, at most " +
               std::to_string(limits.max_stop_strings) + " (max_stop_strings)");
  }
  for (size_t i = 0; i < r.stop.size(); ++i) {
    const std::string& s = r.stop[i];
    if (s.empty() || static_cast<int64_t>(s.size()) > limits.max_stop_string_bytes) {
      return Bad("stop[" + std::to_string(i) + "] must be 1 to " + std::to_string(limits.max_stop_string_bytes) +
                 " bytes (max_stop_string_bytes), got " + std::to_string(s.size()));
    }
  }
  if (!r.stop.empty() && !model.can_decode) {
    return Bad("stop strings need the model's tokenizer, which the coordinator does not have; use stop_ids");
  }
  if (static_cast<int64_t>(r.stop_ids.size()) > limits.max_stop_ids) {
    return Bad("stop_ids: " + std::to_string(r.stop_ids.size()) + " ids, at most " +
               std::to_string(limits.max_stop_ids) + " (max_stop_ids)");
  }
  PENUMBRA_RETURN_IF_ERROR(CheckVocabulary("stop_ids", r.stop_ids, model));
  PENUMBRA_RETURN_IF_ERROR(CheckKvPolicy(r.kv_policy));
  return CheckSampling(r.sampling);
}

}  // namespace

std::string Excerpt(std::string_view s, size_t max) {
  if (s.size() <= max) return Str(s);
  return Str(s.substr(0, max)) + "...";
}

Status RequestLimits::Validate() const {
  auto at_least = [](const char* name, int64_t v, int64_t lo) -> Status {
    if (v >= lo) return Status::OK();
    return Status::InvalidArgument(std::string(name) + " must be >= " + std::to_string(lo) + ", got " +
                                   std::to_string(v));
  };
  PENUMBRA_RETURN_IF_ERROR(at_least("max_document_ids", max_document_ids, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_text_bytes", max_text_bytes, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_new_tokens", max_new_tokens, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_stop_strings", max_stop_strings, 0));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_stop_string_bytes", max_stop_string_bytes, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_stop_ids", max_stop_ids, 0));
  if (max_stop_ids > kMaxStopIdsLimit) {
    return OutOfRange("max_stop_ids", 0, kMaxStopIdsLimit, max_stop_ids);
  }
  PENUMBRA_RETURN_IF_ERROR(at_least("max_deadline_ms", max_deadline_ms, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_wait_ms", max_wait_ms, 0));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_page_size", max_page_size, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_name_bytes", max_name_bytes, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_id_bytes", max_id_bytes, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_job_metadata_bytes", max_job_metadata_bytes, 0));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_job_items", max_job_items, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_custom_id_bytes", max_custom_id_bytes, 1));
  PENUMBRA_RETURN_IF_ERROR(at_least("max_completion_window_s", max_completion_window_s, 1));
  return Status::OK();
}

Status ValidateId(std::string_view field, const std::string& id, const RequestLimits& limits) {
  if (static_cast<int64_t>(id.size()) > limits.max_id_bytes) {
    return Bad(Str(field) + ": " + std::to_string(id.size()) + " bytes, at most " +
               std::to_string(limits.max_id_bytes) + " (max_id_bytes)");
  }
  return Status::OK();
}

Status ValidateDeadline(std::string_view field, int64_t deadline_ms, const RequestLimits& limits) {
  if (deadline_ms < 0 || deadline_ms > limits.max_deadline_ms) {
    return Bad(Str(field) + " must be in [0, " + std::to_string(limits.max_deadline_ms) +
               "] (max_deadline_ms; 0: the server's default), got " + std::to_string(deadline_ms));
  }
  return Status::OK();
}

Status ValidateWaitMs(int32_t wait_ms, const RequestLimits& limits) {
  if (wait_ms < 0 || wait_ms > limits.max_wait_ms) return OutOfRange("wait_ms", 0, limits.max_wait_ms, wait_ms);
  return Status::OK();
}

Status ValidatePageSize(int32_t page_size, const RequestLimits& limits) {
  if (page_size < 1 || page_size > limits.max_page_size) {
    return OutOfRange("page_size", 1, limits.max_page_size, page_size);
  }
  return Status::OK();
}

Status ValidateGenerateRequest(const rpc::GenerateRequest& r, const RequestLimits& limits, const ModelLimits& model) {
  PENUMBRA_RETURN_IF_ERROR(CheckGenerate(r, limits, model));
  return ValidateDeadline("deadline_ms", r.deadline_ms, limits);
}

Status ValidatePromptLength(int64_t prompt_tokens, int32_t max_new_tokens, const ModelLimits& model) {
  if (prompt_tokens < 1) return Bad("the prompt is empty");
  if (model.max_context > 0 && prompt_tokens + max_new_tokens > model.max_context) {
    return Bad("the prompt (" + std::to_string(prompt_tokens) +
               " tokens: the documents and the question) + "
               "max_new_tokens (" +
               std::to_string(max_new_tokens) + ") exceeds the model's " + std::to_string(model.max_context) +
               "-token context");
  }
  return Status::OK();
}

int64_t GeneratedTokensBound(int64_t prompt_tokens, int32_t max_new_tokens, const ModelLimits& model) {
  int64_t n = std::max<int64_t>(0, max_new_tokens);
  if (model.max_context > 0) n = std::min(n, std::max<int64_t>(0, model.max_context - prompt_tokens));
  return n;
}

Status ValidatePutDocumentRequest(const rpc::PutDocumentRequest& r, const RequestLimits& limits,
                                  const ModelLimits& model) {
  PENUMBRA_RETURN_IF_ERROR(CheckKvPolicy(r.kv_policy));
  if (r.name.empty() || static_cast<int64_t>(r.name.size()) > limits.max_name_bytes) {
    return Bad("name must be 1 to " + std::to_string(limits.max_name_bytes) + " bytes (max_name_bytes), got " +
               std::to_string(r.name.size()));
  }
  PENUMBRA_RETURN_IF_ERROR(ValidateDeadline("deadline_ms", r.deadline_ms, limits));
  // A document must leave room for a question in the context.
  const int64_t max_ids = model.max_context > 0 ? model.max_context - 1 : 0;
  return CheckTextOrIds("document", r.__isset.text, r.text, r.__isset.token_ids, r.token_ids, max_ids,
                        "the model's context less room for a question", limits, model);
}

Status ValidateSubmitJobRequest(const rpc::SubmitJobRequest& r, const RequestLimits& limits, const ModelLimits& model) {
  if (r.items.empty() || static_cast<int64_t>(r.items.size()) > limits.max_job_items) {
    return Bad("items: a job has 1 to " + std::to_string(limits.max_job_items) + " items (max_job_items), got " +
               std::to_string(r.items.size()));
  }
  if (static_cast<int64_t>(r.metadata.size()) > limits.max_job_metadata_bytes) {
    return Bad("metadata: " + std::to_string(r.metadata.size()) + " bytes, at most " +
               std::to_string(limits.max_job_metadata_bytes) + " (max_job_metadata_bytes)");
  }
  if (r.completion_window_s < 0 || r.completion_window_s > limits.max_completion_window_s) {
    return Bad("completion_window_s must be in [0, " + std::to_string(limits.max_completion_window_s) +
               "] (max_completion_window_s; 0: the default), got " + std::to_string(r.completion_window_s));
  }
  PENUMBRA_RETURN_IF_ERROR(ValidateDeadline("deadline_ms", r.deadline_ms, limits));
  // custom_ids are checked for size before any is copied into the set.
  std::unordered_set<std::string_view> seen;
  seen.reserve(r.items.size());
  for (size_t i = 0; i < r.items.size(); ++i) {
    const rpc::JobItem& it = r.items[i];
    const std::string at = "items[" + std::to_string(i) + "]";
    if (it.custom_id.empty() || static_cast<int64_t>(it.custom_id.size()) > limits.max_custom_id_bytes) {
      return Bad(at + ": custom_id must be 1 to " + std::to_string(limits.max_custom_id_bytes) +
                 " bytes (max_custom_id_bytes), got " + std::to_string(it.custom_id.size()));
    }
    const std::string named = at + " (custom_id '" + it.custom_id + "')";
    if (!seen.insert(it.custom_id).second) return Bad(named + ": custom_id is not unique in the job");
    Status s = CheckGenerate(it.request, limits, model);
    if (!s.ok()) return Status(s.code(), named + ": " + s.message());
  }
  return Status::OK();
}

}  // namespace penumbra::coordinator
