#include "transport/context_group.h"

#include <nlohmann/json.hpp>

#include "common/process.h"
#include "transport/collective.h"

namespace penumbra {

void AddContextGroupFlags(Args& a) {
  a.Flag("cp-world", "context parallel: ranks holding the sequence, one process each (default 1: none)")
      .Flag("cp-rank", "context parallel: this process's rank in [0, --cp-world)")
      .Flag("cp-rendezvous", "context parallel: HOST:PORT where rank 0 listens (rank 0: port 0 lets the OS pick)")
      .Flag("cp-port-file", "context parallel, rank 0: write {\"port\": N} here once listening")
      .Flag("cp-timeout-s", "context parallel: seconds to wait for the other ranks, to join and at every "
                            "exchange (default 120)");
}

Result<std::unique_ptr<Collective>> JoinContextGroup(const Args& a, Backend* backend) {
  PENUMBRA_ASSIGN_OR_RETURN(int64_t world, a.GetIntIn("cp-world", 1, 1, 4096));
  if (world == 1) {
    for (const char* f : {"cp-rank", "cp-rendezvous", "cp-port-file"}) {
      if (a.Has(f)) return Status::InvalidArgument(std::string("--") + f + " needs --cp-world > 1");
    }
    return std::unique_ptr<Collective>();
  }
  if (!a.Has("cp-rank")) return Status::InvalidArgument("--cp-world " + std::to_string(world) + " needs --cp-rank");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t rank, a.GetIntIn("cp-rank", 0, 0, world - 1));
  if (!a.Has("cp-rendezvous")) return Status::InvalidArgument("--cp-world needs --cp-rendezvous HOST:PORT");
  PENUMBRA_ASSIGN_OR_RETURN(double timeout, a.GetDoubleIn("cp-timeout-s", 120.0, 0.0, 86400.0, /*lo_open=*/true));
  CollectiveOptions o;
  o.rank = static_cast<int>(rank);
  o.world = static_cast<int>(world);
  o.rendezvous = a.Get("cp-rendezvous");
  o.timeout_s = timeout;
  std::string host;
  int port = 0;
  if (Status s = ParseRendezvous(o.rendezvous, &host, &port); !s.ok()) {
    return Status::InvalidArgument("--cp-rendezvous: " + s.message());
  }
  if (rank > 0 && port == 0) return Status::InvalidArgument("--cp-rendezvous: ranks > 0 need rank 0's port");
  if (a.Has("cp-port-file") && rank != 0) return Status::InvalidArgument("--cp-port-file is rank 0's");
  std::unique_ptr<CollectiveListener> listener;
  if (rank == 0) {
    PENUMBRA_ASSIGN_OR_RETURN(listener, CollectiveListener::Bind(host, port));
    if (a.Has("cp-port-file")) {
      nlohmann::json j;
      j["port"] = listener->port();
      PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(a.Get("cp-port-file"), j.dump() + "\n"));
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<Collective> group, ConnectCollective(backend, o, std::move(listener)));
  LOG(INFO) << "context group: rank " << rank << " of " << world << " joined (data plane: "
            << (backend != nullptr && backend->device() == Device::kCUDA ? "NCCL" : "TCP") << ")";
  return group;
}

}  // namespace penumbra
