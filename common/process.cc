#include "common/process.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <fcntl.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>

#include <pthread.h>
#include <unistd.h>

#include "common/logging.h"

namespace penumbra {
namespace {

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  return set;
}

}  // namespace

void BlockTerminationSignals() {
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTerminationSignal() {
  sigset_t set = TerminationSignals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

int WaitForStopSignal(const std::function<void()>& on_reload) {
  for (;;) {
    const int sig = WaitForTerminationSignal();
    if (sig != SIGHUP) return sig;
    on_reload();
  }
}

Status WriteFileAtomically(const std::string& path, const std::string& contents, mode_t mode) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return Status::IOError("cannot create " + tmp + ": " + std::strerror(errno));
  ::fchmod(fd, mode);  // whatever the umask
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const bool ok = done == contents.size() && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return Status::IOError("cannot write " + path + ": " + why);
  }
  return Status::OK();
}

Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& log, bool append) {
  if (argv.empty()) return Status::InvalidArgument("SpawnProcess: no program");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const char* log_path = log.c_str();
  const int log_flags = O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC);
  const pid_t pid = fork();
  if (pid < 0) return Status::Internal("fork failed");
  if (pid == 0) {
    const int fd = open(log_path, log_flags, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : std::string()) +
           (WCOREDUMP(status) ? ", core dumped" : "");
  }
  return "wait status " + std::to_string(status);
}

void RaiseFileLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur >= r.rlim_max) return;
  const rlim_t before = r.rlim_cur;
  r.rlim_cur = r.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &r) == 0) {
    VLOG(1) << "open files: limit raised from " << before << " to " << r.rlim_max;
  }
}

int ServerMain(const char* name, const char* usage, int argc, char** argv,
               const std::function<Status(int, char**)>& run, const std::function<std::string()>& flags_help) {
  BlockTerminationSignals();  // before any thread starts
  InitLogging(argv[0]);
  RaiseFileLimit();
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "help")) {
    std::cout << usage;
    if (flags_help) std::cout << "options:\n" << flags_help();
    return 0;
  }
  const Status s = run(argc, argv);
  if (!s.ok()) {
    std::cerr << name << ": " << s.ToString() << std::endl;
    return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace penumbra
