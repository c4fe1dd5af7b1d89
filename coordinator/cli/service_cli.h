// `penumbra` subcommands for a person using the service:
//   penumbra serve [--config configs/service.yaml]   a coordinator and its workers
//   penumbra doc put FILE [--name N] | doc ls | doc get ID | doc rm ID
//   penumbra ask --docs ID[,ID] --question TEXT      streams the answer
//   penumbra job submit FILE.jsonl [--detach]        a batch job (FILE: coordinator/cli/job_file.h);
//                                                    waits with a progress line unless --detach
//   penumbra job status ID | results ID [--out F] | cancel ID | ls | rm ID
//   penumbra stats
// Client commands reach the coordinator at --address (default
// $PENUMBRA_ADDRESS, else 127.0.0.1:7700) with the API key of
// --api-key-file (default $PENUMBRA_API_KEY_FILE, else $PENUMBRA_API_KEY),
// over TLS with --tls-ca (default $PENUMBRA_TLS_CA).
// One file per job: service_cli.cc (doc, tenant, ask, stats), job_cli.cc,
// serve_cli.cc (serve, the topology), cert_cli.cc.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra {

// The processes `penumbra serve` starts (configs/service.yaml).
struct WorkerProcessSpec {
  std::string name = "w0";
  std::string host = "127.0.0.1";
  int port = 0;                          // 0: the OS picks
  int metrics_port = 0;                  // the admin endpoint (/metrics, /healthz); 0: the OS picks; -1: off
  std::string admin_host = "127.0.0.1";  // where the admin endpoint listens (off loopback: TLS, role admin)
  std::vector<std::string> args;         // more penumbra-worker flags (--device cpu, --config engine.yaml, ...)
  // A rank of a context group (the topology's groups[]: --group NAME
  // --group-rank R --group-world N): "" for a single worker.
  std::string group;
  int rank = 0, world = 1;
};

// A value-store node `penumbra serve` starts (penumbra-store; documents on
// its disk, reached by every worker over UCX).
struct StoreNodeSpec {
  std::string name = "s0";
  std::string host = "127.0.0.1";
  int port = 0;                   // 0: the OS picks
  std::string path;               // its RocksDB directory (required)
  std::vector<std::string> args;  // more penumbra-store flags
};

struct ServiceTopology {
  std::string model = "models/penumbra-eval";
  std::string api_keys;  // file of `keys: {KEY: TENANT}` in plain text (development); "": none
  std::string tenants;   // tenants file (configs/tenants.yaml: hashed keys, quotas); "": none
  std::string data_dir;  // the coordinator's --data-dir (batch jobs, kept across restarts); "": jobs off
  // security.certs: a folder of `penumbra cert init` (ca.pem, <name>.pem and
  // .key per process, cluster.secret); each process gets its own files. "":
  // no TLS (every process on loopback, a development setup).
  std::string certs;
  bool insecure = false;  // security.insecure: plaintext off loopback (never in production)
  std::string host = "127.0.0.1";
  int port = 7700;
  int metrics_port = 7701;  // the coordinator's admin endpoint
  int openai_port = -1;     // the coordinator's OpenAI-compatible API (docs/openai.md); -1: off
  std::string admin_host = "127.0.0.1";
  std::vector<std::string> coordinator_args;
  std::vector<WorkerProcessSpec> workers;
  // Started first; every worker gets --store-node with all of them.
  std::vector<StoreNodeSpec> store_nodes;
};

// Reads a topology YAML; errors name the file and the key.
Result<ServiceTopology> LoadServiceTopology(const std::string& path);

Status ServeCommand(int argc, char** argv);
Status DocCommand(int argc, char** argv);
// penumbra tenant new-key: prints a new random key and its hash (the key once);
// penumbra tenant hash-key: the hash (the form tenants.yaml keeps, sha256:...)
// of a key read from stdin.
Status TenantCommand(int argc, char** argv);
Status AskCommand(int argc, char** argv);
// `penumbra job ...`: submit (waits for the end unless --detach: exit 0 when
// the job completed, even with failed items; 1 when it was cancelled,
// expired or failed), status, results (JSON lines), cancel, ls, rm.
Status JobCommand(int argc, char** argv);
Status StatsCommand(int argc, char** argv);
// penumbra cert init DIR [--topology F] | cert issue DIR --role R --name N (coordinator/cli/cert_cli.cc).
Status CertCommand(int argc, char** argv);
// The security flags of process `name` under topology `t` (its certificate,
// the CA and the cluster secret from t.certs; --insecure).
std::vector<std::string> SecurityArgs(const ServiceTopology& t, const std::string& name);

// "a\nb" escapes (\n \t \\) in a command-line string, as a shell user types them.
std::string Unescape(const std::string& s);

}  // namespace penumbra
