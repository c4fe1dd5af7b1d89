// The OpenSSL side of transport/tls.h, shared by the Thrift planes
// (thrift_util.cc), the admin HTTP endpoint (metrics_http.cc) and the
// context-parallel control plane (collective.cc). Only transport/*.cc
// include it.
#pragma once

#include <openssl/ssl.h>

#include <memory>
#include <string>
#include <vector>

#include "transport/tls.h"

namespace penumbra::transport {

// Owners of OpenSSL objects.
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct EvpPkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, EvpPkeyFree>;

// Loads the CA, certificate and key into ctx and sets the policy every plane
// shares: TLS 1.2 at least, the peer verified against the CA
// (SSL_VERIFY_PEER; plus FAIL_IF_NO_PEER_CERT when `require_peer_certificate`).
Status ConfigureSslContext(SSL_CTX* ctx, const TlsFiles& files, bool server, bool require_peer_certificate);

// After a handshake on `ssl`: the peer's identity, checked. `roles` (when
// non-empty) must contain the OU of a certificate it presents; `expected_host` (when set)
// must be named by its subjectAltName (or CN when it has none).
// `require` refuses a peer without a certificate. PermissionDenied says why.
Result<PeerIdentity> CheckPeer(const SSL* ssl, const std::string& address, const std::vector<std::string>& roles,
                               const std::string* expected_host, bool require);

// The last OpenSSL errors of this thread as text (and clears them).
std::string OpenSslErrors();

}  // namespace penumbra::transport
