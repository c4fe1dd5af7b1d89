#include "worker/parallel/context_group.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "common/process.h"
#include "worker/parallel/process_group.h"

namespace penumbra {

void AddContextGroupFlags(Args& a) {
  a.Flag("cp-world", "context parallel: ranks holding the sequence, one process each (default 1: none)")
      .Flag("cp-rank", "context parallel: this process's rank in [0, --cp-world)")
      .Flag("cp-rendezvous", "context parallel: HOST:PORT where rank 0 listens (rank 0: port 0 lets the OS pick)")
      .Flag("cp-port-file", "context parallel, rank 0: write {\"port\": N} here once listening")
      .Flag("cp-timeout-s",
            "context parallel: seconds to wait for the other ranks, to join and at every "
            "exchange (default 120)")
      .Flag("cp-secret-file",
            "context parallel: file of the group's secret (32+ hex digits, mode 600); every "
            "rank proves it holds the same one (with the --tls-* certificates, or alone)");
}

Result<std::string> LoadGroupSecret(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::InvalidArgument("group secret " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 077) != 0) {
    return Status::InvalidArgument("group secret " + path + ": readable by group or others; chmod 600 it");
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  Result<std::string> bytes = ParseGroupSecret(text);
  if (!bytes.ok()) return Status::InvalidArgument("group secret " + path + ": " + bytes.status().message());
  return bytes;
}

Result<std::string> ParseGroupSecret(const std::string& text) {
  const size_t b = text.find_first_not_of(" \t\r\n");
  const size_t e = text.find_last_not_of(" \t\r\n");
  const std::string hex = b == std::string::npos ? "" : text.substr(b, e - b + 1);
  if (hex.size() < 32 || hex.size() % 2 != 0 || hex.size() > 1024 ||
      hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
    return Status::InvalidArgument("not an even number of hex digits, 32 to 1024 (128 bits or more)");
  }
  std::string bytes(hex.size() / 2, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return bytes;
}

Result<std::unique_ptr<Collective>> JoinContextGroup(const Args& a, Backend* backend,
                                                     const transport::ProcessSecurity& security) {
  PENUMBRA_ASSIGN_OR_RETURN(int64_t world, a.GetIntIn("cp-world", 1, 1, 4096));
  if (world == 1) {
    for (const char* f : {"cp-rank", "cp-rendezvous", "cp-port-file", "cp-secret-file"}) {
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
  o.security.tls = security.tls;
  o.security.insecure = security.insecure;
  if (a.Has("cp-secret-file")) {
    auto secret = LoadGroupSecret(a.Get("cp-secret-file"));
    if (!secret.ok()) return Status::InvalidArgument("--cp-secret-file: " + secret.status().message());
    o.security.group_secret = std::move(*secret);
  }
  std::string host;
  int port = 0;
  if (Status s = ParseRendezvous(o.rendezvous, &host, &port); !s.ok()) {
    return Status::InvalidArgument("--cp-rendezvous: " + s.message());
  }
  if (rank > 0 && port == 0) return Status::InvalidArgument("--cp-rendezvous: ranks > 0 need rank 0's port");
  if (a.Has("cp-port-file") && rank != 0) return Status::InvalidArgument("--cp-port-file is rank 0's");
  // Refused before anything listens (the group checks again, and logs what
  // it allows).
  if (!o.security.tls.enabled() && !o.security.insecure && !transport::IsLoopbackHost(host)) {
    const Status s = transport::CheckPlaintextBind("--cp-rendezvous", host, false, false);
    if (!s.ok()) return s;
  }
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
  LOG(INFO) << "context group: rank " << rank << " of " << world
            << " joined (data plane: " << (backend != nullptr && backend->device() == Device::kCUDA ? "NCCL" : "TCP")
            << (o.security.tls.enabled() ? ", mutual TLS" : ", plaintext")
            << (o.security.group_secret.empty() ? "" : ", group secret") << ")";
  return group;
}

}  // namespace penumbra
