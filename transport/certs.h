// Certificates for a deployment (transport/tls.h): a cluster CA and one
// certificate per process, named by role (OU) and name (CN), with the hosts
// it serves as subjectAltNames. `penumbra cert init` uses it to make a
// development CA and a topology's certificates; tests use it to make wrong
// ones (another CA, another role, expired).
//
// Keys are ECDSA P-256; certificates are X.509 v3 signed with SHA-256. Private
// keys are written unencrypted with mode 0600 (the process reads them at
// start); the CA's key should then be moved off the machines that run the
// service (it signs new certificates, nothing else needs it).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra::transport {

struct CertificateSpec {
  std::string role;                 // OU: coordinator, worker, store, client, admin
  std::string name;                 // CN
  std::vector<std::string> hosts;   // DNS names or IP addresses it serves (subjectAltName)
  int days = 825;                   // valid for this long from not_before
  long not_before_offset_s = -300;  // not_before relative to now (a past or future start, for tests)
};

// A new self-signed CA. Files are written atomically; the key with mode 0600.
Status CreateCertificateAuthority(const std::string& cert_path, const std::string& key_path,
                                  const std::string& cluster_name, int days = 3650);

// A certificate for `spec`, signed by the CA (its certificate and key).
Status IssueCertificate(const std::string& ca_cert_path, const std::string& ca_key_path, const CertificateSpec& spec,
                        const std::string& cert_path, const std::string& key_path);

}  // namespace penumbra::transport
