// `penumbra cert`: the certificates and the shared secret of a deployment
// (transport/certs.h, transport/tls.h).
//
//   penumbra cert init DIR [--topology configs/service.yaml] [--hosts H,...] [--days N] [--force]
//     a CA (DIR/ca.pem, DIR/ca.key), one certificate per process of the
//     topology (DIR/<name>.pem and .key: the coordinator, each worker and
//     store node, by role), one of role admin (DIR/admin.*: Prometheus and
//     operators) and one of role client (DIR/client.*), and the cluster
//     secret (DIR/cluster.secret). Each server certificate names its
//     topology host, 127.0.0.1, localhost and --hosts.
//   penumbra cert issue DIR --role R --name N [--hosts H,...] [--days N]
//     one more certificate from DIR's CA (DIR/<name>.pem and .key).
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

#include "common/args.h"
#include "common/crypto.h"
#include "common/file.h"
#include "coordinator/cli/service_cli.h"
#include "transport/certs.h"
#include "transport/tls.h"

namespace penumbra {
namespace {

std::vector<std::string> SplitHosts(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string h;
  while (std::getline(ss, h, ',')) {
    if (!h.empty()) out.push_back(h);
  }
  return out;
}

// The names a server certificate carries for `host` (a wildcard bind
// address names no host: the --hosts list must then hold the machine's).
std::vector<std::string> ServerHosts(const std::string& host, const std::vector<std::string>& extra) {
  std::vector<std::string> hosts;
  std::set<std::string> seen;
  auto add = [&](const std::string& h) {
    if (!h.empty() && h != "0.0.0.0" && h != "::" && seen.insert(h).second) hosts.push_back(h);
  };
  add(host);
  add("127.0.0.1");
  add("localhost");
  for (const auto& h : extra) add(h);
  return hosts;
}

Status CheckName(const std::string& name) {
  if (name.empty() || name.find_first_of("/\\ \t\n") != std::string::npos || name == "ca" || name == "cluster") {
    return Status::InvalidArgument("certificate name '" + name +
                                   "' must be non-empty, without / or spaces, and "
                                   "not ca or cluster");
  }
  return Status::OK();
}

Status Issue(const std::string& dir, const transport::CertificateSpec& spec) {
  PENUMBRA_RETURN_IF_ERROR(CheckName(spec.name));
  const std::string cert = JoinPath(dir, spec.name + ".pem"), key = JoinPath(dir, spec.name + ".key");
  PENUMBRA_RETURN_IF_ERROR(
      transport::IssueCertificate(JoinPath(dir, "ca.pem"), JoinPath(dir, "ca.key"), spec, cert, key));
  std::string hosts;
  for (const auto& h : spec.hosts) hosts += (hosts.empty() ? "" : ",") + h;
  std::printf("  %-14s role %-11s %s%s\n", (spec.name + ".pem").c_str(), spec.role.c_str(),
              hosts.empty() ? "" : "hosts ", hosts.c_str());
  return Status::OK();
}

Status Init(int argc, char** argv) {
  Args a;
  a.Flag("topology", "the service topology whose processes get certificates (default configs/service.yaml)")
      .Flag("hosts", "more host names or addresses every server certificate names, comma-separated")
      .Flag("days", "how long the certificates are valid (default 825)")
      .Switch("force", "replace what DIR holds");
  if (argc < 4 || std::string(argv[3]).rfind("--", 0) == 0) {
    return Status::InvalidArgument("usage: penumbra cert init DIR [--topology F] [--hosts H,...] [--days N] [--force]");
  }
  const std::string dir = argv[3];
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 4));
  PENUMBRA_ASSIGN_OR_RETURN(ServiceTopology t, LoadServiceTopology(a.Get("topology", "configs/service.yaml")));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t days, a.GetIntIn("days", 825, 1, 36500));
  const std::vector<std::string> extra = SplitHosts(a.Get("hosts"));
  std::error_code ec;
  if (std::filesystem::exists(JoinPath(dir, "ca.pem")) && !a.Has("force")) {
    return Status::InvalidArgument(dir + " already holds a CA (ca.pem); --force replaces everything there");
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create " + dir + ": " + ec.message());
  ::chmod(dir.c_str(), 0700);
  PENUMBRA_RETURN_IF_ERROR(
      transport::CreateCertificateAuthority(JoinPath(dir, "ca.pem"), JoinPath(dir, "ca.key"), "penumbra"));
  std::printf(
      "penumbra cert init %s:\n  %-14s the cluster CA (ca.key signs certificates: keep it off the service's "
      "machines)\n",
      dir.c_str(), "ca.pem");
  auto spec = [&](const char* role, const std::string& name, std::vector<std::string> hosts) {
    transport::CertificateSpec s;
    s.role = role;
    s.name = name;
    s.hosts = std::move(hosts);
    s.days = static_cast<int>(days);
    return s;
  };
  PENUMBRA_RETURN_IF_ERROR(Issue(dir, spec(transport::role::kCoordinator, "coordinator", ServerHosts(t.host, extra))));
  for (const auto& w : t.workers) {
    PENUMBRA_RETURN_IF_ERROR(Issue(dir, spec(transport::role::kWorker, w.name, ServerHosts(w.host, extra))));
  }
  for (const auto& n : t.store_nodes) {
    PENUMBRA_RETURN_IF_ERROR(Issue(dir, spec(transport::role::kStore, n.name, ServerHosts(n.host, extra))));
  }
  PENUMBRA_RETURN_IF_ERROR(Issue(dir, spec(transport::role::kAdmin, "admin", {})));
  PENUMBRA_RETURN_IF_ERROR(Issue(dir, spec(transport::role::kClient, "client", {})));
  PENUMBRA_RETURN_IF_ERROR(ClusterSecret::Create(JoinPath(dir, "cluster.secret"), /*overwrite=*/true));
  std::printf("  %-14s the cluster secret (the store plane's key; every internal process reads it)\n",
              "cluster.secret");
  std::printf("Give the topology `security: {certs: %s}` (penumbra serve passes each process its files).\n",
              dir.c_str());
  return Status::OK();
}

Status IssueCommand(int argc, char** argv) {
  Args a;
  a.Flag("role", "coordinator, worker, store, client or admin")
      .Flag("name", "the certificate's name (CN; the file's name)")
      .Flag("hosts", "host names or addresses it serves, comma-separated")
      .Flag("days", "how long it is valid (default 825)");
  if (argc < 4 || std::string(argv[3]).rfind("--", 0) == 0) {
    return Status::InvalidArgument("usage: penumbra cert issue DIR --role R --name N [--hosts H,...] [--days N]");
  }
  const std::string dir = argv[3];
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 4));
  static const std::set<std::string> kRoles = {transport::role::kCoordinator, transport::role::kWorker,
                                               transport::role::kStore, transport::role::kClient,
                                               transport::role::kAdmin};
  if (!kRoles.count(a.Get("role"))) {
    return Status::InvalidArgument("--role must be coordinator, worker, store, client or admin, got '" + a.Get("role") +
                                   "'");
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t days, a.GetIntIn("days", 825, 1, 36500));
  transport::CertificateSpec s;
  s.role = a.Get("role");
  s.name = a.Get("name");
  s.hosts = SplitHosts(a.Get("hosts"));
  s.days = static_cast<int>(days);
  std::printf("penumbra cert issue %s:\n", dir.c_str());
  return Issue(dir, s);
}

}  // namespace

Status CertCommand(int argc, char** argv) {
  const std::string sub = argc > 2 ? argv[2] : "";
  if (sub == "init") return Init(argc, argv);
  if (sub == "issue") return IssueCommand(argc, argv);
  return Status::InvalidArgument(
      "usage: penumbra cert init DIR [--topology F] [--hosts H,...] | "
      "penumbra cert issue DIR --role R --name N [--hosts H,...]");
}

}  // namespace penumbra
