// A process's place in a context-parallel group, from its command line
// (penumbra generate, penumbra-bench cp-decode): each rank is started on its
// own (one per GPU, like torchrun's ranks) with the same --cp-world and
// --cp-rendezvous; rank 0 listens there (port 0: the OS picks one, written to
// --cp-port-file for whoever starts the others).
#pragma once

#include <memory>

#include "common/args.h"
#include "common/status.h"
#include "worker/engine/backend.h"
#include "worker/engine/collective.h"

namespace penumbra {

// --cp-world, --cp-rank, --cp-rendezvous HOST:PORT, --cp-port-file FILE, --cp-timeout-s.
void AddContextGroupFlags(Args& a);
// The group these flags name, connected (every rank must join within
// --cp-timeout-s); null when --cp-world is absent or 1. InvalidArgument
// naming the flag when they are inconsistent.
Result<std::unique_ptr<Collective>> JoinContextGroup(const Args& a, Backend* backend);

}  // namespace penumbra
