#include "coordinator/client/client.h"

#include <cctype>
#include <cstdlib>
#include <optional>
#include <thread>

#include "common/file.h"

namespace penumbra::client {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kPollMargin{10000};
constexpr int32_t kStreamWaitMs = 1000;

}  // namespace

Status ParseAddress(const std::string& address, ClientOptions* options) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 >= address.size()) {
    return Status::InvalidArgument("address '" + address + "' is not host:port");
  }
  const std::string port = address.substr(colon + 1);
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) < 1 ||
      std::stoi(port) > 65535) {
    return Status::InvalidArgument("address '" + address + "': port must be in [1, 65535]");
  }
  options->host = address.substr(0, colon);
  options->port = std::stoi(port);
  return Status::OK();
}

void AddConnectionFlags(Args& a) {
  a.Flag("address", "the coordinator, host:port (default $PENUMBRA_ADDRESS, else 127.0.0.1:7700)")
      .Flag("api-key-file",
            "a file holding the API key (default $PENUMBRA_API_KEY_FILE; else the key in "
            "$PENUMBRA_API_KEY). Never on the command line: other users can read it there")
      .Flag("tls-ca", "the CA of the coordinator's certificate: TLS on (default $PENUMBRA_TLS_CA)")
      .Flag("tls-cert", "a client certificate, for a tenant that requires one (default $PENUMBRA_TLS_CERT)")
      .Flag("tls-key", "its private key (default $PENUMBRA_TLS_KEY)")
      .Flag("timeout-ms", "connect and call timeout (default 30000)")
      .Flag("reconnect-ms",
            "streaming: how long a stream whose connection fails keeps reconnecting and polling "
            "again at its offset (default 30000; 0: fail at once)");
}

namespace {

std::string FlagOrEnv(const Args& a, const std::string& flag, const char* env) {
  const char* e = std::getenv(env);
  return a.Get(flag, e ? e : "");
}

}  // namespace

Result<ClientOptions> OptionsFromFlags(const Args& a) {
  ClientOptions o;
  const char* env_addr = std::getenv("PENUMBRA_ADDRESS");
  PENUMBRA_RETURN_IF_ERROR(ParseAddress(a.Get("address", env_addr ? env_addr : "127.0.0.1:7700"), &o));
  if (const std::string key_file = FlagOrEnv(a, "api-key-file", "PENUMBRA_API_KEY_FILE"); !key_file.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(std::string key, ReadFileToString(key_file));
    while (!key.empty() && std::isspace(static_cast<unsigned char>(key.back()))) key.pop_back();
    if (key.empty()) return Status::InvalidArgument("--api-key-file " + key_file + " is empty");
    o.api_key = key;
  } else if (const char* env_key = std::getenv("PENUMBRA_API_KEY")) {
    o.api_key = env_key;
  }
  o.tls_ca = FlagOrEnv(a, "tls-ca", "PENUMBRA_TLS_CA");
  o.tls_cert = FlagOrEnv(a, "tls-cert", "PENUMBRA_TLS_CERT");
  o.tls_key = FlagOrEnv(a, "tls-key", "PENUMBRA_TLS_KEY");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t t, a.GetIntIn("timeout-ms", 30000, 1, 3600000));
  o.timeout = milliseconds(t);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t r, a.GetIntIn("reconnect-ms", o.reconnect_window.count(), 0, 3600000));
  o.reconnect_window = milliseconds(r);
  return o;
}

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto c = std::unique_ptr<Client>(new Client(options));
  if (!options.tls_ca.empty() || !options.tls_cert.empty() || !options.tls_key.empty()) {
    if (options.tls_ca.empty()) return Status::InvalidArgument("TLS: a client certificate needs the CA (tls_ca) too");
    transport::TlsClientOptions t;
    t.files.ca_file = options.tls_ca;
    t.files.cert_file = options.tls_cert;
    t.files.key_file = options.tls_key;
    t.server_roles = {transport::role::kCoordinator};
    PENUMBRA_ASSIGN_OR_RETURN(c->tls_, transport::TlsClientContext::Create(t));
  }
  PENUMBRA_RETURN_IF_ERROR(c->Reconnect());
  return c;
}

void Client::SetTimeout(milliseconds t) {
  if (!c_) (void)Reconnect();
  if (c_) c_->SetTimeout(t);
}

Status Client::Reconnect() {
  c_.reset();
  PENUMBRA_ASSIGN_OR_RETURN(
      c_, transport::ThriftClient<rpc::PenumbraClient>::Connect(o_.host, o_.port, o_.timeout, {}, tls_));
  return Status::OK();
}

Status Client::Call(const std::string& what, const std::function<void()>& call) {
  if (!c_) PENUMBRA_RETURN_IF_ERROR(Reconnect());
  try {
    call();
    return Status::OK();
  } catch (const rpc::PenumbraError& e) {
    return transport::FromRpcError(e);
  } catch (const std::exception& e) {
    c_.reset();  // a reply may still be on its way: the next call reconnects
    return transport::FromThriftException(e, what);
  }
}

Result<rpc::DocumentInfo> Client::PutDocument(const std::string& name, const std::string* text,
                                              const std::vector<int32_t>* ids, bool wait, milliseconds deadline,
                                              const std::function<void(const rpc::DocumentInfo&)>& progress,
                                              const std::string& kv_policy) {
  rpc::PutDocumentRequest r;
  r.api_key = o_.api_key;
  r.name = name;
  r.kv_policy = kv_policy;
  if (text) r.__set_text(*text);
  if (ids) r.__set_token_ids(*ids);
  r.deadline_ms = deadline.count();
  // With a progress callback the put returns at once and is watched here.
  r.wait = wait && !progress;
  rpc::DocumentInfo info;
  SetTimeout(r.wait ? (deadline.count() > 0 ? deadline : milliseconds(std::chrono::hours(1))) + kPollMargin
                    : o_.timeout);
  PENUMBRA_RETURN_IF_ERROR(Call("put document", [&] { (*c_)->PutDocument(info, r); }));
  SetTimeout(o_.timeout);
  if (!wait || r.wait) return info;
  while (info.state == rpc::DocumentState::FACTORING) {
    progress(info);
    std::this_thread::sleep_for(milliseconds(500));
    PENUMBRA_ASSIGN_OR_RETURN(info, GetDocument(info.id));
  }
  progress(info);
  return info;
}

Result<rpc::DocumentInfo> Client::GetDocument(const std::string& id) {
  rpc::DocumentInfo info;
  PENUMBRA_RETURN_IF_ERROR(Call("get document", [&] { (*c_)->GetDocument(info, o_.api_key, id, 0); }));
  return info;
}

Result<std::vector<rpc::DocumentInfo>> Client::ListDocuments(int page_size) {
  std::vector<rpc::DocumentInfo> all;
  rpc::ListDocumentsRequest r;
  r.api_key = o_.api_key;
  r.page_size = page_size;
  for (;;) {
    rpc::DocumentList page;
    PENUMBRA_RETURN_IF_ERROR(Call("list documents", [&] { (*c_)->ListDocuments(page, r); }));
    all.insert(all.end(), page.documents.begin(), page.documents.end());
    if (page.next_page_token.empty()) return all;
    r.page_token = page.next_page_token;
  }
}

Status Client::DeleteDocument(const std::string& id) {
  return Call("delete document", [&] { (*c_)->DeleteDocument(o_.api_key, id, 0); });
}

Result<std::string> Client::Generate(rpc::GenerateRequest request) {
  request.api_key = o_.api_key;
  std::string id;
  PENUMBRA_RETURN_IF_ERROR(Call("generate", [&] { (*c_)->Generate(id, request); }));
  return id;
}

Result<rpc::GenerateChunk> Client::Poll(const std::string& request_id, int64_t offset, int32_t wait_ms) {
  rpc::GenerateChunk chunk;
  SetTimeout(milliseconds(wait_ms) + kPollMargin);
  Status s = Call("poll", [&] { (*c_)->Poll(chunk, o_.api_key, request_id, offset, wait_ms); });
  SetTimeout(o_.timeout);
  PENUMBRA_RETURN_IF_ERROR(s);
  return chunk;
}

Result<rpc::GenerateChunk> Client::Stream(rpc::GenerateRequest request,
                                          const std::function<void(const std::string& delta)>& on_text) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string id, Generate(request));
  size_t shown = 0;
  return Follow(id, 0, [&](const rpc::GenerateChunk& c) {
    // The text so far is re-decoded each time: only its new end is shown
    // (a stop string can cut what was not shown yet, never what was).
    if (c.text.size() > shown && on_text) on_text(c.text.substr(shown));
    shown = std::max(shown, c.text.size());
  });
}

Result<rpc::GenerateChunk> Client::Follow(const std::string& request_id, int64_t offset,
                                          const std::function<void(const rpc::GenerateChunk&)>& on_chunk) {
  std::optional<std::chrono::steady_clock::time_point> failing_since;
  for (;;) {
    Result<rpc::GenerateChunk> c = Poll(request_id, offset, kStreamWaitMs);
    if (!c.ok()) {
      // Only the transport's failures are retried (Call dropped the
      // connection; the next poll opens a new one).
      const StatusCode code = c.status().code();
      if (code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded) return c.status();
      const auto now = std::chrono::steady_clock::now();
      if (!failing_since) failing_since = now;
      if (now - *failing_since >= o_.reconnect_window) return c.status();
      c_.reset();
      std::this_thread::sleep_for(milliseconds(200));
      continue;
    }
    failing_since.reset();
    offset += static_cast<int64_t>(c->ids.size());
    if (on_chunk) on_chunk(*c);
    if (c->done) {
      c->ids.clear();
      return *c;
    }
  }
}

Result<rpc::GenerateChunk> Client::Complete(rpc::GenerateRequest request) {
  request.api_key = o_.api_key;
  rpc::GenerateChunk chunk;
  SetTimeout(request.deadline_ms > 0 ? milliseconds(request.deadline_ms) + kPollMargin
                                     : milliseconds(std::chrono::hours(1)));
  Status s = Call("complete", [&] { (*c_)->Complete(chunk, request); });
  SetTimeout(o_.timeout);
  PENUMBRA_RETURN_IF_ERROR(s);
  return chunk;
}

Status Client::Cancel(const std::string& request_id) {
  return Call("cancel", [&] { (*c_)->Cancel(o_.api_key, request_id); });
}

Result<rpc::HealthResponse> Client::Health() {
  rpc::HealthResponse h;
  PENUMBRA_RETURN_IF_ERROR(Call("health", [&] { (*c_)->Health(h); }));
  return h;
}

Result<rpc::StatsResponse> Client::Stats() {
  rpc::StatsResponse s;
  PENUMBRA_RETURN_IF_ERROR(Call("stats", [&] { (*c_)->Stats(s, o_.api_key); }));
  return s;
}

Result<rpc::JobInfo> Client::SubmitJob(rpc::SubmitJobRequest request) {
  request.api_key = o_.api_key;
  rpc::JobInfo j;
  PENUMBRA_RETURN_IF_ERROR(Call("submit job", [&] { (*c_)->SubmitJob(j, request); }));
  return j;
}

Result<rpc::JobInfo> Client::GetJob(const std::string& job_id) {
  rpc::JobInfo j;
  PENUMBRA_RETURN_IF_ERROR(Call("get job", [&] { (*c_)->GetJob(j, o_.api_key, job_id); }));
  return j;
}

Result<std::vector<rpc::JobInfo>> Client::ListJobs(int page_size) {
  std::vector<rpc::JobInfo> all;
  std::string token;
  do {
    rpc::JobList page;
    PENUMBRA_RETURN_IF_ERROR(Call("list jobs", [&] { (*c_)->ListJobs(page, o_.api_key, token, page_size); }));
    all.insert(all.end(), page.jobs.begin(), page.jobs.end());
    token = page.next_page_token;
  } while (!token.empty());
  return all;
}

Result<std::vector<rpc::JobItemResult>> Client::JobResults(const std::string& job_id, int page_size) {
  std::vector<rpc::JobItemResult> all;
  std::string after;
  do {
    rpc::JobResults page;
    PENUMBRA_RETURN_IF_ERROR(
        Call("job results", [&] { (*c_)->GetJobResults(page, o_.api_key, job_id, after, page_size); }));
    all.insert(all.end(), page.results.begin(), page.results.end());
    after = page.next_after;
  } while (!after.empty());
  return all;
}

Result<rpc::JobInfo> Client::CancelJob(const std::string& job_id) {
  rpc::JobInfo j;
  PENUMBRA_RETURN_IF_ERROR(Call("cancel job", [&] { (*c_)->CancelJob(j, o_.api_key, job_id); }));
  return j;
}

Status Client::DeleteJob(const std::string& job_id) {
  return Call("delete job", [&] { (*c_)->DeleteJob(o_.api_key, job_id); });
}

}  // namespace penumbra::client
