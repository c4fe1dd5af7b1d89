// What every long-running Penumbra process (penumbra-worker,
// penumbra-coordinator, penumbra-store, penumbra serve) does around its
// servers: wait for SIGTERM/SIGINT (stop) while SIGHUP rereads the
// configuration and stops nothing, and tell whoever started it which ports
// the OS picked.
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
// Waits for SIGTERM or SIGINT and returns its number; each SIGHUP meanwhile
// runs `on_reload` (on the calling thread) and the wait goes on: SIGHUP
// never stops the process. `on_reload` must not throw; a reload that fails
// keeps the old configuration and says so in the log.
int WaitForStopSignal(const std::function<void()>& on_reload);

// Writes `contents` to `path` atomically (a temporary file beside it,
// flushed to disk, then rename): a reader sees the whole file or none. The
// file gets `mode` (0600 for keys and secrets) from its creation on.
Status WriteFileAtomically(const std::string& path, const std::string& contents, mode_t mode = 0644);

// Starts argv[0] (a path) with argv, its stdout and stderr to `log`
// (truncated, or appended to with `append`: a restarted process keeps its
// predecessor's lines), every signal unblocked; returns its pid. Everything
// the child needs is made before fork, so it is safe from a multi-threaded
// process.
Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& log, bool append = false);

// "exit status N", "killed by signal N (NAME)" for a waitpid status.
std::string DescribeWaitStatus(int status);

// Raises this process's limit of open files to its hard limit (a server
// holds one descriptor per connection).
void RaiseFileLimit();

// The main() of a long-running server program `name`: blocks the termination
// signals before any thread starts, sets up logging, raises the open-file
// limit, answers --help with
// `usage` (and, given `flags_help`, "options:" and what it returns: the
// program's flags, Args::Help()), runs `run` and maps its Status to the exit
// code (0; 2 for InvalidArgument, 1 otherwise) with one line on stderr.
int ServerMain(const char* name, const char* usage, int argc, char** argv,
               const std::function<Status(int, char**)>& run, const std::function<std::string()>& flags_help = nullptr);

}  // namespace penumbra
