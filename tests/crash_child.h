// For crash tests with real processes: the test binary re-executes itself as
// a child that runs one gtest case (the child's part, which skips itself
// unless its environment is set) and reports what it has done on a pipe; the
// parent kills it with SIGKILL at a moment of its choosing and checks what
// survived.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>

namespace penumbra::testing {

// Starts /proc/self/exe running `gtest_filter` with `env` set and the pipe's
// write end in env[fd_variable]. Returns the child's pid (-1 on failure) and
// the pipe's read end in *read_fd (the caller closes it).
inline pid_t SpawnCrashChild(const std::string& gtest_filter, const std::map<std::string, std::string>& env,
                             const std::string& fd_variable, int* read_fd) {
  int p[2];
  if (pipe(p) != 0) return -1;
  const pid_t pid = fork();
  if (pid < 0) {
    close(p[0]);
    close(p[1]);
    return -1;
  }
  if (pid == 0) {
    close(p[0]);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    setenv(fd_variable.c_str(), std::to_string(p[1]).c_str(), 1);
    const std::string filter = "--gtest_filter=" + gtest_filter;
    execl("/proc/self/exe", "crash-child", filter.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(p[1]);
  *read_fd = p[0];
  return pid;
}

// SIGKILL and reap; the child's exit status (or -signal).
inline int KillCrashChild(pid_t pid) {
  kill(pid, SIGKILL);
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

}  // namespace penumbra::testing
