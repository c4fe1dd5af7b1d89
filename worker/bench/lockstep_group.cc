#include "worker/bench/lockstep_group.h"

#include <string>

namespace penumbra::shadowkv_check {

class LockstepGroup::Rank final : public Collective {
 public:
  Rank(LockstepGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return group_->world(); }
  Status AllGather(const void* send, void* recv, size_t bytes) override {
    return group_->Make(rank_, Call{Op::kAllGather, send, recv, bytes, 0});
  }
  Status Broadcast(void* buf, size_t bytes, int root) override {
    if (root < 0 || root >= world()) return Status::InvalidArgument("lockstep group: broadcast root out of range");
    return group_->Make(rank_, Call{Op::kBroadcast, buf, buf, bytes, root});
  }
  Status BroadcastHost(void*, size_t, int) override { return HostPlane("BroadcastHost"); }
  Status AllGatherHost(const void*, void*, size_t) override { return HostPlane("AllGatherHost"); }
  Status Barrier() override { return HostPlane("Barrier"); }

 private:
  static Status HostPlane(const char* op) {
    return Status::Unimplemented(std::string("lockstep group: ") + op +
                                 " must complete inside one rank's call, which one thread holding every rank cannot");
  }
  LockstepGroup* group_;
  int rank_;
};

LockstepGroup::LockstepGroup(Backend& backend, int world) : backend_(backend) {
  for (int r = 0; r < world; ++r) ranks_.push_back(std::make_unique<Rank>(this, r));
  pending_.resize(static_cast<size_t>(world));
}

LockstepGroup::~LockstepGroup() = default;

Collective& LockstepGroup::rank(int r) { return *ranks_[static_cast<size_t>(r)]; }

Status LockstepGroup::Make(int r, const Call& c) {
  if (!broken_.ok()) return broken_;
  const Call& mine = pending_[static_cast<size_t>(r)];
  if (mine.op != Op::kNone) {
    broken_ = Status::FailedPrecondition("lockstep group: rank " + std::to_string(r) +
                                         " made a second call before every rank made its first");
    return broken_;
  }
  for (const Call& other : pending_) {
    if (other.op != Op::kNone && (other.op != c.op || other.bytes != c.bytes || other.root != c.root)) {
      broken_ = Status::FailedPrecondition("lockstep group: rank " + std::to_string(r) +
                                           "'s call does not match the round's (another operation, size or root)");
      return broken_;
    }
  }
  pending_[static_cast<size_t>(r)] = c;
  if (++made_ < world()) return Status::OK();
  Status st = Complete();
  for (Call& p : pending_) p = Call{};
  made_ = 0;
  if (!st.ok()) broken_ = st;
  return st;
}

Status LockstepGroup::Complete() {
  const int W = world();
  for (int q = 0; q < W; ++q) {
    const Call& dst = pending_[static_cast<size_t>(q)];
    if (dst.bytes == 0) continue;
    for (int p = 0; p < W; ++p) {
      const Call& src = pending_[static_cast<size_t>(p)];
      void* to = nullptr;
      const void* from = nullptr;
      if (dst.op == Op::kAllGather) {
        to = static_cast<char*>(dst.recv) + static_cast<size_t>(p) * dst.bytes;
        from = src.send;
      } else if (p == dst.root && q != dst.root) {
        to = dst.recv;
        from = src.send;
      }
      if (to != nullptr && to != from) PENUMBRA_RETURN_IF_ERROR(backend_.CopyDeviceToDevice(to, from, dst.bytes));
    }
  }
  return Status::OK();
}

}  // namespace penumbra::shadowkv_check
