#include "transport/ucx_rpc.h"

#include <arpa/inet.h>
#include <glog/logging.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace penumbra::transport {
namespace {

constexpr uint16_t kAmRequest = 1, kAmReply = 2;

struct RequestHeader {
  uint64_t id = 0;
  uint32_t method = 0;
  uint32_t reserved = 0;
  uint64_t checksum = 0;  // XXH3 of the payload
};
struct ReplyHeader {
  uint64_t id = 0;
  int32_t code = 0;  // StatusCode; the payload is the message when not OK
  uint32_t reserved = 0;
  uint64_t checksum = 0;
};

uint64_t Checksum(const std::string& s) { return XXH3_64bits(s.data(), s.size()); }

Status UcsError(ucs_status_t s, const std::string& what) {
  return Status::Unavailable("ucx: " + what + ": " + ucs_status_string(s));
}

// The request of a non-blocking call given back to UCX (released at its
// completion; no callback runs after this).
void Release(void* request) {
  if (request != nullptr && UCS_PTR_IS_PTR(request)) ucp_request_free(request);
}

// One UCX worker and the thread that drives it. Work for the worker is
// posted (Post) and runs on that thread between progress calls; the thread
// sleeps on the worker's event fd and an eventfd for posts.
class Loop {
 public:
  static Result<std::unique_ptr<Loop>> Create() {
    auto l = std::unique_ptr<Loop>(new Loop());
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) return UcsError(s, "config");
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    s = ucp_init(&p, cfg, &l->context_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return UcsError(s, "init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the loop's thread calls it
    s = ucp_worker_create(l->context_, &wp, &l->worker_);
    if (s != UCS_OK) return UcsError(s, "worker");
    s = ucp_worker_get_efd(l->worker_, &l->efd_);
    if (s != UCS_OK) return UcsError(s, "event fd");
    l->wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (l->wake_ < 0) return Status::Internal("eventfd: " + std::string(std::strerror(errno)));
    return l;
  }
  ~Loop() {
    StopThread();
    if (worker_ != nullptr) {
      for (int i = 0; i < 100; ++i) ucp_worker_progress(worker_);  // lets closes finish
      ucp_worker_destroy(worker_);
    }
    if (context_ != nullptr) ucp_cleanup(context_);
    if (wake_ >= 0) close(wake_);
  }
  ucp_worker_h worker() const { return worker_; }

  void Start() { thread_ = std::thread([this] { Run(); }); }
  void Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      tasks_.push_back(std::move(task));
    }
    Wake();
  }
  // Runs the posted tasks left, then stops the thread. After it, the
  // caller may use the worker from its own thread.
  void StopThread() {
    if (!thread_.joinable()) return;
    stop_ = true;
    Wake();
    thread_.join();
  }
  bool on_loop_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  Loop() = default;
  void Wake() {
    const uint64_t one = 1;
    ssize_t n = write(wake_, &one, sizeof one);
    (void)n;
  }
  void Run() {
    for (;;) {
      std::deque<std::function<void()>> tasks;
      {
        std::lock_guard<std::mutex> lk(mu_);
        tasks.swap(tasks_);
      }
      for (auto& t : tasks) t();
      while (ucp_worker_progress(worker_) != 0) {
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (!tasks_.empty()) continue;
        if (stop_) break;
      }
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_, POLLIN, 0}};
      poll(fds, 2, 100);
      if (fds[1].revents & POLLIN) {
        uint64_t v = 0;
        ssize_t n = read(wake_, &v, sizeof v);
        (void)n;
      }
    }
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1, wake_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
};

// An AM send whose header and payload live until it completes.
struct Send {
  std::vector<char> header;
  std::string payload;
};

void OnSent(void* request, ucs_status_t, void* user_data) {
  delete static_cast<Send*>(user_data);
  ucp_request_free(request);
}

// Sends AM `id` on ep (loop thread); false when the send failed at once.
bool SendAm(ucp_ep_h ep, uint16_t id, const void* header, size_t header_len, std::string payload, uint32_t flags) {
  auto* s = new Send{std::vector<char>(static_cast<const char*>(header), static_cast<const char*>(header) + header_len),
                     std::move(payload)};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = OnSent;
  p.user_data = s;
  p.flags = flags;
  void* r = ucp_am_send_nbx(ep, id, s->header.data(), s->header.size(), s->payload.data(), s->payload.size(), &p);
  if (r == nullptr) {
    delete s;
    return true;
  }
  if (UCS_PTR_IS_ERR(r)) {
    delete s;
    return false;
  }
  return true;
}

void CloseEp(ucp_ep_h ep) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  Release(ucp_ep_close_nbx(ep, &p));
}

// A message's payload, received whole: given at once (eager), or fetched
// by ucp_am_recv_data_nbx (rendezvous) and then delivered.
struct Incoming {
  std::vector<char> header;
  std::string payload;
  ucp_ep_h reply_ep = nullptr;
  std::function<void(Incoming&)> deliver;
};

void OnRecvData(void* request, ucs_status_t status, size_t, void* user_data) {
  std::unique_ptr<Incoming> in(static_cast<Incoming*>(user_data));
  if (status == UCS_OK) in->deliver(*in);
  ucp_request_free(request);
}

// The AM callbacks' common part: header copied, payload received, then
// `deliver` (on the loop thread).
ucs_status_t Receive(ucp_worker_h worker, const void* header, size_t header_len, void* data, size_t length,
                     const ucp_am_recv_param_t* param, std::function<void(Incoming&)> deliver) {
  auto in = std::make_unique<Incoming>();
  in->header.assign(static_cast<const char*>(header), static_cast<const char*>(header) + header_len);
  in->reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  in->deliver = std::move(deliver);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    in->payload.assign(static_cast<const char*>(data), length);
    in->deliver(*in);
    return UCS_OK;
  }
  in->payload.resize(length);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = OnRecvData;
  Incoming* raw = in.get();
  p.user_data = raw;
  void* r = ucp_am_recv_data_nbx(worker, data, raw->payload.data(), length, &p);
  if (r == nullptr) {
    raw->deliver(*raw);  // completed at once
  } else if (UCS_PTR_IS_ERR(r)) {
    LOG(WARNING) << "ucx: receiving a message failed: " << ucs_status_string(UCS_PTR_STATUS(r));
  } else {
    in.release();  // OnRecvData owns it
  }
  return UCS_OK;
}

Status SetAmHandler(ucp_worker_h worker, uint16_t id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                 UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &p);
  return s == UCS_OK ? Status::OK() : UcsError(s, "AM handler");
}

Result<sockaddr_in> Resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument("ucx: cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  sockaddr_in sa{};
  std::memcpy(&sa, res->ai_addr, sizeof sa);
  freeaddrinfo(res);
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

}  // namespace

// ------------------------------------------------------------------ server

struct UcxServer::Impl {
  Handler handler;
  std::unique_ptr<Loop> loop;
  ucp_listener_h listener = nullptr;
  int port = 0;
  std::set<ucp_ep_h> eps;  // live endpoints (loop thread)
  // Handler pool.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> jobs;
  std::vector<std::thread> pool;
  bool stopping = false;
  bool stopped = false;

  static void OnConn(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnEpError;
    p.err_handler.arg = self;
    ucp_ep_h ep = nullptr;
    ucs_status_t s = ucp_ep_create(self->loop->worker(), &p, &ep);
    if (s != UCS_OK) {
      LOG(WARNING) << "ucx server: accepting a connection failed: " << ucs_status_string(s);
      return;
    }
    self->eps.insert(ep);
  }
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    VLOG(1) << "ucx server: endpoint failed: " << ucs_status_string(status);
    if (self->eps.erase(ep) > 0) self->loop->Post([ep] { CloseEp(ep); });
  }
  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_len, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    if (header_len != sizeof(RequestHeader)) return UCS_OK;  // not ours: dropped
    return Receive(self->loop->worker(), header, header_len, data, length, param,
                   [self](Incoming& in) { self->Dispatch(in); });
  }
  // Loop thread: the request goes to the pool.
  void Dispatch(Incoming& in) {
    RequestHeader h;
    std::memcpy(&h, in.header.data(), sizeof h);
    ucp_ep_h ep = in.reply_ep;
    if (ep == nullptr || !eps.count(ep)) return;  // no way to answer
    std::string payload = std::move(in.payload);
    std::lock_guard<std::mutex> lk(mu);
    jobs.push_back([this, h, ep, payload = std::move(payload)]() mutable {
      Result<std::string> r = Checksum(payload) == h.checksum
                                  ? handler(h.method, std::move(payload))
                                  : Result<std::string>(Status::Corruption("ucx: a request's checksum does not match"));
      ReplyHeader rh;
      rh.id = h.id;
      std::string body;
      if (r.ok()) {
        body = std::move(*r);
      } else {
        rh.code = static_cast<int32_t>(r.status().code());
        body = r.status().message();
      }
      rh.checksum = Checksum(body);
      loop->Post([this, ep, rh, body = std::move(body)]() mutable {
        if (eps.count(ep)) SendAm(ep, kAmReply, &rh, sizeof rh, std::move(body), 0);
      });
    });
    cv.notify_one();
  }
  void Work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stopping || !jobs.empty(); });
        if (jobs.empty()) return;
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      job();
    }
  }
};

Result<std::unique_ptr<UcxServer>> UcxServer::Start(const std::string& host, int port, Handler handler,
                                                    int threads) {
  if (port < 0 || port > 65535) return Status::InvalidArgument("ucx server: port " + std::to_string(port));
  auto impl = std::make_unique<Impl>();
  impl->handler = std::move(handler);
  PENUMBRA_ASSIGN_OR_RETURN(impl->loop, Loop::Create());
  PENUMBRA_RETURN_IF_ERROR(SetAmHandler(impl->loop->worker(), kAmRequest, &Impl::OnRequest, impl.get()));
  PENUMBRA_ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(host, port));
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof sa;
  lp.conn_handler.cb = &Impl::OnConn;
  lp.conn_handler.arg = impl.get();
  ucs_status_t s = ucp_listener_create(impl->loop->worker(), &lp, &impl->listener);
  if (s != UCS_OK) return UcsError(s, "listen on " + host + ":" + std::to_string(port));
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(impl->listener, &attr);
  if (s != UCS_OK) return UcsError(s, "listener address");
  impl->port = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  for (int i = 0; i < std::max(1, threads); ++i) impl->pool.emplace_back([p = impl.get()] { p->Work(); });
  impl->loop->Start();
  return std::unique_ptr<UcxServer>(new UcxServer(std::move(impl)));
}

UcxServer::UcxServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxServer::~UcxServer() { Stop(); }
int UcxServer::port() const { return impl_->port; }

void UcxServer::Stop() {
  Impl& m = *impl_;
  if (m.stopped) return;
  m.stopped = true;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.stopping = true;
  }
  m.cv.notify_all();
  for (auto& t : m.pool) t.join();  // the jobs queued are answered first
  m.loop->StopThread();
  // The loop's thread is gone: its worker is this thread's now.
  if (m.listener != nullptr) ucp_listener_destroy(m.listener);
  for (ucp_ep_h ep : m.eps) CloseEp(ep);
  m.eps.clear();
  m.loop.reset();
}

// ------------------------------------------------------------------ client

struct UcxClient::Impl {
  sockaddr_in address{};
  std::string where;
  std::unique_ptr<Loop> loop;
  ucp_ep_h ep = nullptr;  // loop thread
  struct Call {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Result<std::string> result = Status::Internal("ucx: no reply");
  };
  std::mutex mu;
  std::map<uint64_t, std::shared_ptr<Call>> pending;
  std::atomic<uint64_t> next_id{1};

  static void Finish(const std::shared_ptr<Call>& c, Result<std::string> r) {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->done) return;
    c->result = std::move(r);
    c->done = true;
    c->cv.notify_all();
  }
  std::shared_ptr<Call> Take(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = pending.find(id);
    if (it == pending.end()) return nullptr;
    auto c = it->second;
    pending.erase(it);
    return c;
  }
  // Every call in flight fails (the endpoint went away).
  void FailAll(const Status& why) {
    std::map<uint64_t, std::shared_ptr<Call>> calls;
    {
      std::lock_guard<std::mutex> lk(mu);
      calls.swap(pending);
    }
    for (auto& [id, c] : calls) Finish(c, why);
  }
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    if (self->ep != ep) return;
    self->ep = nullptr;
    self->loop->Post([ep] { CloseEp(ep); });
    self->FailAll(Status::Unavailable("ucx: the connection to " + self->where +
                                      " failed: " + ucs_status_string(status)));
  }
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_len, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    if (header_len != sizeof(ReplyHeader)) return UCS_OK;
    return Receive(self->loop->worker(), header, header_len, data, length, param, [self](Incoming& in) {
      ReplyHeader h;
      std::memcpy(&h, in.header.data(), sizeof h);
      auto c = self->Take(h.id);
      if (!c) return;  // its caller gave up (deadline)
      if (Checksum(in.payload) != h.checksum) {
        Finish(c, Status::Corruption("ucx: a reply from " + self->where + " failed its checksum"));
      } else if (h.code < 0 || h.code > static_cast<int32_t>(StatusCode::kPermissionDenied)) {
        Finish(c, Status::Internal("ucx: a reply from " + self->where + " carries an unknown status " +
                                   std::to_string(h.code) + ": " + in.payload));
      } else if (h.code != 0) {
        Finish(c, Status(static_cast<StatusCode>(h.code), std::move(in.payload)));
      } else {
        Finish(c, std::move(in.payload));
      }
    });
  }
  // Loop thread: the endpoint, connecting when there is none.
  Status EnsureEp() {
    if (ep != nullptr) return Status::OK();
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
    p.sockaddr.addrlen = sizeof address;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnEpError;
    p.err_handler.arg = this;
    ucs_status_t s = ucp_ep_create(loop->worker(), &p, &ep);
    if (s != UCS_OK) {
      ep = nullptr;
      return UcsError(s, "connect to " + where);
    }
    return Status::OK();
  }
};

Result<std::unique_ptr<UcxClient>> UcxClient::Connect(const std::string& host, int port) {
  if (port <= 0 || port > 65535) return Status::InvalidArgument("ucx client: port " + std::to_string(port));
  auto impl = std::make_unique<Impl>();
  PENUMBRA_ASSIGN_OR_RETURN(impl->address, Resolve(host, port));
  impl->where = host + ":" + std::to_string(port);
  PENUMBRA_ASSIGN_OR_RETURN(impl->loop, Loop::Create());
  PENUMBRA_RETURN_IF_ERROR(SetAmHandler(impl->loop->worker(), kAmReply, &Impl::OnReply, impl.get()));
  impl->loop->Start();
  return std::unique_ptr<UcxClient>(new UcxClient(std::move(impl)));
}

UcxClient::UcxClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

UcxClient::~UcxClient() {
  Impl& m = *impl_;
  m.loop->StopThread();
  if (m.ep != nullptr) CloseEp(m.ep);
  m.ep = nullptr;
  m.FailAll(Status::Cancelled("ucx: the client was closed"));
  m.loop.reset();
}

Result<std::string> UcxClient::Call(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  auto call = std::make_shared<Impl::Call>();
  const uint64_t id = m.next_id++;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.pending[id] = call;
  }
  RequestHeader h;
  h.id = id;
  h.method = method;
  std::string body(payload);
  h.checksum = Checksum(body);
  m.loop->Post([&m, h, body = std::move(body), id]() mutable {
    Status s = m.EnsureEp();
    if (s.ok() && !SendAm(m.ep, kAmRequest, &h, sizeof h, std::move(body), UCP_AM_SEND_FLAG_REPLY)) {
      s = Status::Unavailable("ucx: sending to " + m.where + " failed");
    }
    if (!s.ok()) {
      if (auto c = m.Take(id)) Impl::Finish(c, s);
    }
  });
  std::unique_lock<std::mutex> lk(call->mu);
  if (!call->cv.wait_for(lk, timeout, [&] { return call->done; })) {
    lk.unlock();
    m.Take(id);  // a late reply is dropped
    return Status::DeadlineExceeded("ucx: no reply from " + m.where + " within " + std::to_string(timeout.count()) +
                                    " ms");
  }
  return std::move(call->result);
}

}  // namespace penumbra::transport
