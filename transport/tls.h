// Who may talk to whom: TLS for the Thrift planes (transport/thrift_util.h)
// and the admin HTTP endpoint, with one certificate per process from a
// cluster CA (docs/operations.md, "Security").
//
// A certificate names its holder's role and name in its subject:
// OU=<role> (coordinator, worker, store, client, admin), CN=<name> (the
// process's name in the topology, or a client's name), with the hosts it
// serves as subjectAltNames. `penumbra cert init` makes a development CA and
// one certificate per process of a topology (transport/certs.h).
//
// A server checks every client certificate against the CA and, when the
// plane names roles, the certificate's role (a worker's control API accepts
// only role coordinator); a client checks the server's certificate against
// the CA, its role and the host it dialled (subjectAltName). Failures end
// the connection during the handshake, before any request is read.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <string>
#include <vector>

#include "common/args.h"
#include "common/status.h"

namespace penumbra::transport {

namespace role {
inline constexpr const char* kCoordinator = "coordinator";
inline constexpr const char* kWorker = "worker";
inline constexpr const char* kStore = "store";
inline constexpr const char* kClient = "client";
inline constexpr const char* kAdmin = "admin";
}  // namespace role

// This process's certificate and the CA it trusts; files only (never key
// material on a command line).
struct TlsFiles {
  std::string ca_file;    // PEM: the CA every peer's certificate must chain to (several while rotating).
  std::string cert_file;  // PEM: this process's certificate (with its chain).
  std::string key_file;   // PEM: its private key (not readable by group or others).
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
  // Every file set when any is, each readable, the key private to its owner
  // and matching the certificate, the certificate signed by the CA. Errors
  // name the file.
  Status Validate(const std::string& what) const;
};

// A peer as its certificate says (or, without TLS, only its address).
struct PeerIdentity {
  bool verified = false;  // a certificate that chains to the CA was presented and checked
  std::string role;       // its OU
  std::string name;       // its CN
  std::string address;    // host:port it connected from
  // "role/name" for a verified peer, else "unverified@address".
  std::string ToString() const;
};

// A TLS server's policy.
struct TlsServerOptions {
  TlsFiles files;
  bool require_client_certificate = false;  // mutual TLS
  // When non-empty, a client certificate must carry one of these roles.
  std::vector<std::string> client_roles;
};

// A TLS client's policy.
struct TlsClientOptions {
  TlsFiles files;  // ca_file required; cert/key when the server wants one
  // When non-empty, the server's certificate must carry one of these roles.
  std::vector<std::string> server_roles;
  // The server's certificate must name the host dialled (DNS or IP
  // subjectAltName). Default: true.
  bool verify_host = true;
};

// The certificate's identity (OU, CN) of a PEM file.
Result<PeerIdentity> IdentityOfCertificateFile(const std::string& path);

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(const std::string& host);
// A socket address's numeric host ("?" when neither IPv4 nor IPv6) and port.
std::string NumericHost(const sockaddr_storage& a);
int PortOf(const sockaddr_storage& a);

// What a server process is given about security (flags shared by
// penumbra-coordinator, penumbra-worker and penumbra-store).
struct ProcessSecurity {
  TlsFiles tls;                     // --tls-ca, --tls-cert, --tls-key
  std::string cluster_secret_file;  // --cluster-secret-file: the store plane's and document keys' secret
  bool insecure = false;            // --insecure: allow plaintext on a non-loopback address
};
void AddSecurityFlags(Args& a);
// Reads and validates the flags (files readable, key private, certificate
// from the CA). InvalidArgument naming the flag.
Result<ProcessSecurity> SecurityFromFlags(const Args& a);

// A plaintext listener on `host` is allowed only on loopback, or with
// --insecure (logged loudly as such); a loopback one is logged as a
// development setup. `what` names the port in messages.
Status CheckPlaintextBind(const std::string& what, const std::string& host, bool tls, bool insecure);
// The same for the store plane, whose protection is the cluster secret (UCX
// has no TLS): without it, only on loopback or with --insecure.
Status CheckStorePlaneBind(const std::string& what, const std::string& host, bool secret, bool insecure);

}  // namespace penumbra::transport
