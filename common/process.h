// What every long-running Penumbra process (penumbra-worker,
// penumbra-coordinator) does around its servers: wait for SIGTERM/SIGINT,
// and tell whoever started it which ports the OS picked.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra {

// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and every thread it
// starts afterwards (call first in main), and ignores SIGPIPE (a client that
// goes away is an error on its connection, never the end of the process).
void BlockTerminationSignals();
// Waits for one of them; returns its number.
int WaitForTerminationSignal();

// Writes `contents` to `path` atomically (a temporary file beside it,
// flushed to disk, then rename): a reader sees the whole file or none. The
// file gets `mode` (0600 for keys and secrets) from its creation on.
Status WriteFileAtomically(const std::string& path, const std::string& contents, mode_t mode = 0644);

// Starts argv[0] (a path) with argv, its stdout and stderr to `log`
// (truncated), every signal unblocked; returns its pid. Everything the child
// needs is made before fork, so it is safe from a multi-threaded process.
Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& log);

// Raises this process's limit of open files to its hard limit (a server
// holds one descriptor per connection).
void RaiseFileLimit();

// The main() of a long-running server program `name`: blocks the termination
// signals before any thread starts, sets up logging, raises the open-file
// limit, answers --help with
// `usage`, runs `run` and maps its Status to the exit code (0; 2 for
// InvalidArgument, 1 otherwise) with one line on stderr.
int ServerMain(const char* name, const char* usage, int argc, char** argv,
               const std::function<Status(int, char**)>& run);

}  // namespace penumbra
