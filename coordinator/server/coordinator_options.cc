#include "coordinator/server/coordinator_options.h"

namespace penumbra::coordinator {

const OptionTable<CoordinatorProcessOptions>& CoordinatorOptionTable() {
  using O = CoordinatorProcessOptions;
  using T = OptionTable<O>;
  using std::chrono::milliseconds;
  constexpr int64_t kYearSeconds = int64_t{365} * 86400;
  // A streaming generation is abandoned at most as late as an ended one is kept.
  const int64_t keep_finished_s = CoordinatorOptions{}.keep_finished.count() / 1000;
  static const auto* table =
      &(*new T("coordinator"))
           .String(&O::model, "model", "", "DIR", "the workers' model directory (its tokenizer tokenizes requests)")
           .Unset("", "none (required)")
           .String(&O::workers, "workers", "", "[NAME=]HOST:PORT,...", "the workers' control API")
           .Unset("", "none (required unless --groups)")
           .String(&O::groups, "groups", "", "NAME=[NAME=]HOST:PORT,...;NAME=...",
                   "context groups: each group's ranks (penumbra-worker --group NAME --group-rank R), in rank "
                   "order; the coordinator forms each group and places long documents and prompts on it")
           .Unset("", "none")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.group_min_tokens; }), "group-min-tokens", "",
                int64_t{0}, int64_t{1} << 40,
                "placement: prompts (documents and question) of this many tokens or more go to a context group "
                "first (0: only those that fit no single worker's free memory)")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->pool.group_form_timeout; }), "group-form-timeout-ms",
                     "", 100, 3600000, "a group's formation still under way after this is started again")
           .String(&O::host, "host", "", "HOST",
                   "address of the public API (any but loopback needs TLS and tenants, or --insecure)")
           .Int(&O::port, "port", "", 0, 65535, "public API port (0: one the OS picks)")
           .String(&O::port_file, "port-file", "", "FILE",
                   "write {\"port\": P, \"metrics_port\": M, \"openai_port\": O, \"pid\": N} here once serving")
           .Unset("", "none")
           .String(&O::tenants, "tenants", "", "FILE",
                   "tenants YAML (configs/tenants.yaml: hashed API keys, quotas); reread on SIGHUP")
           .Unset("", "none")
           .String(&O::api_keys, "api-keys", "", "FILE",
                   "YAML file `keys: {KEY: TENANT, ...}` in plain text (keys of 16+ bytes), no quotas: for "
                   "development only")
           .Unset("", "none: every caller is tenant \"default\"")
           .IntVia([](const O& o) { return int64_t{o.limits.max_frame_bytes >> 20}; },
                   [](O* o, int64_t v) { o->limits.max_frame_bytes = static_cast<int32_t>(v << 20); }, "max-frame-mb",
                   "", 1, 1024, "largest request frame in MiB")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.max_running_requests; }), "max-running", "",
                int64_t{1}, int64_t{1} << 24, "generations running at once, all tenants")
           .MiB(T::Field<int64_t>([](O* o) { return &o->coordinator.min_free_memory_bytes; }), "min-free-memory-mb", "",
                0, int64_t{1} << 30, "placement: workers reporting less free device memory are tried after the others")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.max_documents_per_tenant; }), "max-documents", "",
                int64_t{1}, int64_t{1} << 32, "documents per tenant")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->pool.health_interval; }), "health-interval-ms", "",
                     10, 600000, "how often each worker is checked")
           .Int(&O::drain_seconds, "drain-seconds", "", 0, 86400, "on SIGTERM, how long running generations may finish")
           .String(&O::data_dir, "data-dir", "", "DIR",
                   "directory for what survives a restart: documents and batch jobs")
           .Unset("", "none: documents in memory, jobs off")
           .Int(T::Field<int>([](O* o) { return &o->jobs.max_running_items; }), "job-concurrency", "", 1, 4096,
                "job items generating at once, all jobs")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->coordinator.abandon_timeout; }), "abandon-timeout-s",
                     "", 1, keep_finished_s, "a streaming generation no client polls for this long is cancelled",
                     std::chrono::seconds{})
           .Int(T::Field<int32_t>([](O* o) { return &o->limits.max_connections; }), "max-connections", "", 1, 1 << 20,
                "open connections of the public API")
           .Int(T::Field<int32_t>([](O* o) { return &o->limits.max_connections_per_peer; }), "max-connections-per-peer",
                "", 1, 1 << 20, "open connections of the public API from one address")
           // Request limits (validation.h RequestLimits): past one a call is
           // INVALID_ARGUMENT naming it.
           .Int(T::Field<int>([](O* o) { return &o->coordinator.limits.max_document_ids; }), "max-document-ids", "", 1,
                4096, "documents one generation may follow")
           .Int(T::Field<int>([](O* o) { return &o->coordinator.limits.max_new_tokens; }), "max-new-tokens", "", 1,
                1 << 30, "a generation's max_new_tokens at most")
           .Int(T::Field<int>([](O* o) { return &o->coordinator.limits.max_stop_ids; }), "max-stop-ids", "", 0,
                RequestLimits::kMaxStopIdsLimit, "stop_ids of one generation")
           .Int(T::Field<int>([](O* o) { return &o->coordinator.limits.max_stop_strings; }), "max-stop-strings", "", 0,
                1024, "stop strings of one generation")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.limits.max_text_bytes; }), "max-text-bytes", "",
                int64_t{1}, int64_t{1} << 31, "bytes of one document's or question's text")
           .IntVia([](const O& o) { return o.coordinator.limits.max_deadline_ms / 1000; },
                   [](O* o, int64_t v) { o->coordinator.limits.max_deadline_ms = v * 1000; }, "max-deadline-s", "", 1,
                   kYearSeconds, "deadline_ms of any call at most this, in seconds")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.limits.max_job_items; }), "max-job-items", "",
                int64_t{1}, int64_t{1} << 24, "items of one batch job")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.limits.max_job_metadata_bytes; }),
                "max-job-metadata-bytes", "", int64_t{0}, int64_t{1} << 26, "bytes of a batch job's metadata")
           .Int(T::Field<int64_t>([](O* o) { return &o->coordinator.limits.max_completion_window_s; }),
                "max-completion-window-s", "", int64_t{1}, kYearSeconds, "a batch job's completion window at most")
           .Int(T::Field<int>([](O* o) { return &o->coordinator.max_background_puts_per_tenant; }),
                "max-background-puts", "", 1, 4096,
                "documents one tenant may have factoring in the background (wait = false) at once")
           // The OpenAI-compatible HTTP API (openai_gateway.h).
           .Int(&O::openai_port, "openai-port", "", -1, 65535,
                "port of the OpenAI-compatible HTTP API (-1: off; 0: one the OS picks); TLS as the public API's")
           .String(&O::openai_host, "openai-host", "", "HOST", "address of the OpenAI-compatible API")
           .Unset("", "the public API's (--host)")
           .String(T::Field<std::string>([](O* o) { return &o->openai.chat_template_file; }), "chat-template", "",
                   "FILE",
                   "the chat template (Jinja) of /v1/chat/completions instead of the model's own (a model "
                   "whose tokenizer_config.json has none needs one for chat)")
           .Unset("", "the model's own")
           .Int(T::Field<int>([](O* o) { return &o->openai.http.threads; }), "openai-threads", "", 1, 65536,
                "connections the OpenAI API serves at once (a stream holds one)")
           .IntVia([](const O& o) { return o.openai.http.max_body_bytes >> 20; },
                   [](O* o, int64_t v) { o->openai.http.max_body_bytes = v << 20; }, "openai-max-body-mb", "", 1, 4096,
                   "largest request body of the OpenAI API in MiB (larger: 413)");
  return *table;
}

}  // namespace penumbra::coordinator
