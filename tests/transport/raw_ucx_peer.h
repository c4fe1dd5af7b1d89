// A UCX peer that speaks the UCX plane's frames by hand (tests only): it
// connects to a UcxServer, does the handshake honestly (ClientHandshake) or
// not at all, and sends any bytes as a frame: forged headers, tampered
// bodies, replays, oversized lengths. Single-threaded: its calls drive its
// own UCX worker.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "common/crypto.h"
#include "transport/ucx_frame.h"

namespace penumbra::testing {

class RawUcxPeer {
 public:
  struct Frame {
    std::string header, body;
  };

  // Connects (the UCX connection only: nothing is sent). Null on failure.
  static std::unique_ptr<RawUcxPeer> Connect(const std::string& host, int port) {
    auto p = std::unique_ptr<RawUcxPeer>(new RawUcxPeer());
    ucp_config_t* cfg = nullptr;
    if (ucp_config_read(nullptr, nullptr, &cfg) != UCS_OK) return nullptr;
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    const ucs_status_t s = ucp_init(&params, cfg, &p->context_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return nullptr;
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(p->context_, &wp, &p->worker_) != UCS_OK) return nullptr;
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = transport::ucx_frame::kAmToClient;
    hp.cb = &RawUcxPeer::OnFrame;
    hp.arg = p.get();
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    if (ucp_worker_set_am_recv_handler(p->worker_, &hp) != UCS_OK) return nullptr;
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return nullptr;
    std::memcpy(&p->address_, res->ai_addr, sizeof p->address_);
    freeaddrinfo(res);
    p->address_.sin_port = htons(static_cast<uint16_t>(port));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&p->address_);
    ep.sockaddr.addrlen = sizeof p->address_;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &RawUcxPeer::OnError;
    ep.err_handler.arg = p.get();
    if (ucp_ep_create(p->worker_, &ep, &p->ep_) != UCS_OK) return nullptr;
    return p;
  }

  ~RawUcxPeer() {
    if (ep_ != nullptr) {
      ucp_request_param_t cp{};
      cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* r = ucp_ep_close_nbx(ep_, &cp);
      if (r != nullptr && UCS_PTR_IS_PTR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
        ucp_request_free(r);
      }
    }
    if (worker_ != nullptr) {
      for (int i = 0; i < 100; ++i) ucp_worker_progress(worker_);
      ucp_worker_destroy(worker_);
    }
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  // Sends one frame (header bytes, body) to the server and waits until UCX
  // has taken it (or `timeout`); false when the send failed.
  bool Send(const std::string& header, const std::string& body,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
    if (failed_) return false;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    void* r = ucp_am_send_nbx(ep_, transport::ucx_frame::kAmToServer, header.data(), header.size(), body.data(),
                              body.size(), &p);
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r)) return false;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ucs_status_t s;
    while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
      Progress();
    }
    ucp_request_free(r);  // still in flight: UCX completes and frees it
    return s == UCS_OK;
  }

  // The next frame from the server, or nothing after `timeout` or once the
  // connection failed.
  std::optional<Frame> Receive(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (frames_.empty() && !failed_ && std::chrono::steady_clock::now() < deadline) Progress();
    if (frames_.empty()) return std::nullopt;
    Frame f = std::move(frames_.front());
    frames_.pop_front();
    return f;
  }

  // True once the server closed the connection (within `timeout`).
  bool WaitClosed(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!failed_ && std::chrono::steady_clock::now() < deadline) Progress();
    return failed_;
  }
  bool failed() const { return failed_; }

  // The honest handshake with `plane_key` (empty: plain) as `client_id`
  // (16 bytes): the session's keys (null when plain), or the error.
  Result<std::shared_ptr<const transport::ucx_frame::SessionKeys>> Handshake(
      const std::string& plane_key, const std::string& client_id,
      std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
    transport::ucx_frame::ClientHandshake hs(plane_key, client_id);
    transport::ucx_frame::HandshakeStep step = hs.Start();
    for (;;) {
      if (!Send(transport::ucx_frame::HandshakeHeader(step.type, step.body), step.body)) {
        return Status::Unavailable("raw peer: send failed");
      }
      std::optional<Frame> f = Receive(timeout);
      if (!f) return Status::Unavailable("raw peer: no answer to the handshake");
      PENUMBRA_ASSIGN_OR_RETURN(transport::ucx_frame::FrameHeader h,
                                transport::ucx_frame::CheckHandshake(f->header, f->body, f->body.size()));
      PENUMBRA_ASSIGN_OR_RETURN(std::optional<transport::ucx_frame::HandshakeStep> next, hs.OnFrame(h.type, f->body));
      if (hs.established()) return hs.keys();
      if (!next) return Status::Internal("raw peer: the handshake stalled");
      step = std::move(*next);
    }
  }

 private:
  RawUcxPeer() = default;
  void Progress() {
    if (ucp_worker_progress(worker_) == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  static void OnError(void* arg, ucp_ep_h, ucs_status_t) { static_cast<RawUcxPeer*>(arg)->failed_ = true; }
  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_len, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<RawUcxPeer*>(arg);
    Frame f;
    f.header.assign(static_cast<const char*>(header), header_len);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      f.body.assign(static_cast<const char*>(data), length);
      self->frames_.push_back(std::move(f));
      return UCS_OK;
    }
    // Rendezvous: queued when the data has come (no progress inside a callback).
    auto* in = new Incoming{self, std::move(f)};
    in->frame.body.resize(length);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &RawUcxPeer::OnData;
    p.user_data = in;
    void* r = ucp_am_recv_data_nbx(self->worker_, data, in->frame.body.data(), length, &p);
    if (r == nullptr) {
      self->frames_.push_back(std::move(in->frame));
      delete in;
    } else if (UCS_PTR_IS_ERR(r)) {
      delete in;
    }
    return UCS_OK;
  }
  struct Incoming {
    RawUcxPeer* self;
    Frame frame;
  };
  static void OnData(void* request, ucs_status_t status, size_t, void* user_data) {
    std::unique_ptr<Incoming> in(static_cast<Incoming*>(user_data));
    if (status == UCS_OK) in->self->frames_.push_back(std::move(in->frame));
    ucp_request_free(request);
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  sockaddr_in address_{};
  bool failed_ = false;
  std::deque<Frame> frames_;
};

}  // namespace penumbra::testing
