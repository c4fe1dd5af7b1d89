// An in-process Collective for tests: the ranks are threads of one process
// (CPU backends: "device" memory is host memory), meeting at a barrier for
// every call. The multi-process group (TCP, NCCL) is worker/parallel/process_group.h's.
#pragma once

#include <barrier>
#include <cstring>
#include <memory>
#include <vector>

#include "worker/engine/collective.h"

namespace penumbra::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world) : world_(world), barrier_(world), slots_(static_cast<size_t>(world)) {}
  // Rank r's view of the group (used by one thread).
  std::unique_ptr<Collective> Member(int rank) { return std::make_unique<Rank>(this, rank); }

 private:
  class Rank final : public Collective {
   public:
    Rank(ThreadGroup* g, int rank) : g_(g), rank_(rank) {}
    int rank() const override { return rank_; }
    int world() const override { return g_->world_; }
    Status AllGather(const void* send, void* recv, size_t bytes) override {
      g_->slots_[rank_] = send;
      g_->barrier_.arrive_and_wait();
      for (int j = 0; j < g_->world_; ++j) {
        char* dst = static_cast<char*>(recv) + j * bytes;
        // A send aliasing its own place in recv (the contract allows it) is
        // already there, and the other ranks are reading it.
        if (dst == g_->slots_[j]) continue;
        std::memmove(dst, g_->slots_[j], bytes);
      }
      g_->barrier_.arrive_and_wait();
      return Status::OK();
    }
    Status Broadcast(void* buf, size_t bytes, int root) override {
      g_->slots_[rank_] = buf;
      g_->barrier_.arrive_and_wait();
      if (rank_ != root) std::memcpy(buf, g_->slots_[root], bytes);
      g_->barrier_.arrive_and_wait();
      return Status::OK();
    }
    Status BroadcastHost(void* buf, size_t bytes, int root) override { return Broadcast(buf, bytes, root); }
    Status AllGatherHost(const void* send, void* recv, size_t bytes) override { return AllGather(send, recv, bytes); }
    Status Barrier() override {
      g_->barrier_.arrive_and_wait();
      return Status::OK();
    }

   private:
    ThreadGroup* g_;
    int rank_;
  };

  int world_;
  std::barrier<> barrier_;
  std::vector<const void*> slots_;
};

}  // namespace penumbra::testing
