#include "transport/ucx_rpc.h"

#include <arpa/inet.h>
#include <glog/logging.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace penumbra::transport {
namespace {

namespace uf = ucx_frame;
using Clock = std::chrono::steady_clock;

using uf::kAmToClient;
using uf::kAmToServer;
// A refused connection is closed this long after its REFUSED frame (time
// for it to leave), or at once when the peer misbehaved.
constexpr auto kRefusalLinger = std::chrono::milliseconds(200);

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
// sleeps on the worker's event fd and an eventfd for posts, and runs the
// tick (timeouts) about every 100 ms.
// A UCP context: the transports' resources, shared by the loops (workers)
// of one server.
class UcpContext {
 public:
  // shared_workers: several workers of it run on different threads.
  static Result<std::shared_ptr<UcpContext>> Create(const std::string& net_devices, bool shared_workers) {
    auto c = std::shared_ptr<UcpContext>(new UcpContext());
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) return UcsError(s, "config");
    if (!net_devices.empty()) {
      if (const char* env = std::getenv("UCX_NET_DEVICES"); env != nullptr) {
        LOG(WARNING) << "ucx: UCX_NET_DEVICES=" << env << " from the environment, instead of " << net_devices
                     << " (the devices of the address): UCX listens on each of those devices";
      } else {
        s = ucp_config_modify(cfg, "NET_DEVICES", net_devices.c_str());
        if (s != UCS_OK) {
          ucp_config_release(cfg);
          return UcsError(s, "UCX_NET_DEVICES=" + net_devices);
        }
      }
    }
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.mt_workers_shared = shared_workers ? 1 : 0;
    s = ucp_init(&p, cfg, &c->h_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return UcsError(s, "init");
    return c;
  }
  ~UcpContext() {
    if (h_ != nullptr) ucp_cleanup(h_);
  }
  UcpContext(const UcpContext&) = delete;
  UcpContext& operator=(const UcpContext&) = delete;
  ucp_context_h get() const { return h_; }

 private:
  UcpContext() = default;
  ucp_context_h h_ = nullptr;
};

class Loop {
 public:
  // A loop (a worker) of `context`.
  static Result<std::unique_ptr<Loop>> Create(std::shared_ptr<UcpContext> context) {
    auto l = std::unique_ptr<Loop>(new Loop());
    l->context_ = std::move(context);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the loop's thread calls it
    ucs_status_t s = ucp_worker_create(l->context_->get(), &wp, &l->worker_);
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
    if (wake_ >= 0) close(wake_);
    // context_ goes after the worker (the last loop of a context cleans it up).
  }
  ucp_worker_h worker() const { return worker_; }

  // Called on the loop's thread about every 100 ms (set before Start).
  void SetTick(std::function<void()> tick) { tick_ = std::move(tick); }
  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
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

 private:
  Loop() = default;
  void Wake() {
    const uint64_t one = 1;
    ssize_t n = write(wake_, &one, sizeof one);
    (void)n;
  }
  void Run() {
    auto last_tick = Clock::now();
    for (;;) {
      std::deque<std::function<void()>> tasks;
      {
        std::lock_guard<std::mutex> lk(mu_);
        tasks.swap(tasks_);
      }
      for (auto& t : tasks) t();
      while (ucp_worker_progress(worker_) != 0) {
      }
      if (tick_ && Clock::now() - last_tick >= std::chrono::milliseconds(100)) {
        last_tick = Clock::now();
        tick_();
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

  std::shared_ptr<UcpContext> context_;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1, wake_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::function<void()> tick_;
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
};

// An AM send whose header and body live until it completes.
struct Send {
  std::string header;
  std::string body;
};

void OnSent(void* request, ucs_status_t, void* user_data) {
  delete static_cast<Send*>(user_data);
  ucp_request_free(request);
}

// Sends one frame as AM `id` on ep (loop thread), asking for a reply
// endpoint so that the peer knows the connection; false when the send
// failed at once.
bool SendFrame(ucp_ep_h ep, uint16_t id, std::string header, std::string body) {
  auto* s = new Send{std::move(header), std::move(body)};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = OnSent;
  p.user_data = s;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  void* r = ucp_am_send_nbx(ep, id, s->header.data(), s->header.size(), s->body.data(), s->body.size(), &p);
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

// A body being received by rendezvous: delivered when it is whole.
struct Incoming {
  std::string body;
  std::function<void(std::string)> deliver;
};

void OnRecvData(void* request, ucs_status_t status, size_t, void* user_data) {
  std::unique_ptr<Incoming> in(static_cast<Incoming*>(user_data));
  if (status == UCS_OK) {
    in->deliver(std::move(in->body));
  } else {
    LOG(WARNING) << "ucx: receiving a message failed: " << ucs_status_string(status);
  }
  ucp_request_free(request);
}

// Receives a body of `length` bytes (checked against the limits already):
// copied at once (eager), or fetched into a buffer of its size
// (rendezvous); then `deliver` runs on the loop thread. False when the
// buffer cannot be allocated or the receive cannot start.
bool ReceiveBody(ucp_worker_h worker, void* data, size_t length, const ucp_am_recv_param_t* param,
                 std::function<void(std::string)> deliver) {
  try {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      deliver(std::string(static_cast<const char*>(data), length));
      return true;
    }
    auto in = std::make_unique<Incoming>();
    in->body.resize(length);
    in->deliver = std::move(deliver);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = OnRecvData;
    Incoming* raw = in.get();
    p.user_data = raw;
    void* r = ucp_am_recv_data_nbx(worker, data, raw->body.data(), length, &p);
    if (r == nullptr) {
      raw->deliver(std::move(raw->body));  // completed at once
    } else if (UCS_PTR_IS_ERR(r)) {
      LOG(WARNING) << "ucx: receiving a message failed: " << ucs_status_string(UCS_PTR_STATUS(r));
      return false;
    } else {
      (void)in.release();  // OnRecvData owns it
    }
    return true;
  } catch (const std::bad_alloc&) {
    LOG(WARNING) << "ucx: no memory for a message of " << length << " bytes; dropped";
    return false;
  }
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

std::string IpOf(const sockaddr_in& sa) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof buf);
  return buf;
}

ucp_ep_h ReplyEp(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
}

}  // namespace

Result<std::string> UcxNetDevices(const std::string& ip, bool route) {
  in_addr addr{};
  if (inet_pton(AF_INET, ip.c_str(), &addr) != 1) {
    return Status::InvalidArgument("ucx: '" + ip + "' is not an IPv4 address");
  }
  if (addr.s_addr == htonl(INADDR_ANY)) return std::string();
  in_addr local = addr;
  if (route) {
    // The kernel's choice of source address toward `ip` (no packet is sent).
    const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Status::Internal("socket: " + std::string(std::strerror(errno)));
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_addr = addr;
    to.sin_port = htons(9);
    sockaddr_in from{};
    socklen_t len = sizeof from;
    const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&from), &len) == 0;
    close(fd);
    if (!ok) return Status::Unavailable("ucx: no route to " + ip);
    local = from.sin_addr;
  }
  const bool loopback = (ntohl(local.s_addr) >> 24) == 127;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return Status::Internal("getifaddrs: " + std::string(std::strerror(errno)));
  std::string name, loopback_name;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (a->sin_addr.s_addr == local.s_addr) {
      name = i->ifa_name;
      break;
    }
    if ((i->ifa_flags & IFF_LOOPBACK) && loopback_name.empty()) loopback_name = i->ifa_name;
  }
  freeifaddrs(list);
  if (name.empty() && loopback) name = loopback_name;  // 127.0.0.2 and the like live on lo
  if (name.empty()) return Status::NotFound("ucx: no network interface holds " + ip);
  name = name.substr(0, name.find(':'));  // an alias (eth0:1) is its device's
  if (!loopback) {
    // RDMA devices: their transports listen on no IP port, and the plane
    // wants them across hosts.
    std::error_code ec;
    for (const auto& dev : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
      std::error_code pe;
      for (const auto& port : std::filesystem::directory_iterator(dev.path() / "ports", pe)) {
        name += "," + dev.path().filename().string() + ":" + port.path().filename().string();
      }
    }
  }
  return name;
}

// ------------------------------------------------------------------ server

namespace {

struct ServerShard;

// One connection of a server, on one of its shards. Its shard's loop
// thread, except: opener->Open (const) and sealer on the pool's threads.
struct ServerConn {
  ucp_ep_h ep = nullptr;
  ServerShard* shard = nullptr;
  uint64_t number = 0;
  Clock::time_point accepted;
  std::unique_ptr<uf::ServerHandshake> handshake;  // until established
  bool established = false;
  bool closing = false;  // refused: closed at close_at
  Clock::time_point close_at;
  UcxCaller caller;
  std::unique_ptr<uf::FrameOpener> opener;  // the client's frames
  std::shared_ptr<uf::FrameSealer> sealer;  // frames to the client
};

struct Counter {
  std::atomic<int64_t> v{0};
  void operator++() { v.fetch_add(1, std::memory_order_relaxed); }
  int64_t get() const { return v.load(std::memory_order_relaxed); }
};

// One UCX worker of a server and the connections it carries (the listener
// is on shard 0's; accepted connections are spread over the shards).
struct ServerShard {
  UcxServer::Impl* server = nullptr;
  std::unique_ptr<Loop> loop;
  std::map<ucp_ep_h, std::shared_ptr<ServerConn>> conns;  // its loop thread
};

}  // namespace

struct UcxServer::Impl {
  Handler handler;
  UcxServerOptions options;
  std::string plane_key;                             // empty: plain
  std::vector<std::unique_ptr<ServerShard>> shards;  // [0] holds the listener
  ucp_listener_h listener = nullptr;
  int port = 0;
  std::atomic<uint64_t> next_conn{1};
  std::atomic<size_t> next_shard{0};
  std::atomic<size_t> inflight_bytes{0};
  Counter connections, rejected, handshakes, handshake_failures, handshake_timeouts, frames_rejected, replays, requests,
      busy;
  std::atomic<int64_t> open{0};  // connections accepted and not yet closed, every shard
  // Handler pool.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> jobs;
  std::vector<std::thread> pool;
  bool stopping = false;
  bool stopped = false;

  // Its shard's loop thread.
  static bool Live(const std::shared_ptr<ServerConn>& c) {
    const auto& conns = c->shard->conns;
    auto it = conns.find(c->ep);
    return it != conns.end() && it->second == c && !c->closing;
  }
  // Closes a connection now (its shard's loop thread).
  void Drop(std::shared_ptr<ServerConn> c) {
    auto& conns = c->shard->conns;
    auto it = conns.find(c->ep);
    if (it == conns.end() || it->second != c) return;
    conns.erase(it);
    --open;
    CloseEp(c->ep);
  }
  // Refuses a connection's handshake: a REFUSED frame, then the close.
  void Refuse(const std::shared_ptr<ServerConn>& c, const std::string& why) {
    ++handshake_failures;
    LOG(WARNING) << "ucx server: connection " << c->number << " refused: " << why;
    SendFrame(c->ep, kAmToClient, uf::HandshakeHeader(uf::FrameType::kRefused, why), why);
    c->closing = true;
    c->close_at = Clock::now() + kRefusalLinger;
  }
  // A frame that failed its checks: the connection is closed at once.
  void Reject(const std::shared_ptr<ServerConn>& c, uf::Refusal why, const std::string& message) {
    ++frames_rejected;
    if (why == uf::Refusal::kReplay || why == uf::Refusal::kStale) ++replays;
    LOG(WARNING) << "ucx server: connection " << c->number << " (client " << c->caller.client_id
                 << ") closed: " << message;
    Drop(c);
  }

  // A shard's loop thread, about every 100 ms.
  void Tick(ServerShard& shard) {
    const auto now = Clock::now();
    std::vector<std::shared_ptr<ServerConn>> late;
    for (const auto& [ep, c] : shard.conns) {
      if (c->closing ? now >= c->close_at : (!c->established && now - c->accepted > options.handshake_timeout)) {
        late.push_back(c);
      }
    }
    for (const auto& c : late) {
      if (!c->closing) {
        ++handshake_timeouts;
        LOG(WARNING) << "ucx server: connection " << c->number << " did not finish its handshake within "
                     << options.handshake_timeout.count() << " ms; closed";
      }
      Drop(c);
    }
  }

  // Shard 0's loop thread (the listener's): admits the connection, and a
  // shard (round robin) accepts it on its own thread.
  static void OnConn(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    if (self->open.load() >= self->options.max_endpoints) {
      ++self->rejected;
      LOG_EVERY_N(WARNING, 100) << "ucx server: " << self->open.load() << " connections (max_endpoints); "
                                << "a new one rejected";
      ucp_listener_reject(self->listener, request);
      return;
    }
    ++self->open;
    ServerShard* shard = self->shards[self->next_shard.fetch_add(1) % self->shards.size()].get();
    if (shard == self->shards[0].get()) return self->Accept(*shard, request);
    shard->loop->Post([self, shard, request] { self->Accept(*shard, request); });
  }
  // The shard's loop thread: a connection admitted (counted in open already).
  void Accept(ServerShard& shard, ucp_conn_request_h request) {
    ucp_ep_params_t p{};
    p.field_mask =
        UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnEpError;
    p.err_handler.arg = &shard;
    ucp_ep_h ep = nullptr;
    ucs_status_t s = ucp_ep_create(shard.loop->worker(), &p, &ep);
    if (s != UCS_OK) {
      --open;
      LOG(WARNING) << "ucx server: accepting a connection failed: " << ucs_status_string(s);
      return;
    }
    auto c = std::make_shared<ServerConn>();
    c->ep = ep;
    c->shard = &shard;
    c->number = next_conn++;
    c->accepted = Clock::now();
    c->handshake = std::make_unique<uf::ServerHandshake>(plane_key);
    shard.conns[ep] = std::move(c);
    ++connections;
  }
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* shard = static_cast<ServerShard*>(arg);
    auto it = shard->conns.find(ep);
    if (it == shard->conns.end()) return;
    VLOG(1) << "ucx server: connection " << it->second->number << " failed: " << ucs_status_string(status);
    auto c = it->second;
    Impl* self = shard->server;
    shard->loop->Post([self, c] { self->Drop(c); });
    c->closing = true;
    c->close_at = Clock::now();
  }
  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_len, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* shard = static_cast<ServerShard*>(arg);
    try {
      shard->server->Receive(*shard, std::string_view(static_cast<const char*>(header), header_len), data, length,
                             param);
    } catch (const std::exception& e) {
      LOG(ERROR) << "ucx server: a frame's processing failed: " << e.what();
    }
    return UCS_OK;
  }

  // The shard's loop thread: a frame from a client. Its header is checked
  // before its body is touched.
  void Receive(ServerShard& shard, std::string_view header, void* data, size_t length,
               const ucp_am_recv_param_t* param) {
    auto it = shard.conns.find(ReplyEp(param));
    if (it == shard.conns.end()) {
      ++frames_rejected;  // not from a connection we accepted: no way to answer
      return;
    }
    std::shared_ptr<ServerConn> c = it->second;
    if (c->closing) return;
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    uf::Refusal why = uf::Refusal::kNone;
    if (!c->established) {
      // Handshake frames: small, plain, never by rendezvous.
      if (rndv || length > uf::kMaxHandshakeBody) {
        return Reject(c, uf::Refusal::kTooLarge, "a handshake frame of " + std::to_string(length) + " bytes");
      }
      const std::string_view body(static_cast<const char*>(data), length);
      auto h = uf::CheckHandshake(header, body, length, &why);
      if (!h.ok()) {
        ++handshake_failures;
        return Reject(c, why, h.status().ToString());
      }
      auto step = c->handshake->OnFrame(h->type, body);
      if (!step.ok()) return Refuse(c, step.status().message());
      SendFrame(c->ep, kAmToClient, uf::HandshakeHeader(step->type, step->body), step->body);
      if (c->handshake->established()) {
        std::shared_ptr<const uf::SessionKeys> keys = c->handshake->keys();
        c->established = true;
        c->caller.client_id = HexOf(c->handshake->client_id());
        c->caller.authenticated = keys != nullptr;
        c->caller.connection = c->number;
        c->opener = std::make_unique<uf::FrameOpener>(
            keys ? std::shared_ptr<const uf::DirectionKeys>(keys, &keys->client_to_server) : nullptr,
            options.max_body_bytes);
        c->sealer = std::make_shared<uf::FrameSealer>(
            keys ? std::shared_ptr<const uf::DirectionKeys>(keys, &keys->server_to_client) : nullptr);
        c->handshake.reset();
        ++handshakes;
        VLOG(1) << "ucx server: connection " << c->number << " from client " << c->caller.client_id
                << (c->caller.authenticated ? " (authenticated)" : " (plain)");
      }
      return;
    }
    auto h = c->opener->Check(header, length, &why);
    if (!h.ok()) return Reject(c, why, h.status().ToString());
    if (h->type != uf::FrameType::kRequest) {
      return Reject(c, uf::Refusal::kMalformed, std::string("a ") + uf::FrameTypeName(h->type) + " frame");
    }
    const size_t bytes = h->body_bytes;
    if (inflight_bytes.fetch_add(bytes) + bytes > options.max_inflight_bytes) {
      inflight_bytes -= bytes;
      ++busy;
      FrameSender(c, *h)(Status::ResourceExhausted("ucx server: busy (" + std::to_string(options.max_inflight_bytes) +
                                                   " request bytes in flight); retry"));
      return;
    }
    const uf::FrameHeader fh = *h;
    if (!ReceiveBody(shard.loop->worker(), data, length, param,
                     [this, c, fh](std::string body) { Dispatch(c, fh, std::move(body)); })) {
      inflight_bytes -= bytes;
      FrameSender(c, fh)(
          Status::ResourceExhausted("ucx server: could not receive a request of " + std::to_string(bytes) + " bytes"));
    }
  }

  // A function that answers request `h` of `c` (any thread): seals the
  // reply there, sends it from the loop thread.
  static std::function<void(Result<std::string>)> FrameSender(std::shared_ptr<ServerConn> c, const uf::FrameHeader& h) {
    const uint64_t call_id = h.call_id;
    return [c, call_id](Result<std::string> r) {
      uf::FrameHeader rh;
      rh.type = uf::FrameType::kReply;
      rh.call_id = call_id;
      std::string body;
      if (r.ok()) {
        body = std::move(*r);
      } else {
        rh.code = static_cast<int32_t>(r.status().code());
        body = r.status().message();
      }
      std::string hb = c->sealer->Seal(rh, &body);
      c->shard->loop->Post([c, hb = std::move(hb), body = std::move(body)]() mutable {
        if (Live(c)) SendFrame(c->ep, kAmToClient, std::move(hb), std::move(body));
      });
    };
  }

  // Loop thread: a request received whole goes to the pool.
  void Dispatch(std::shared_ptr<ServerConn> c, const uf::FrameHeader& h, std::string body) {
    std::lock_guard<std::mutex> lk(mu);
    jobs.push_back([this, c, h, body = std::move(body)]() mutable {
      Result<std::string> plain = c->opener->Open(h, std::move(body));
      if (!plain.ok()) {
        inflight_bytes -= h.body_bytes;
        c->shard->loop->Post([this, c, s = plain.status()] {
          if (Live(c)) Reject(c, uf::Refusal::kBadMac, s.ToString());
        });
        return;
      }
      Result<std::string> r = Status::Internal("ucx server: no answer");
      try {
        r = handler(c->caller, static_cast<uint32_t>(h.code), std::move(*plain));
      } catch (const std::bad_alloc&) {
        r = Status::ResourceExhausted("ucx server: out of memory handling method " + std::to_string(h.code));
      } catch (const std::exception& e) {
        r = Status::Internal("ucx server: method " + std::to_string(h.code) + " failed: " + e.what());
      } catch (...) {
        r = Status::Internal("ucx server: method " + std::to_string(h.code) + " failed");
      }
      ++requests;
      inflight_bytes -= h.body_bytes;
      FrameSender(c, h)(std::move(r));
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
      try {
        job();
      } catch (const std::exception& e) {
        LOG(ERROR) << "ucx server: a request's processing failed: " << e.what();
      }
    }
  }
};

Result<std::unique_ptr<UcxServer>> UcxServer::Start(const std::string& host, int port, Handler handler,
                                                    const UcxServerOptions& options) {
  if (port < 0 || port > 65535) return Status::InvalidArgument("ucx server: port " + std::to_string(port));
  if (options.max_endpoints < 1 || options.threads < 1 || options.max_body_bytes < uf::kTagBytes) {
    return Status::InvalidArgument("ucx server: threads, max_endpoints and max_body_bytes must be positive");
  }
  if (options.workers < 1 || options.workers > 64) {
    return Status::InvalidArgument("ucx server: workers must be in [1, 64], got " + std::to_string(options.workers));
  }
  auto impl = std::make_unique<Impl>();
  impl->handler = std::move(handler);
  impl->options = options;
  if (options.secret) {
    if (options.secret->empty()) return Status::InvalidArgument("ucx server: an empty cluster secret");
    impl->plane_key = options.secret->Derive(options.secret_purpose);
  }
  PENUMBRA_ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(host, port));
  std::string devices = options.net_devices;
  if (devices.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(devices, UcxNetDevices(IpOf(sa), /*route=*/false));
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<UcpContext> context,
                            UcpContext::Create(devices, /*shared_workers=*/options.workers > 1));
  for (int i = 0; i < options.workers; ++i) {
    auto shard = std::make_unique<ServerShard>();
    shard->server = impl.get();
    PENUMBRA_ASSIGN_OR_RETURN(shard->loop, Loop::Create(context));
    PENUMBRA_RETURN_IF_ERROR(SetAmHandler(shard->loop->worker(), kAmToServer, &Impl::OnFrame, shard.get()));
    impl->shards.push_back(std::move(shard));
  }
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof sa;
  lp.conn_handler.cb = &Impl::OnConn;
  lp.conn_handler.arg = impl.get();
  ucs_status_t s = ucp_listener_create(impl->shards[0]->loop->worker(), &lp, &impl->listener);
  if (s != UCS_OK) return UcsError(s, "listen on " + host + ":" + std::to_string(port));
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(impl->listener, &attr);
  if (s != UCS_OK) return UcsError(s, "listener address");
  impl->port = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  for (int i = 0; i < options.threads; ++i) impl->pool.emplace_back([p = impl.get()] { p->Work(); });
  for (auto& shard : impl->shards) {
    shard->loop->SetTick([p = impl.get(), sh = shard.get()] { p->Tick(*sh); });
    shard->loop->Start();
  }
  return std::unique_ptr<UcxServer>(new UcxServer(std::move(impl)));
}

UcxServer::UcxServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxServer::~UcxServer() { Stop(); }
int UcxServer::port() const { return impl_->port; }
bool UcxServer::sealed() const { return !impl_->plane_key.empty(); }

UcxServerStats UcxServer::stats() const {
  const Impl& m = *impl_;
  UcxServerStats s;
  s.connections = m.connections.get();
  s.connections_rejected = m.rejected.get();
  s.handshakes = m.handshakes.get();
  s.handshake_failures = m.handshake_failures.get();
  s.handshake_timeouts = m.handshake_timeouts.get();
  s.frames_rejected = m.frames_rejected.get();
  s.replays = m.replays.get();
  s.requests = m.requests.get();
  s.busy = m.busy.get();
  s.endpoints_open = m.open.load();
  return s;
}

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
  for (auto& shard : m.shards) shard->loop->StopThread();
  // The loops' threads are gone: their workers are this thread's now.
  if (m.listener != nullptr) ucp_listener_destroy(m.listener);
  for (auto& shard : m.shards) {
    for (auto& [ep, c] : shard->conns) CloseEp(ep);
    shard->conns.clear();
  }
  m.open = 0;
  m.shards.clear();
}

// ------------------------------------------------------------------ client

namespace {

// One connection of a client: its endpoint and session. Loop thread, except
// opener->Open (const) and sealer on the callers' threads.
struct ClientConn {
  ucp_ep_h ep = nullptr;
  Clock::time_point started;
  std::unique_ptr<uf::ClientHandshake> handshake;  // until established
  bool ready = false;
  std::unique_ptr<uf::FrameOpener> opener;  // the server's frames
  std::shared_ptr<uf::FrameSealer> sealer;  // frames to the server
};

}  // namespace

struct UcxClient::Impl {
  sockaddr_in address{};
  std::string where;
  UcxClientOptions options;
  std::string plane_key;  // empty: plain
  std::string client_id;  // raw bytes
  std::string client_id_hex;
  std::unique_ptr<Loop> loop;
  std::map<ucp_ep_h, std::shared_ptr<ClientConn>> conns;  // loop thread
  std::shared_ptr<ClientConn> connecting;                 // loop thread: the attempt in progress

  struct Call {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status error;            // set: the call failed
    uf::FrameHeader header;  // else: the reply's checked header
    std::string body;        // ... and its body, to open
    const ClientConn* conn = nullptr;
    // CallInto: a successful reply's body goes to `into` (in place) and,
    // sealed, its tag to `tag`.
    bool wants_into = false;
    std::vector<uf::BodyPart> into;
    uint64_t into_bytes = 0;
    bool in_place = false;   // the body was received into `into`
    bool abandoned = false;  // the caller gave up: nothing may start writing into `into`
    bool receiving = false;  // UCX is writing into `into` now: the caller may not return
    std::array<char, uf::kTagBytes> tag{};
    std::vector<ucp_dt_iov_t> iov;
  };
  std::mutex mu;
  std::condition_variable cv;         // a connection attempt ended
  std::shared_ptr<ClientConn> ready;  // the connection calls use (null: none)
  bool attempt_running = false;
  uint64_t attempts_done = 0;
  Status last_failure;
  std::map<uint64_t, std::shared_ptr<Call>> pending;
  std::atomic<uint64_t> next_id{1};

  static void Finish(const std::shared_ptr<Call>& c, Status error, uf::FrameHeader h = {}, std::string body = {}) {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->done) return;
    c->error = std::move(error);
    c->header = h;
    c->body = std::move(body);
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
  // The calls in flight on `conn` (every call when null) fail.
  void FailCalls(const ClientConn* conn, const Status& why) {
    std::vector<std::shared_ptr<Call>> failed;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (auto it = pending.begin(); it != pending.end();) {
        if (conn == nullptr || it->second->conn == conn) {
          failed.push_back(it->second);
          it = pending.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& c : failed) Finish(c, why);
  }
  // Loop thread: a connection goes (its endpoint closed, its calls failed).
  void Drop(std::shared_ptr<ClientConn> c, Status why) {
    auto it = conns.find(c->ep);
    if (it == conns.end() || it->second != c) return;
    conns.erase(it);
    CloseEp(c->ep);
    bool attempt = false;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (ready == c) ready = nullptr;
      if (connecting == c) {
        attempt = true;
        attempt_running = false;
        ++attempts_done;
        last_failure = why;
      }
    }
    if (attempt) {
      connecting = nullptr;
      cv.notify_all();
    }
    FailCalls(c.get(), why);
  }
  // Loop thread: starts a connection and its handshake.
  void StartConnect() {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
    p.sockaddr.addrlen = sizeof address;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnEpError;
    p.err_handler.arg = this;
    ucp_ep_h ep = nullptr;
    ucs_status_t s = ucp_ep_create(loop->worker(), &p, &ep);
    if (s != UCS_OK) {
      {
        std::lock_guard<std::mutex> lk(mu);
        attempt_running = false;
        ++attempts_done;
        last_failure = UcsError(s, "connect to " + where);
      }
      cv.notify_all();
      return;
    }
    auto c = std::make_shared<ClientConn>();
    c->ep = ep;
    c->started = Clock::now();
    c->handshake = std::make_unique<uf::ClientHandshake>(plane_key, client_id);
    conns[ep] = c;
    connecting = c;
    const uf::HandshakeStep hello = c->handshake->Start();
    if (!SendFrame(ep, kAmToServer, uf::HandshakeHeader(hello.type, hello.body), hello.body)) {
      Drop(c, Status::Unavailable("ucx: sending to " + where + " failed"));
    }
  }
  void Tick() {
    if (connecting && Clock::now() - connecting->started > options.handshake_timeout) {
      Drop(connecting, Status::Unavailable("ucx: the connection to " + where +
                                           " and its handshake did not finish "
                                           "within " +
                                           std::to_string(options.handshake_timeout.count()) + " ms"));
    }
  }
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->conns.find(ep);
    if (it == self->conns.end()) return;
    auto c = it->second;
    const Status why =
        Status::Unavailable("ucx: the connection to " + self->where + " failed: " + ucs_status_string(status));
    self->loop->Post([self, c, why] { self->Drop(c, why); });
  }
  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_len, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    try {
      self->Receive(std::string_view(static_cast<const char*>(header), header_len), data, length, param);
    } catch (const std::exception& e) {
      LOG(ERROR) << "ucx client: a frame's processing failed: " << e.what();
    }
    return UCS_OK;
  }
  // Loop thread: a frame from the server, its header checked first.
  void Receive(std::string_view header, void* data, size_t length, const ucp_am_recv_param_t* param) {
    auto it = conns.find(ReplyEp(param));
    if (it == conns.end()) return;  // a connection closed already
    std::shared_ptr<ClientConn> c = it->second;
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    uf::Refusal why = uf::Refusal::kNone;
    if (!c->ready) {
      if (rndv || length > uf::kMaxHandshakeBody) {
        return Drop(
            c, Status::Corruption("ucx: " + where + " sent a handshake frame of " + std::to_string(length) + " bytes"));
      }
      const std::string_view body(static_cast<const char*>(data), length);
      auto h = uf::CheckHandshake(header, body, length, &why);
      if (!h.ok()) return Drop(c, h.status().WithContext("ucx: the handshake with " + where));
      auto step = c->handshake->OnFrame(h->type, body);
      if (!step.ok()) return Drop(c, step.status().WithContext("ucx: " + where));
      if (step->has_value()) {
        SendFrame(c->ep, kAmToServer, uf::HandshakeHeader((*step)->type, (*step)->body), (*step)->body);
      }
      if (c->handshake->established()) {
        std::shared_ptr<const uf::SessionKeys> keys = c->handshake->keys();
        c->opener = std::make_unique<uf::FrameOpener>(
            keys ? std::shared_ptr<const uf::DirectionKeys>(keys, &keys->server_to_client) : nullptr,
            options.max_body_bytes);
        c->sealer = std::make_shared<uf::FrameSealer>(
            keys ? std::shared_ptr<const uf::DirectionKeys>(keys, &keys->client_to_server) : nullptr);
        c->handshake.reset();
        c->ready = true;
        {
          std::lock_guard<std::mutex> lk(mu);
          ready = c;
          attempt_running = false;
          ++attempts_done;
          last_failure = Status::OK();
        }
        connecting = nullptr;
        cv.notify_all();
      }
      return;
    }
    auto h = c->opener->Check(header, length, &why);
    if (!h.ok() || h->type != uf::FrameType::kReply) {
      const Status s =
          h.ok() ? Status::Corruption(std::string("a ") + uf::FrameTypeName(h->type) + " frame") : h.status();
      LOG(WARNING) << "ucx client: a frame from " << where << " refused (" << s << "); disconnected";
      return Drop(c, Status::Unavailable("ucx: a frame from " + where + " failed its checks (" + s.ToString() +
                                         "); disconnected"));
    }
    auto call = Take(h->call_id);
    if (!call) return;  // its caller gave up (deadline): the body is not received
    const uf::FrameHeader fh = *h;
    if (call->wants_into && fh.code == 0) return ReceiveInto(call, fh, data, length, param);
    if (!ReceiveBody(loop->worker(), data, length, param,
                     [call, fh](std::string body) { Finish(call, Status::OK(), fh, std::move(body)); })) {
      Finish(call, Status::ResourceExhausted("ucx: could not receive a reply of " + std::to_string(length) +
                                             " bytes from " + where));
    }
  }

  // Loop thread: a successful reply to a CallInto: its body straight into
  // the caller's parts (and tag), once its size is the one expected.
  void ReceiveInto(const std::shared_ptr<Call>& call, const uf::FrameHeader& h, void* data, size_t length,
                   const ucp_am_recv_param_t* param) {
    const uint64_t expected = call->into_bytes + (h.sealed ? uf::kTagBytes : 0);
    if (h.body_bytes != expected) {
      // Refused before anything is received (a short or oversized reply).
      return Finish(call, Status::Corruption("ucx: a reply from " + where + " of " + std::to_string(h.body_bytes) +
                                             " bytes, expected " + std::to_string(expected)));
    }
    {
      std::lock_guard<std::mutex> lk(call->mu);
      if (call->abandoned || call->done) return;
      call->receiving = true;
      call->iov.clear();
      for (const uf::BodyPart& p : call->into) {
        if (p.size > 0) call->iov.push_back({p.data, p.size});
      }
      if (h.sealed) call->iov.push_back({call->tag.data(), uf::kTagBytes});
    }
    auto done = [call, h](Status s) {
      std::lock_guard<std::mutex> lk(call->mu);
      call->receiving = false;
      if (!call->done) {
        call->error = std::move(s);
        call->header = h;
        call->in_place = call->error.ok();
        call->done = true;
      }
      call->cv.notify_all();
    };
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      // Eager: the bytes are here already; one copy into place.
      const char* from = static_cast<const char*>(data);
      for (const ucp_dt_iov_t& v : call->iov) {
        std::memcpy(v.buffer, from, v.length);
        from += v.length;
      }
      return done(Status::OK());
    }
    auto* holder = new std::function<void(Status)>(done);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    p.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
      std::unique_ptr<std::function<void(Status)>> f(static_cast<std::function<void(Status)>*>(user_data));
      (*f)(status == UCS_OK
               ? Status::OK()
               : Status::Unavailable(std::string("ucx: receiving a reply failed: ") + ucs_status_string(status)));
      ucp_request_free(request);
    };
    p.user_data = holder;
    p.datatype = ucp_dt_make_iov();
    void* r = ucp_am_recv_data_nbx(loop->worker(), data, call->iov.data(), call->iov.size(), &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      std::unique_ptr<std::function<void(Status)>> f(holder);
      (*f)(r == nullptr ? Status::OK()
                        : Status::Unavailable(std::string("ucx: receiving a reply from " + where + " failed: ") +
                                              ucs_status_string(UCS_PTR_STATUS(r))));
    }
  }

  // One call on this lane (Call and CallInto): into null, the body comes
  // back as the result; else it lands in *into and the result is empty.
  Result<std::string> Do(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout,
                         const std::span<const uf::BodyPart>* into) {
    const auto deadline = Clock::now() + timeout;
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ClientConn> conn, Ready(deadline));
    const uint64_t id = next_id++;
    uf::FrameHeader h;
    h.type = uf::FrameType::kRequest;
    h.call_id = id;
    h.code = static_cast<int32_t>(method);
    std::string body(payload);
    std::string header = conn->sealer->Seal(h, &body);  // on this thread
    auto call = std::make_shared<Call>();
    call->conn = conn.get();
    if (into != nullptr) {
      call->wants_into = true;
      call->into.assign(into->begin(), into->end());
      for (const uf::BodyPart& p : *into) call->into_bytes += p.size;
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      pending[id] = call;
    }
    loop->Post([this, conn, id, header = std::move(header), body = std::move(body)]() mutable {
      auto it = conns.find(conn->ep);
      Status s;
      if (it == conns.end() || it->second != conn) {
        s = Status::Unavailable("ucx: the connection to " + where + " closed");
      } else if (!SendFrame(conn->ep, kAmToServer, std::move(header), std::move(body))) {
        s = Status::Unavailable("ucx: sending to " + where + " failed");
      }
      if (!s.ok()) {
        if (auto c = Take(id)) Finish(c, s);
      }
    });
    std::unique_lock<std::mutex> lk(call->mu);
    // Done, and UCX no longer writes into the caller's parts.
    if (!call->cv.wait_until(lk, deadline, [&] { return call->done && !call->receiving; })) {
      call->abandoned = true;
      if (call->receiving) {
        // The reply is arriving into the caller's buffers: its connection is
        // closed (ending the transfer), and the call waits for UCX to let go.
        // Later calls use a new connection.
        {
          std::lock_guard<std::mutex> ready_lk(mu);
          if (ready == conn) ready = nullptr;
        }
        loop->Post([this, conn] {
          Drop(conn, Status::Unavailable("ucx: a reply from " + where +
                                         " was still arriving past its call's deadline; the connection was closed"));
        });
        call->cv.wait(lk, [&] { return !call->receiving; });
      }
      lk.unlock();
      Take(id);  // a late reply is dropped
      return Status::DeadlineExceeded("ucx: no reply from " + where + " within " + std::to_string(timeout.count()) +
                                      " ms");
    }
    if (!call->error.ok()) return call->error;
    const uf::FrameHeader rh = call->header;
    if (call->in_place) {
      const std::string_view tag(call->tag.data(), rh.sealed ? uf::kTagBytes : 0);
      lk.unlock();
      const Status opened = conn->opener->OpenInPlace(rh, *into, tag);  // on this thread
      if (!opened.ok()) return opened.WithContext("ucx: a reply from " + where);
      return std::string();
    }
    std::string raw = std::move(call->body);
    lk.unlock();
    Result<std::string> body_or = conn->opener->Open(rh, std::move(raw));  // on this thread
    if (!body_or.ok()) return body_or.status().WithContext("ucx: a reply from " + where);
    if (rh.code < 0 || rh.code > static_cast<int32_t>(StatusCode::kPermissionDenied)) {
      return Status::Internal("ucx: a reply from " + where + " carries an unknown status " + std::to_string(rh.code) +
                              ": " + *body_or);
    }
    if (rh.code != 0) return Status(static_cast<StatusCode>(rh.code), std::move(*body_or));
    if (into != nullptr) {
      // A successful reply to a CallInto always goes in place (ReceiveInto).
      return Status::Internal("ucx: a reply from " + where + " was not received in place");
    }
    return std::move(*body_or);
  }

  // The lanes of the connection in use (ucp_ep_print_info), on the loop thread.
  std::vector<std::string> Transports() {
    auto out = std::make_shared<std::promise<std::vector<std::string>>>();
    std::future<std::vector<std::string>> f = out->get_future();
    loop->Post([this, out] {
      std::vector<std::string> lanes;
      std::shared_ptr<ClientConn> c;
      {
        std::lock_guard<std::mutex> lk(mu);
        c = ready;
      }
      if (c) {
        char* text = nullptr;
        size_t size = 0;
        FILE* stream = open_memstream(&text, &size);
        if (stream != nullptr) {
          ucp_ep_print_info(c->ep, stream);
          std::fclose(stream);
          std::string line;
          for (const char* p = text; p != nullptr && p < text + size; ++p) {
            if (*p != '\n') {
              line.push_back(*p);
              continue;
            }
            const size_t at = line.find("lane[");
            if (at != std::string::npos) lanes.push_back(line.substr(at));
            line.clear();
          }
          std::free(text);
        }
      }
      out->set_value(std::move(lanes));
    });
    return f.get();
  }

  // A ready connection, connecting when there is none, by `deadline`.
  Result<std::shared_ptr<ClientConn>> Ready(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lk(mu);
    if (ready) return ready;
    const uint64_t seen = attempts_done;
    if (!attempt_running) {
      attempt_running = true;
      loop->Post([this] { StartConnect(); });
    }
    // The attempt running may have begun before this call: its outcome is
    // this call's.
    cv.wait_until(lk, deadline, [&] { return ready != nullptr || attempts_done != seen; });
    if (ready) return ready;
    if (attempts_done != seen) return last_failure;
    return Status::DeadlineExceeded("ucx: connecting to " + where + " did not finish within the call's deadline");
  }
};

Result<std::unique_ptr<UcxClient>> UcxClient::Connect(const std::string& host, int port,
                                                      const UcxClientOptions& options) {
  if (port <= 0 || port > 65535) return Status::InvalidArgument("ucx client: port " + std::to_string(port));
  if (options.connections < 1 || options.connections > 64) {
    return Status::InvalidArgument("ucx client: connections must be in [1, 64], got " +
                                   std::to_string(options.connections));
  }
  PENUMBRA_ASSIGN_OR_RETURN(sockaddr_in address, Resolve(host, port));
  std::string plane_key;
  if (options.secret) {
    if (options.secret->empty()) return Status::InvalidArgument("ucx client: an empty cluster secret");
    plane_key = options.secret->Derive(options.secret_purpose);
  }
  // One identity for every connection: the server binds what it hands out
  // (readers, uploads) to it, so any lane may use them.
  const std::string client_id = RandomBytes(uf::kClientIdBytes);
  std::string devices = options.net_devices;
  if (devices.empty()) {
    Result<std::string> d = UcxNetDevices(IpOf(address), /*route=*/true);
    if (d.ok()) {
      devices = *d;
    } else {
      LOG(WARNING) << "ucx client: " << d.status() << "; UCX may listen on every device";
    }
  }
  // One context, a worker per connection (each on its own thread).
  PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<UcpContext> context,
                            UcpContext::Create(devices, /*shared_workers=*/options.connections > 1));
  std::vector<std::unique_ptr<Impl>> lanes;
  for (int i = 0; i < options.connections; ++i) {
    auto impl = std::make_unique<Impl>();
    impl->address = address;
    impl->where = host + ":" + std::to_string(port);
    impl->options = options;
    impl->plane_key = plane_key;
    impl->client_id = client_id;
    impl->client_id_hex = HexOf(client_id);
    PENUMBRA_ASSIGN_OR_RETURN(impl->loop, Loop::Create(context));
    PENUMBRA_RETURN_IF_ERROR(SetAmHandler(impl->loop->worker(), kAmToClient, &Impl::OnFrame, impl.get()));
    impl->loop->SetTick([p = impl.get()] { p->Tick(); });
    impl->loop->Start();
    lanes.push_back(std::move(impl));
  }
  return std::unique_ptr<UcxClient>(new UcxClient(std::move(lanes)));
}

UcxClient::UcxClient(std::vector<std::unique_ptr<Impl>> lanes) : lanes_(std::move(lanes)) {}

UcxClient::~UcxClient() {
  for (auto& lane : lanes_) {
    Impl& m = *lane;
    m.loop->StopThread();
    for (auto& [ep, c] : m.conns) CloseEp(ep);
    m.conns.clear();
    m.FailCalls(nullptr, Status::Cancelled("ucx: the client was closed"));
    m.loop.reset();
  }
}

const std::string& UcxClient::client_id() const { return lanes_.front()->client_id_hex; }

int UcxClient::connections() const { return static_cast<int>(lanes_.size()); }

UcxClient::Impl& UcxClient::Lane() { return *lanes_[next_lane_.fetch_add(1) % lanes_.size()]; }

std::vector<std::string> UcxClient::Transports() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < lanes_.size(); ++i) {
    for (const std::string& l : lanes_[i]->Transports()) out.push_back("connection " + std::to_string(i) + " " + l);
  }
  return out;
}

Result<std::string> UcxClient::Call(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout) {
  return Lane().Do(method, payload, timeout, nullptr);
}

Status UcxClient::CallInto(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout,
                           std::span<const ucx_frame::BodyPart> into) {
  return Lane().Do(method, payload, timeout, &into).status();
}

}  // namespace penumbra::transport
