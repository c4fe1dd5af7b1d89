#include "coordinator/server/openai_gateway.h"

#include <cstdlib>
#include <random>

#include <glog/logging.h>

#include "coordinator/server/openai_gateway_internal.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {
namespace openai_gateway {

using nlohmann::json;

void Reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(), "application/json");
}

void Fail(httplib::Response& res, const openai::ApiError& e) {
  Reply(res, e.http_status, e.Body());
  if (e.retry_after_ms >= 0) {
    // Whole seconds (at least 1), and OpenAI's clients also read the
    // milliseconds.
    res.set_header("Retry-After", std::to_string(std::max<int64_t>(1, (e.retry_after_ms + 999) / 1000)));
    res.set_header("retry-after-ms", std::to_string(e.retry_after_ms));
  }
}

std::string BearerKey(const httplib::Request& req) {
  const std::string h = req.get_header_value("Authorization");
  if (h.size() > 7 && (h.compare(0, 7, "Bearer ") == 0 || h.compare(0, 7, "bearer ") == 0)) {
    size_t b = 7;
    while (b < h.size() && h[b] == ' ') ++b;
    return h.substr(b);
  }
  return "";
}

int64_t RandomSeed() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return static_cast<int64_t>(rng() >> 1);
}

json ListJson(json data, bool has_more) {
  json first = data.empty() ? json(nullptr) : data.front()["id"];
  json last = data.empty() ? json(nullptr) : data.back()["id"];
  return json{{"object", "list"},
              {"data", std::move(data)},
              {"has_more", has_more},
              {"first_id", std::move(first)},
              {"last_id", std::move(last)}};
}

}  // namespace openai_gateway

namespace {

using nlohmann::json;
using openai::ApiError;
using openai::Endpoint;
using namespace openai_gateway;  // NOLINT(google-build-using-namespace): the gateway's own helpers

std::string Event(const json& j) { return "data: " + j.dump() + "\n\n"; }

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One stream's state between the provider's calls (each call polls once).
struct Stream {
  std::string api_key;
  std::string request_id;
  std::string response_id;
  Endpoint endpoint = Endpoint::kCompletions;
  bool include_usage = false;
  bool return_token_ids = false;
  int64_t offset = 0;    // tokens received
  size_t text_sent = 0;  // bytes of the answer's text sent
  bool first = true;     // nothing sent yet
  transport::PeerIdentity caller;
};

}  // namespace

Result<std::unique_ptr<OpenAiGateway>> OpenAiGateway::Start(Coordinator* coordinator, const std::string& model_dir,
                                                            const OpenAiGatewayOptions& options) {
  std::unique_ptr<OpenAiGateway> g(new OpenAiGateway());
  g->c_ = coordinator;
  g->o_ = options;
  if (g->o_.stream_poll.count() < 1 ||
      g->o_.stream_poll > std::chrono::milliseconds(coordinator->request_limits().max_wait_ms)) {
    return Status::InvalidArgument("the OpenAI API's stream poll must be in [1, max_wait_ms] ms");
  }
  g->model_.id = coordinator->model_name();
  g->model_.max_new_tokens = coordinator->request_limits().max_new_tokens;
  Result<openai::LoadedChat> chat = openai::LoadChatTemplate(model_dir, options.chat_template_file);
  if (chat.ok()) {
    g->chat_ = chat->chat;
    g->model_.chat = g->chat_.get();
    g->model_.bos_token = chat->bos_token;
    g->model_.eos_token = chat->eos_token;
    LOG(INFO) << "OpenAI API: the chat template of " << chat->source;
  } else if (chat.status().code() == StatusCode::kNotFound && options.chat_template_file.empty()) {
    LOG(WARNING) << "OpenAI API: " << chat.status().message()
                 << ": /v1/chat/completions is refused (give --chat-template FILE)";
  } else {
    return chat.status();
  }
  g->created_ = UnixSeconds();
  if (!options.files.path.empty()) {
    jobs::FileStoreOptions fo = options.files;
    fo.max_file_bytes = std::max(fo.max_file_bytes, options.http.max_body_bytes);
    PENUMBRA_ASSIGN_OR_RETURN(g->files_, jobs::FileStore::Open(fo));
  }
  transport::HttpServerOptions http = options.http;
  if (http.name == transport::HttpServerOptions{}.name) http.name = "OpenAI API";
  g->http_ = std::make_unique<transport::HttpServer>(http);
  g->Routes();
  PENUMBRA_RETURN_IF_ERROR(g->http_->Start());
  return g;
}

OpenAiGateway::~OpenAiGateway() { Stop(); }

void OpenAiGateway::Stop() {
  if (http_) http_->Stop();
}

void OpenAiGateway::Routes() {
  http_->OnError([](const httplib::Request&, httplib::Response& res, const std::string& why) {
    ApiError e;
    e.http_status = res.status;
    e.message = why;
    e.type = res.status == 403 ? "permission_error" : res.status >= 500 ? "server_error" : "invalid_request_error";
    if (res.status == 404) e.code = "unknown_url";
    Reply(res, res.status, e.Body());
  });
  auto authenticated = [this](const httplib::Request& req, httplib::Response& res) {
    Status s = c_->Authenticate(BearerKey(req));
    if (!s.ok()) Fail(res, openai::ErrorOf(s));
    return s.ok();
  };
  http_->Get("/v1/models", [this, authenticated](const httplib::Request& req, httplib::Response& res) {
    if (authenticated(req, res)) Reply(res, 200, openai::ModelList(model_.id, created_));
  });
  http_->Get(R"(/v1/models/(.+))", [this, authenticated](const httplib::Request& req, httplib::Response& res) {
    if (!authenticated(req, res)) return;
    if (req.matches[1] != model_.id) {
      return Fail(res, openai::ErrorOf(Status::NotFound("the model '" + std::string(req.matches[1]) +
                                                        "' does not exist: this service serves '" + model_.id + "'")));
    }
    Reply(res, 200, openai::ModelObject(model_.id, created_));
  });
  // Documents (our extension): put, list, get, delete.
  http_->Post("/v1/documents", [this](const httplib::Request& req, httplib::Response& res) {
    Result<json> body = openai::ParseBody(req.body);
    if (!body.ok()) return Fail(res, openai::MalformedBody(body.status().message()));
    Result<rpc::PutDocumentRequest> put = openai::ParsePutDocument(*body);
    if (!put.ok()) return Fail(res, openai::ErrorOf(put.status()));
    put->api_key = BearerKey(req);
    rpc::DocumentInfo d;
    try {
      c_->PutDocument(d, *put);
    } catch (const rpc::PenumbraError& err) {
      return Fail(res, openai::ErrorOf(err));
    }
    Reply(res, 200, openai::DocumentJson(d));
  });
  http_->Get("/v1/documents", [this](const httplib::Request& req, httplib::Response& res) {
    rpc::ListDocumentsRequest list;
    list.api_key = BearerKey(req);
    list.page_token = req.get_param_value("after");
    if (req.has_param("limit")) {
      const std::string limit = req.get_param_value("limit");
      char* end = nullptr;
      const long v = std::strtol(limit.c_str(), &end, 10);
      if (limit.empty() || *end != '\0' || v < 1 || v > c_->request_limits().max_page_size) {
        return Fail(res, openai::ErrorOf(Status::InvalidArgument("'limit' must be an integer in [1, " +
                                                                 std::to_string(c_->request_limits().max_page_size) +
                                                                 "], got '" + limit + "'")));
      }
      list.page_size = static_cast<int32_t>(v);
    }
    rpc::DocumentList out;
    try {
      c_->ListDocuments(out, list);
    } catch (const rpc::PenumbraError& err) {
      return Fail(res, openai::ErrorOf(err));
    }
    json data = json::array();
    for (const rpc::DocumentInfo& d : out.documents) data.push_back(openai::DocumentJson(d));
    Reply(res, 200,
          json{{"object", "list"},
               {"data", std::move(data)},
               {"has_more", !out.next_page_token.empty()},
               {"next_page_token", out.next_page_token.empty() ? json(nullptr) : json(out.next_page_token)}});
  });
  http_->Get(R"(/v1/documents/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    rpc::DocumentInfo d;
    try {
      c_->GetDocument(d, BearerKey(req), req.matches[1], 0);
    } catch (const rpc::PenumbraError& err) {
      return Fail(res, openai::ErrorOf(err));
    }
    Reply(res, 200, openai::DocumentJson(d));
  });
  http_->Delete(R"(/v1/documents/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    try {
      c_->DeleteDocument(BearerKey(req), id, 0);
    } catch (const rpc::PenumbraError& err) {
      return Fail(res, openai::ErrorOf(err));
    }
    Reply(res, 200, json{{"id", id}, {"object", "document.deleted"}, {"deleted", true}});
  });
  http_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Generate(Endpoint::kCompletions, req, res);
  });
  http_->Post("/v1/chat/completions",
              [this](const httplib::Request& req, httplib::Response& res) { Generate(Endpoint::kChat, req, res); });
  BatchRoutes();
}

void OpenAiGateway::Generate(Endpoint e, const httplib::Request& req, httplib::Response& res) {
  const std::string key = BearerKey(req);
  // Who first (401 before anything about the body), then what.
  if (Status s = c_->Authenticate(key); !s.ok()) return Fail(res, openai::ErrorOf(s));
  Result<json> body = openai::ParseBody(req.body);
  if (!body.ok()) return Fail(res, openai::MalformedBody(body.status().message()));
  Result<openai::Parsed> parsed = e == Endpoint::kChat
                                      ? openai::ParseChat(*body, model_, RandomSeed(), std::chrono::system_clock::now())
                                      : openai::ParseCompletions(*body, model_, RandomSeed());
  if (!parsed.ok()) return Fail(res, openai::ErrorOf(parsed.status()));
  parsed->generate.api_key = key;
  const int64_t created = UnixSeconds();

  if (!parsed->stream) {
    rpc::GenerateChunk done;
    try {
      c_->Complete(done, parsed->generate);
    } catch (const rpc::PenumbraError& err) {
      return Fail(res, openai::ErrorOf(err));
    }
    if (done.finish_reason != "stop" && done.finish_reason != "length") {
      return Fail(res, openai::ErrorOf(
                           Status::Unavailable("the generation ended early (" + done.finish_reason + "): retry it")));
    }
    res.set_header("x-request-id", done.request_id);
    return Reply(res, 200, openai::Response(e, model_.id, created, done, parsed->return_token_ids));
  }

  auto st = std::make_shared<Stream>();
  st->api_key = key;
  st->endpoint = e;
  st->include_usage = parsed->include_usage;
  st->return_token_ids = parsed->return_token_ids;
  st->caller = transport::CurrentPeer();
  try {
    c_->Generate(st->request_id, parsed->generate);
  } catch (const rpc::PenumbraError& err) {
    return Fail(res, openai::ErrorOf(err));
  }
  st->response_id = openai::ResponseId(e, st->request_id);
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("x-request-id", st->request_id);
  const int wait_ms = static_cast<int>(o_.stream_poll.count());
  res.set_chunked_content_provider("text/event-stream", [this, st, created, wait_ms](size_t, httplib::DataSink& sink) {
    transport::ScopedPeer caller(st->caller, -1);
    auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
    // The client is gone: nobody will read the rest.
    auto abandon = [&] {
      LOG(INFO) << "OpenAI API: the client of stream " << st->request_id << " went away after " << st->offset
                << " tokens; cancelled";
      try {
        c_->Cancel(st->api_key, st->request_id);
      } catch (const rpc::PenumbraError&) {
      }
      return false;
    };
    rpc::GenerateChunk chunk;
    try {
      c_->Poll(chunk, st->api_key, st->request_id, st->offset, wait_ms);
    } catch (const rpc::PenumbraError& err) {
      const ApiError a = openai::ErrorOf(err);
      if (!write(Event(a.Body())) || !write("data: [DONE]\n\n")) return abandon();
      sink.done();
      return true;
    }
    st->offset += static_cast<int64_t>(chunk.ids.size());
    const std::string fresh = chunk.text.size() > st->text_sent ? chunk.text.substr(st->text_sent) : "";
    st->text_sent = std::max(st->text_sent, chunk.text.size());
    const bool fresh_ids = st->return_token_ids && !chunk.ids.empty();
    if (!fresh.empty() || fresh_ids || (st->first && !chunk.done)) {
      if (!write(Event(openai::StreamChunk(st->endpoint, st->response_id, model_.id, created, fresh, st->first, nullptr,
                                           st->include_usage, st->return_token_ids ? &chunk.ids : nullptr)))) {
        return abandon();
      }
      st->first = false;
    } else if (!chunk.done) {
      // Nothing new: a comment line keeps the stream alive and finds a
      // client that has gone (the write fails).
      if (!write(": waiting\n\n")) return abandon();
      return true;
    }
    if (!chunk.done) return true;
    const json finish = openai::FinishReason(chunk.finish_reason);
    if (finish.is_null()) {
      // Ended by an error, a deadline or a drain: said in the stream.
      rpc::PenumbraError pe;
      pe.code = chunk.__isset.error_code ? chunk.error_code : rpc::ErrorCode::UNAVAILABLE;
      pe.message = chunk.__isset.error_message ? chunk.error_message
                                               : "the generation ended early (" + chunk.finish_reason + "): retry it";
      const ApiError a = openai::ErrorOf(pe);
      if (!write(Event(a.Body()))) return abandon();
    } else {
      const std::vector<int32_t> none;
      if (!write(Event(openai::StreamChunk(st->endpoint, st->response_id, model_.id, created, "", st->first, finish,
                                           st->include_usage, st->return_token_ids ? &none : nullptr)))) {
        return false;
      }
      if (st->include_usage &&
          !write(Event(openai::UsageChunk(st->endpoint, st->response_id, model_.id, created, chunk.usage)))) {
        return false;
      }
    }
    if (!write("data: [DONE]\n\n")) return false;
    sink.done();
    return true;
  });
}

}  // namespace penumbra::coordinator
