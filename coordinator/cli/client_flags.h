// What the client subcommands of `penumbra` (service_cli.cc: doc, tenant,
// ask, stats; job_cli.cc: job) share: the connection flags and the
// positional argument after the subcommand.
#pragma once

#include <memory>
#include <string>

#include "common/args.h"
#include "common/status.h"
#include "coordinator/client/client.h"

namespace penumbra::cli {

inline void AddClientFlags(Args& a) { client::AddConnectionFlags(a); }

inline Result<std::unique_ptr<client::Client>> ConnectFromFlags(const Args& a) {
  PENUMBRA_ASSIGN_OR_RETURN(client::ClientOptions o, client::OptionsFromFlags(a));
  return client::Client::Connect(o);
}

// `penumbra CMD SUB [ARG] --flags`: ARG (argv[3] when it is not a flag) into
// *arg; returns where the flags start.
inline int Positional(int argc, char** argv, std::string* arg) {
  if (argc > 3 && std::string(argv[3]).rfind("--", 0) != 0) {
    *arg = argv[3];
    return 4;
  }
  return 3;
}

}  // namespace penumbra::cli
