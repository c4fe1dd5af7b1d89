#include "transport/certs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include <openssl/bn.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "common/process.h"
#include "transport/tls_openssl.h"

namespace penumbra::transport {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;

Result<PkeyPtr> NewKey() {
  PkeyPtr k(EVP_EC_gen("P-256"));
  if (!k) return Status::Internal("cannot make a P-256 key: " + OpenSslErrors());
  return k;
}

// PEM text of a certificate or a key.
template <typename Write>
Result<std::string> Pem(Write write) {
  BioPtr b(BIO_new(BIO_s_mem()));
  if (!b || write(b.get()) != 1) return Status::Internal("cannot write PEM: " + OpenSslErrors());
  char* data = nullptr;
  const long n = BIO_get_mem_data(b.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return Status::InvalidArgument("certificate extension '" + value + "': " + OpenSslErrors());
  const int ok = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  return ok == 1 ? Status::OK() : Status::Internal("cannot add '" + value + "': " + OpenSslErrors());
}

Result<X509Ptr> NewCertificate(EVP_PKEY* key, const std::string& role, const std::string& name, int days,
                               long not_before_offset_s) {
  X509Ptr c(X509_new());
  if (!c) return Status::Internal("X509_new failed");
  X509_set_version(c.get(), 2);
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof serial) != 1) return Status::Internal("no random bytes for a serial");
  serial[0] &= 0x7f;  // a positive serial
  BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(c.get()));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(c.get()), not_before_offset_s);
  X509_gmtime_adj(X509_getm_notAfter(c.get()), not_before_offset_s + static_cast<long>(days) * 86400);
  X509_set_pubkey(c.get(), key);
  X509_NAME* subject = X509_get_subject_name(c.get());
  auto add = [&](const char* field, const std::string& v) {
    return X509_NAME_add_entry_by_txt(subject, field, MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(v.c_str()),
                                      -1, -1, 0) == 1;
  };
  if (!add("O", "penumbra") || !add("OU", role) || !add("CN", name)) {
    return Status::InvalidArgument("a certificate subject from role '" + role + "' and name '" + name + "'");
  }
  return c;
}

}  // namespace

Status CreateCertificateAuthority(const std::string& cert_path, const std::string& key_path,
                                  const std::string& cluster_name, int days) {
  PENUMBRA_ASSIGN_OR_RETURN(PkeyPtr key, NewKey());
  PENUMBRA_ASSIGN_OR_RETURN(X509Ptr c, NewCertificate(key.get(), "ca", cluster_name + " CA", days, -300));
  X509_set_issuer_name(c.get(), X509_get_subject_name(c.get()));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), c.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), c.get(), NID_key_usage, "critical,keyCertSign,cRLSign"));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), c.get(), NID_subject_key_identifier, "hash"));
  if (X509_sign(c.get(), key.get(), EVP_sha256()) <= 0)
    return Status::Internal("cannot sign the CA: " + OpenSslErrors());
  PENUMBRA_ASSIGN_OR_RETURN(std::string cert_pem, Pem([&](BIO* b) { return PEM_write_bio_X509(b, c.get()); }));
  PENUMBRA_ASSIGN_OR_RETURN(std::string key_pem, Pem([&](BIO* b) {
                              return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
                            }));
  PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(key_path, key_pem, 0600));
  return WriteFileAtomically(cert_path, cert_pem, 0644);
}

Status IssueCertificate(const std::string& ca_cert_path, const std::string& ca_key_path, const CertificateSpec& spec,
                        const std::string& cert_path, const std::string& key_path) {
  if (spec.role.empty() || spec.name.empty()) return Status::InvalidArgument("a certificate needs a role and a name");
  FILE* f = std::fopen(ca_cert_path.c_str(), "r");
  if (f == nullptr) return Status::InvalidArgument(ca_cert_path + ": " + std::strerror(errno));
  X509Ptr ca(PEM_read_X509(f, nullptr, nullptr, nullptr));
  std::fclose(f);
  f = std::fopen(ca_key_path.c_str(), "r");
  if (f == nullptr) return Status::InvalidArgument(ca_key_path + ": " + std::strerror(errno));
  PkeyPtr ca_key(PEM_read_PrivateKey(f, nullptr, nullptr, nullptr));
  std::fclose(f);
  if (!ca || !ca_key) return Status::InvalidArgument("cannot read the CA " + ca_cert_path + " / " + ca_key_path);
  PENUMBRA_ASSIGN_OR_RETURN(PkeyPtr key, NewKey());
  PENUMBRA_ASSIGN_OR_RETURN(X509Ptr c,
                            NewCertificate(key.get(), spec.role, spec.name, spec.days, spec.not_before_offset_s));
  X509_set_issuer_name(c.get(), X509_get_subject_name(ca.get()));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), ca.get(), NID_basic_constraints, "critical,CA:FALSE"));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), ca.get(), NID_key_usage, "critical,digitalSignature,keyEncipherment"));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), ca.get(), NID_ext_key_usage, "serverAuth,clientAuth"));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), ca.get(), NID_subject_key_identifier, "hash"));
  PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), ca.get(), NID_authority_key_identifier, "keyid:always"));
  if (!spec.hosts.empty()) {
    std::string san;
    for (const std::string& h : spec.hosts) {
      in6_addr a6{};
      in_addr a4{};
      const bool ip = inet_pton(AF_INET, h.c_str(), &a4) == 1 || inet_pton(AF_INET6, h.c_str(), &a6) == 1;
      san += (san.empty() ? "" : ",") + std::string(ip ? "IP:" : "DNS:") + h;
    }
    PENUMBRA_RETURN_IF_ERROR(AddExtension(c.get(), ca.get(), NID_subject_alt_name, san));
  }
  if (X509_sign(c.get(), ca_key.get(), EVP_sha256()) <= 0) {
    return Status::Internal("cannot sign the certificate: " + OpenSslErrors());
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::string cert_pem, Pem([&](BIO* b) { return PEM_write_bio_X509(b, c.get()); }));
  PENUMBRA_ASSIGN_OR_RETURN(std::string key_pem, Pem([&](BIO* b) {
                              return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
                            }));
  PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(key_path, key_pem, 0600));
  return WriteFileAtomically(cert_path, cert_pem, 0644);
}

}  // namespace penumbra::transport
