// A process's place in a context-parallel group, from its command line
// (penumbra generate, penumbra-bench cp-decode): each rank is started on its
// own (one per GPU, like torchrun's ranks) with the same --cp-world and
// --cp-rendezvous; rank 0 listens there (port 0: the OS picks one, written to
// --cp-port-file for whoever starts the others).
//
// Security (worker/parallel/process_group.h): with the process's TLS files
// (--tls-ca/--tls-cert/--tls-key, a certificate of role worker) every
// connection of the group is mutual TLS; without them the group is
// plaintext, refused off loopback unless --insecure. --cp-secret-file adds
// a per-group secret every rank must prove it holds.
#pragma once

#include <memory>
#include <string>

#include "common/args.h"
#include "common/status.h"
#include "transport/tls.h"
#include "worker/engine/backend.h"
#include "worker/engine/collective.h"

namespace penumbra {

// --cp-world, --cp-rank, --cp-rendezvous HOST:PORT, --cp-port-file FILE,
// --cp-timeout-s, --cp-secret-file FILE. (The security flags are
// transport::AddSecurityFlags'.)
void AddContextGroupFlags(Args& a);
// The group these flags name, connected (every rank must join within
// --cp-timeout-s) with `security`'s TLS files and --insecure; null when
// --cp-world is absent or 1. InvalidArgument naming the flag when they are
// inconsistent, or when the group would be plaintext off loopback without
// --insecure (refused before rank 0 listens).
Result<std::unique_ptr<Collective>> JoinContextGroup(const Args& a, Backend* backend,
                                                     const transport::ProcessSecurity& security);

// A group secret from a file: 32 or more hex digits (128 bits or more; what
// RandomHandle() makes), surrounding whitespace ignored, the file readable
// by its owner alone. The secret's bytes; InvalidArgument naming the file.
Result<std::string> LoadGroupSecret(const std::string& path);
// The same from text (a group secret handed over a control plane).
Result<std::string> ParseGroupSecret(const std::string& text);

}  // namespace penumbra
