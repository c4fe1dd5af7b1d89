// TLS sessions resumed against the planes' servers (ConfigureSslContext):
// HTTP clients (Node's fetch, curl) resume a session on each new connection
// with the ticket of an earlier one. A server that verifies peers refuses
// every resumption with an internal-error alert unless its sessions carry a
// context; the OpenAI API's clients met that as a "Connection error" on the
// request after a stream. The handshakes run in memory (a BIO pair), client
// and server stepped in turn.
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <filesystem>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "transport/certs.h"
#include "transport/tls.h"
#include "transport/tls_openssl.h"

namespace penumbra::transport {
namespace {

struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
};
struct SessionFree {
  void operator()(SSL_SESSION* s) const { SSL_SESSION_free(s); }
};
using Ctx = std::unique_ptr<SSL_CTX, CtxFree>;
using Ssl = std::unique_ptr<SSL, SslFree>;
using Session = std::unique_ptr<SSL_SESSION, SessionFree>;

class TlsSession : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("penumbra-tls-session-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    const std::string d = dir_.string();
    ASSERT_TRUE(CreateCertificateAuthority(d + "/ca.pem", d + "/ca.key", "penumbra-test").ok());
    CertificateSpec server;
    server.role = "coordinator";
    server.name = "coordinator";
    server.hosts = {"127.0.0.1"};
    ASSERT_TRUE(IssueCertificate(d + "/ca.pem", d + "/ca.key", server, d + "/server.pem", d + "/server.key").ok());
    CertificateSpec client;
    client.role = "client";
    client.name = "app";
    ASSERT_TRUE(IssueCertificate(d + "/ca.pem", d + "/ca.key", client, d + "/client.pem", d + "/client.key").ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  TlsFiles Files(const std::string& who) const {
    const std::string d = dir_.string();
    return TlsFiles{d + "/ca.pem", d + "/" + who + ".pem", d + "/" + who + ".key"};
  }
  Ctx Context(const std::string& who, bool server, bool require) const {
    Ctx c(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()));
    EXPECT_NE(c, nullptr);
    const Status s = ConfigureSslContext(c.get(), Files(who), server, require);
    EXPECT_TRUE(s.ok()) << s;
    return c;
  }

  std::filesystem::path dir_;
};

// One connection in memory: a handshake, then one message from the server
// (the client reads it, and with it the session tickets TLS 1.3 sends after
// the handshake). `resume`: the session to offer. Returns the client's
// session, or null with `error` set.
struct Connection {
  Ssl client, server;
  std::string error;
};

Connection Connect(SSL_CTX* server_ctx, SSL_CTX* client_ctx, SSL_SESSION* resume) {
  Connection c;
  c.client.reset(SSL_new(client_ctx));
  c.server.reset(SSL_new(server_ctx));
  BIO *client_bio = nullptr, *server_bio = nullptr;
  BIO_new_bio_pair(&client_bio, 0, &server_bio, 0);
  SSL_set_bio(c.client.get(), client_bio, client_bio);
  SSL_set_bio(c.server.get(), server_bio, server_bio);
  SSL_set_connect_state(c.client.get());
  SSL_set_accept_state(c.server.get());
  if (resume != nullptr) SSL_set_session(c.client.get(), resume);
  bool client_done = false, server_done = false;
  for (int i = 0; i < 100 && !(client_done && server_done); ++i) {
    for (auto [ssl, done] : {std::pair{c.client.get(), &client_done}, std::pair{c.server.get(), &server_done}}) {
      if (*done) continue;
      const int r = SSL_do_handshake(ssl);
      if (r == 1) {
        *done = true;
        continue;
      }
      const int e = SSL_get_error(ssl, r);
      if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
        c.error = std::string(ssl == c.client.get() ? "client" : "server") + ": " + OpenSslErrors();
        return c;
      }
    }
  }
  if (!client_done || !server_done) {
    c.error = "the handshake did not finish";
    return c;
  }
  const char hello[] = "hello";
  if (SSL_write(c.server.get(), hello, sizeof hello) != static_cast<int>(sizeof hello)) {
    c.error = "server write: " + OpenSslErrors();
    return c;
  }
  char got[sizeof hello] = {};
  if (SSL_read(c.client.get(), got, sizeof got) != static_cast<int>(sizeof hello)) {
    c.error = "client read: " + OpenSslErrors();
  }
  return c;
}

TEST_F(TlsSession, AClientResumesItsSessionAndIsStillNamedByItsCertificate) {
  for (const bool require : {true, false}) {
    SCOPED_TRACE(require ? "client certificate required" : "client certificate optional");
    Ctx server = Context("server", /*server=*/true, require);
    Ctx client = Context("client", /*server=*/false, /*require=*/true);
    Connection first = Connect(server.get(), client.get(), nullptr);
    ASSERT_EQ(first.error, "");
    EXPECT_FALSE(SSL_session_reused(first.client.get()));
    Session session(SSL_get1_session(first.client.get()));
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(SSL_SESSION_is_resumable(session.get()));

    Connection second = Connect(server.get(), client.get(), session.get());
    ASSERT_EQ(second.error, "") << "a resumption was refused";
    EXPECT_TRUE(SSL_session_reused(second.client.get()));
    EXPECT_TRUE(SSL_session_reused(second.server.get()));
    // The resumed session still names its client by the certificate it
    // showed when the session began.
    Result<PeerIdentity> peer = CheckPeer(second.server.get(), "127.0.0.1:1", {"client"}, nullptr, require);
    ASSERT_TRUE(peer.ok()) << peer.status();
    EXPECT_EQ(peer->role, "client");
    EXPECT_EQ(peer->name, "app");
  }
}

}  // namespace
}  // namespace penumbra::transport
