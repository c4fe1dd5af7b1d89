// What every long-running Penumbra process (penumbra-worker,
// penumbra-coordinator) does around its servers: wait for SIGTERM/SIGINT,
// and tell whoever started it which ports the OS picked.
#pragma once

#include <string>

#include "common/status.h"

namespace penumbra {

// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and every thread it
// starts afterwards (call first in main), and ignores SIGPIPE (a client that
// goes away is an error on its connection, never the end of the process).
void BlockTerminationSignals();
// Waits for one of them; returns its number.
int WaitForTerminationSignal();

// Writes `contents` to `path` atomically (a temporary file beside it, then
// rename): a reader sees the whole file or none.
Status WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace penumbra
