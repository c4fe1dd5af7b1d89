#include "transport/tls.h"

#include <arpa/inet.h>
#include <sys/stat.h>

#include <cstring>
#include <memory>

#include <glog/logging.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "common/file.h"
#include "transport/tls_openssl.h"

namespace penumbra::transport {
namespace {

std::string NameEntry(X509_NAME* name, int nid) {
  if (name == nullptr) return "";
  const int i = X509_NAME_get_index_by_NID(name, nid, -1);
  if (i < 0) return "";
  ASN1_STRING* s = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(name, i));
  unsigned char* utf8 = nullptr;
  const int n = ASN1_STRING_to_UTF8(&utf8, s);
  if (n < 0) return "";
  std::string out(reinterpret_cast<char*>(utf8), static_cast<size_t>(n));
  OPENSSL_free(utf8);
  return out;
}

PeerIdentity IdentityOf(X509* cert) {
  PeerIdentity id;
  X509_NAME* subject = X509_get_subject_name(cert);
  id.role = NameEntry(subject, NID_organizationalUnitName);
  id.name = NameEntry(subject, NID_commonName);
  return id;
}

Result<X509Ptr> ReadCertificate(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return Status::InvalidArgument(path + ": " + std::strerror(errno));
  X509Ptr cert(PEM_read_X509(f, nullptr, nullptr, nullptr));
  std::fclose(f);
  if (!cert) return Status::InvalidArgument(path + ": not a PEM certificate (" + OpenSslErrors() + ")");
  return cert;
}

Result<PkeyPtr> ReadPrivateKey(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::InvalidArgument(path + ": " + std::strerror(errno));
  if ((st.st_mode & 077) != 0) {
    return Status::InvalidArgument(path + ": a private key readable by group or others; chmod 600 it");
  }
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return Status::InvalidArgument(path + ": " + std::strerror(errno));
  PkeyPtr key(PEM_read_PrivateKey(f, nullptr, nullptr, nullptr));
  std::fclose(f);
  if (!key) return Status::InvalidArgument(path + ": not a PEM private key (" + OpenSslErrors() + ")");
  return key;
}

bool IsIpLiteral(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return inet_pton(AF_INET, host.c_str(), &a4) == 1 || inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

std::string OpenSslErrors() {
  std::string out;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out.empty() ? "no detail" : out;
}

std::string PeerIdentity::ToString() const { return verified ? role + "/" + name : "unverified@" + address; }

Status TlsFiles::Validate(const std::string& what) const {
  if (!enabled()) return Status::OK();
  if (ca_file.empty() || cert_file.empty() || key_file.empty()) {
    return Status::InvalidArgument(what + ": TLS needs a CA, a certificate and a key (got " +
                                   (ca_file.empty() ? "no CA" : "CA " + ca_file) + ", " +
                                   (cert_file.empty() ? "no certificate" : "certificate " + cert_file) + ", " +
                                   (key_file.empty() ? "no key" : "key " + key_file) + ")");
  }
  PENUMBRA_ASSIGN_OR_RETURN(X509Ptr first_ca, ReadCertificate(ca_file));  // the file holds one at least
  PENUMBRA_ASSIGN_OR_RETURN(X509Ptr cert, ReadCertificate(cert_file));
  PENUMBRA_ASSIGN_OR_RETURN(PkeyPtr key, ReadPrivateKey(key_file));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return Status::InvalidArgument(what + ": the key " + key_file + " does not match the certificate " + cert_file);
  }
  // The CA file may hold several (the old and the new CA while rotating):
  // the certificate must be signed by one of them.
  FILE* f = std::fopen(ca_file.c_str(), "r");
  if (f == nullptr) return Status::InvalidArgument(ca_file + ": " + std::strerror(errno));
  bool signed_by_one = false;
  for (X509Ptr ca(PEM_read_X509(f, nullptr, nullptr, nullptr)); ca && !signed_by_one;
       ca.reset(PEM_read_X509(f, nullptr, nullptr, nullptr))) {
    PkeyPtr ca_key(X509_get_pubkey(ca.get()));
    signed_by_one = ca_key && X509_verify(cert.get(), ca_key.get()) == 1;
  }
  std::fclose(f);
  ERR_clear_error();
  if (!signed_by_one) {
    return Status::InvalidArgument(what + ": the certificate " + cert_file + " is not signed by the CA " + ca_file);
  }
  return Status::OK();
}

Result<PeerIdentity> IdentityOfCertificateFile(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(X509Ptr cert, ReadCertificate(path));
  PeerIdentity id = IdentityOf(cert.get());
  id.verified = true;
  return id;
}

std::string NumericHost(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, buf, sizeof buf);
  } else if (a.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

int PortOf(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
  return 0;
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  return false;
}

Status ConfigureSslContext(SSL_CTX* ctx, const TlsFiles& files, bool server, bool require_peer_certificate) {
  PENUMBRA_RETURN_IF_ERROR(files.Validate(server ? "TLS server" : "TLS client"));
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1) {
    return Status::Internal("TLS: cannot require TLS 1.2: " + OpenSslErrors());
  }
  if (SSL_CTX_load_verify_locations(ctx, files.ca_file.c_str(), nullptr) != 1) {
    return Status::InvalidArgument("TLS: cannot load the CA " + files.ca_file + ": " + OpenSslErrors());
  }
  if (SSL_CTX_use_certificate_chain_file(ctx, files.cert_file.c_str()) != 1) {
    return Status::InvalidArgument("TLS: cannot load the certificate " + files.cert_file + ": " + OpenSslErrors());
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, files.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return Status::InvalidArgument("TLS: cannot load the key " + files.key_file + ": " + OpenSslErrors());
  }
  if (SSL_CTX_check_private_key(ctx) != 1) {
    return Status::InvalidArgument("TLS: the key " + files.key_file + " does not match " + files.cert_file);
  }
  if (server) {
    // The CA's name in the certificate request, so clients with several
    // certificates pick the one this server trusts.
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.ca_file.c_str());
    if (names != nullptr) SSL_CTX_set_client_CA_list(ctx, names);
    // A client may resume a session (a TLS 1.3 ticket: Node's and curl's
    // HTTP clients do on every new connection). A server that verifies
    // peers refuses every resumption with an internal-error alert unless
    // its sessions carry a context. The context names the verification, so
    // a session is resumed only where the same certificates are required.
    // A resumed session keeps its verification result and its peer's
    // certificate, which CheckPeer reads as after a full handshake.
    static constexpr unsigned char kMutual[] = "penumbra/mtls";
    static constexpr unsigned char kOptional[] = "penumbra/tls";
    const bool ok = require_peer_certificate ? SSL_CTX_set_session_id_context(ctx, kMutual, sizeof kMutual - 1)
                                             : SSL_CTX_set_session_id_context(ctx, kOptional, sizeof kOptional - 1);
    if (!ok) return Status::Internal("TLS: cannot set the session context: " + OpenSslErrors());
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | (require_peer_certificate ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0), nullptr);
  SSL_CTX_set_mode(ctx, SSL_MODE_AUTO_RETRY);
  SSL_CTX_set_options(ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  return Status::OK();
}

Result<PeerIdentity> CheckPeer(const SSL* ssl, const std::string& address, const std::vector<std::string>& roles,
                               const std::string* expected_host, bool require) {
  PeerIdentity id;
  id.address = address;
  const long verify = SSL_get_verify_result(ssl);
  if (verify != X509_V_OK) {
    return Status::PermissionDenied("TLS peer " + address +
                                    ": certificate not accepted: " + X509_verify_cert_error_string(verify));
  }
  X509Ptr cert(SSL_get1_peer_certificate(ssl));
  if (!cert) {
    if (require) return Status::PermissionDenied("TLS peer " + address + " presented no certificate");
    return id;  // an optional client certificate, not given
  }
  PeerIdentity named = IdentityOf(cert.get());
  id.role = named.role;
  id.name = named.name;
  id.verified = true;
  if (!roles.empty()) {
    bool ok = false;
    for (const auto& r : roles) ok = ok || r == id.role;
    if (!ok) {
      std::string want;
      for (const auto& r : roles) want += (want.empty() ? "" : " or ") + r;
      return Status::PermissionDenied("TLS peer " + address + " (" + id.name + ") has role '" + id.role +
                                      "'; this plane accepts " + want);
    }
  }
  if (expected_host != nullptr && !expected_host->empty()) {
    const std::string& h = *expected_host;
    const int match = IsIpLiteral(h) ? X509_check_ip_asc(cert.get(), h.c_str(), 0)
                                     : X509_check_host(cert.get(), h.c_str(), h.size(), 0, nullptr);
    if (match != 1) {
      return Status::PermissionDenied("TLS peer " + address + ": its certificate (" + id.ToString() +
                                      ") does not name the host '" + h +
                                      "' (subjectAltName); issue it for that host or dial a name it carries");
    }
  }
  return id;
}

void AddSecurityFlags(Args& a) {
  a.Flag("tls-ca", "PEM file of the cluster CA: peers' certificates must chain to it (TLS on when given)")
      .Flag("tls-cert", "PEM file of this process's certificate (penumbra cert init makes one per process)")
      .Flag("tls-key", "PEM file of its private key (mode 600)")
      .Flag("cluster-secret-file",
            "file of the deployment's shared secret (mode 600): authenticates the store "
            "plane and keys stored documents")
      .Switch("insecure", "allow plaintext ports on a non-loopback address (never in production)");
}

Result<ProcessSecurity> SecurityFromFlags(const Args& a) {
  ProcessSecurity s;
  s.tls.ca_file = a.Get("tls-ca");
  s.tls.cert_file = a.Get("tls-cert");
  s.tls.key_file = a.Get("tls-key");
  s.cluster_secret_file = a.Get("cluster-secret-file");
  s.insecure = a.Has("insecure");
  if (Status v = s.tls.Validate("--tls-ca/--tls-cert/--tls-key"); !v.ok()) return v;
  return s;
}

namespace {

// A port without its protection (`missing`) on `host`: logged on loopback,
// refused elsewhere unless insecure.
Status CheckUnprotectedBind(const std::string& what, const std::string& host, bool insecure, const std::string& missing,
                            const std::string& remedy) {
  if (IsLoopbackHost(host)) {
    LOG(WARNING) << what << " on " << host << " without " << missing << ": a loopback development setup (only "
                 << "processes of this machine can reach it)";
    return Status::OK();
  }
  if (!insecure) {
    return Status::InvalidArgument(what + " on " + host + " without " + missing + ": refused (" + remedy +
                                   "), or --insecure on a network you trust");
  }
  LOG(ERROR) << "INSECURE: " << what << " on " << host << " without " << missing << " (--insecure): anyone who "
             << "reaches this address can call it and read its traffic";
  return Status::OK();
}

}  // namespace

Status CheckStorePlaneBind(const std::string& what, const std::string& host, bool secret, bool insecure) {
  if (secret) return Status::OK();
  return CheckUnprotectedBind(what, host, insecure, "the cluster secret",
                              "give --cluster-secret-file; `penumbra cert init` makes one");
}

Status CheckPlaintextBind(const std::string& what, const std::string& host, bool tls, bool insecure) {
  if (tls) return Status::OK();
  return CheckUnprotectedBind(what, host, insecure, "TLS",
                              "give --tls-ca, --tls-cert and --tls-key; `penumbra cert init` makes them");
}

}  // namespace penumbra::transport
