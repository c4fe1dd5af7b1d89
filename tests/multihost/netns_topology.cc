#include "tests/multihost/netns_topology.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

namespace penumbra::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string FirstLine(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string ShellQuote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string Comm(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/comm");
  std::string s;
  std::getline(f, s);
  return s;
}

// `ip netns list` -> the names.
std::vector<std::string> NamedNamespaces(const std::string& ip) {
  std::vector<std::string> names;
  std::stringstream ss(RunCommand({ip, "netns", "list"}).output);
  std::string line;
  while (std::getline(ss, line)) {
    std::stringstream ls(line);
    std::string name;
    if (ls >> name) names.push_back(name);
  }
  return names;
}

std::set<pid_t> PidsOf(const std::string& ip, const std::string& ns) {
  std::set<pid_t> pids;
  const CommandResult r = RunCommand({ip, "netns", "pids", ns});
  std::stringstream ss(r.output);
  long p = 0;
  while (ss >> p) pids.insert(static_cast<pid_t>(p));
  return pids;
}

void KillAndDelete(const std::string& ip, const std::string& ns) {
  for (pid_t p : PidsOf(ip, ns)) kill(p, SIGKILL);
  (void)RunCommand({ip, "netns", "del", ns});
}

Status Check(const CommandResult& r, const std::vector<std::string>& argv) {
  if (r.code == 0) return Status::OK();
  std::string cmd;
  for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + a;
  return Status::Internal("`" + cmd + "` exited " + std::to_string(r.code) + ": " + Trim(r.output));
}

}  // namespace

std::string FindProgram(const std::string& name) {
  std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  path += ":/usr/sbin:/sbin:/usr/bin:/bin";
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const std::string p = dir + "/" + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  CommandResult r;
  if (argv.empty()) return r;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return r;
  const pid_t pid = fork();
  if (pid < 0) {
    close(out[0]);
    close(out[1]);
    return r;
  }
  if (pid == 0) {  // only async-signal-safe calls until exec
    dup2(out[1], 1);
    dup2(out[1], 2);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(out[1]);
  const auto until = Clock::now() + timeout;
  bool killed = false;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0 && !killed) {
      kill(pid, SIGKILL);
      killed = true;
    }
    pollfd p{out[0], POLLIN, 0};
    const int n = poll(&p, 1, killed ? 1000 : static_cast<int>(std::min<int64_t>(left, 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (killed) break;  // a grandchild holds the pipe: give up on the rest
      continue;
    }
    const ssize_t got = read(out[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    r.output.append(buf, static_cast<size_t>(got));
  }
  close(out[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
  return r;
}

Result<std::unique_ptr<ScopedNetns>> ScopedNetns::Enter(const std::string& netns_file) {
  const int fd = open(netns_file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError("open " + netns_file + ": " + std::strerror(errno));
  auto s = Enter(fd);
  close(fd);
  return s;
}

Result<std::unique_ptr<ScopedNetns>> ScopedNetns::Enter(int netns_fd) {
  const int back = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (back < 0) return Status::IOError(std::string("open /proc/thread-self/ns/net: ") + std::strerror(errno));
  if (setns(netns_fd, CLONE_NEWNET) != 0) {
    const int e = errno;
    close(back);
    return Status::IOError(std::string("setns: ") + std::strerror(e));
  }
  return std::unique_ptr<ScopedNetns>(new ScopedNetns(back));
}

ScopedNetns::~ScopedNetns() {
  if (setns(back_, CLONE_NEWNET) != 0) std::abort();  // a thread left in a test's namespace would outlive it
  close(back_);
}

std::string NetnsTopology::CannotCreate() {
  if (geteuid() != 0) return "not root: making network namespaces needs root";
  const std::string ip = FindProgram("ip");
  if (ip.empty()) return "iproute2 is not installed (no `ip`)";
  if (FindProgram("ss").empty()) return "iproute2's `ss` is not installed";
  const std::string probe = std::string(kPrefix) + std::to_string(getpid()) + "-probe";
  CommandResult r = RunCommand({ip, "netns", "add", probe});
  if (r.code != 0) return "cannot make a network namespace: " + FirstLine(Trim(r.output));
  std::string why;
  r = RunCommand({ip, "-n", probe, "link", "add", "br0", "type", "bridge"});
  if (r.code != 0) why = "cannot make a bridge in a network namespace: " + FirstLine(Trim(r.output));
  if (why.empty()) {
    r = RunCommand({ip, "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"});
    if (r.code != 0) why = "cannot make a veth pair in a network namespace: " + FirstLine(Trim(r.output));
  }
  (void)RunCommand({ip, "netns", "del", probe});
  return why;
}

int NetnsTopology::RemoveLeftovers() {
  const std::string ip = FindProgram("ip");
  if (ip.empty()) return 0;
  const std::regex ours(std::string("^") + kPrefix + "([0-9]+)-");
  const std::string me = Comm(getpid());
  int removed = 0;
  for (const std::string& ns : NamedNamespaces(ip)) {
    std::smatch m;
    if (!std::regex_search(ns, m, ours)) continue;
    const pid_t owner = static_cast<pid_t>(std::stol(m[1]));
    if (owner == getpid() || Comm(owner) == me) continue;  // this run's, or a run still going
    KillAndDelete(ip, ns);
    ++removed;
  }
  return removed;
}

Result<std::unique_ptr<NetnsTopology>> NetnsTopology::Create(const std::string& subnet,
                                                             const std::vector<HostSpec>& hosts,
                                                             const std::string& run_dir) {
  auto t = std::unique_ptr<NetnsTopology>(new NetnsTopology());
  t->ip_ = FindProgram("ip");
  t->ss_ = FindProgram("ss");
  t->env_ = FindProgram("env");
  if (t->ip_.empty() || t->ss_.empty() || t->env_.empty()) {
    return Status::FailedPrecondition("ip, ss and env are needed");
  }
  t->prefix_ = std::string(kPrefix) + std::to_string(getpid());
  t->run_dir_ = run_dir;
  t->root_netns_ = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (t->root_netns_ < 0) return Status::IOError(std::string("open /proc/thread-self/ns/net: ") + std::strerror(errno));
  static const std::regex kName("^[a-z0-9]{1,8}$");
  for (const HostSpec& h : hosts) {
    if (!std::regex_match(h.name, kName) || h.name == "sw" || h.host_id < 1 || h.host_id > 254) {
      return Status::InvalidArgument("host '" + h.name + "': a name of 1-8 [a-z0-9] (not sw) and an id in [1, 254]");
    }
    t->address_[h.name] = subnet + "." + std::to_string(h.host_id);
  }
  t->StartWatchdog();  // before anything exists to clean up
  PENUMBRA_RETURN_IF_ERROR(t->Build(subnet, hosts));
  return t;
}

void NetnsTopology::StartWatchdog() {
  // A shell, in its own session and re-parented away from the test (so a
  // CTest timeout that kills the test's process tree spares it), that waits
  // for EOF on a pipe whose only write end is ours, then cleans up.
  std::string script = "read -r _; ";
  std::string all = prefix_ + "-sw";
  for (const auto& [host, _] : address_) all += " " + prefix_ + "-" + host;
  script += "for ns in " + all + "; do for p in $(" + ip_ + " netns pids $ns 2>/dev/null); do kill -9 $p; done; done; ";
  script += "for ns in " + all + "; do " + ip_ + " netns del $ns 2>/dev/null; done; ";
  script += "rm -rf -- " + ShellQuote(run_dir_);
  std::vector<std::string> argv = {"/bin/sh", "-c", script};
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return;
  const int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
  const pid_t child = fork();
  if (child == 0) {  // only async-signal-safe calls until exec
    setsid();
    if (fork() != 0) _exit(0);
    dup2(p[0], 0);
    if (devnull >= 0) {
      dup2(devnull, 1);
      dup2(devnull, 2);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(p[0]);
  if (devnull >= 0) close(devnull);
  if (child > 0) {
    while (waitpid(child, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  watchdog_pipe_ = p[1];
}

Status NetnsTopology::Build(const std::string& subnet, const std::vector<HostSpec>& hosts) {
  (void)subnet;
  auto run = [&](std::vector<std::string> argv) { return Check(RunCommand(argv), argv); };
  const std::string sw = prefix_ + "-sw";
  PENUMBRA_RETURN_IF_ERROR(run({ip_, "netns", "add", sw}));
  namespaces_.push_back(sw);
  PENUMBRA_RETURN_IF_ERROR(run({ip_, "-n", sw, "link", "add", "br0", "type", "bridge"}));
  PENUMBRA_RETURN_IF_ERROR(run({ip_, "-n", sw, "link", "set", "br0", "up"}));
  for (const HostSpec& h : hosts) {
    const std::string ns = Namespace(h.name), port = "p-" + h.name;
    PENUMBRA_RETURN_IF_ERROR(run({ip_, "netns", "add", ns}));
    namespaces_.push_back(ns);
    PENUMBRA_RETURN_IF_ERROR(
        run({ip_, "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns}));
    PENUMBRA_RETURN_IF_ERROR(run({ip_, "-n", sw, "link", "set", port, "master", "br0", "up"}));
    PENUMBRA_RETURN_IF_ERROR(run({ip_, "-n", ns, "addr", "add", Address(h.name) + "/24", "dev", "eth0"}));
    PENUMBRA_RETURN_IF_ERROR(run({ip_, "-n", ns, "link", "set", "eth0", "up"}));
    PENUMBRA_RETURN_IF_ERROR(run({ip_, "-n", ns, "link", "set", "lo", "up"}));
  }
  return Status::OK();
}

void NetnsTopology::TearDown() {
  for (const std::string& ns : namespaces_) {
    for (pid_t p : PidsOf(ip_, ns)) kill(p, SIGKILL);
  }
  for (const std::string& ns : namespaces_) (void)RunCommand({ip_, "netns", "del", ns});
  namespaces_.clear();
}

NetnsTopology::~NetnsTopology() {
  TearDown();
  std::error_code ec;
  if (!run_dir_.empty()) std::filesystem::remove_all(run_dir_, ec);
  if (watchdog_pipe_ >= 0) close(watchdog_pipe_);  // the watchdog finds nothing left and exits
  if (root_netns_ >= 0) close(root_netns_);
}

std::string NetnsTopology::Namespace(const std::string& host) const { return prefix_ + "-" + host; }

std::string NetnsTopology::NetnsFile(const std::string& host) const { return "/var/run/netns/" + Namespace(host); }

std::string NetnsTopology::Address(const std::string& host) const {
  auto it = address_.find(host);
  return it == address_.end() ? "" : it->second;
}

std::vector<std::string> NetnsTopology::Namespaces() const { return namespaces_; }

std::vector<std::string> NetnsTopology::Exec(const std::string& host, const std::vector<std::string>& argv,
                                             const std::vector<std::string>& env) const {
  std::vector<std::string> c = {ip_, "netns", "exec", Namespace(host)};
  if (!env.empty()) {
    c.push_back(env_);
    c.insert(c.end(), env.begin(), env.end());
  }
  c.insert(c.end(), argv.begin(), argv.end());
  return c;
}

CommandResult NetnsTopology::Run(const std::string& host, const std::vector<std::string>& argv) const {
  return RunCommand(Exec(host, argv));
}

Status NetnsTopology::SetLink(const std::string& host, bool up) const {
  const std::vector<std::string> argv = {ip_, "-n", prefix_ + "-sw", "link", "set", "p-" + host, up ? "up" : "down"};
  return Check(RunCommand(argv), argv);
}

Result<std::set<pid_t>> NetnsTopology::Pids(const std::string& host) const {
  const std::vector<std::string> argv = {ip_, "netns", "pids", Namespace(host)};
  const CommandResult r = RunCommand(argv);
  PENUMBRA_RETURN_IF_ERROR(Check(r, argv));
  std::set<pid_t> pids;
  std::stringstream ss(r.output);
  long p = 0;
  while (ss >> p) pids.insert(static_cast<pid_t>(p));
  return pids;
}

std::string NetnsTopology::NamespaceOf(pid_t pid) const {
  return Trim(RunCommand({ip_, "netns", "identify", std::to_string(pid)}).output);
}

Result<std::string> NetnsTopology::InRoot(const std::vector<std::string>& argv) const {
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<ScopedNetns> root, ScopedNetns::Enter(root_netns_));
  const CommandResult r = RunCommand(argv);
  PENUMBRA_RETURN_IF_ERROR(Check(r, argv));
  return r.output;
}

Result<std::vector<Listener>> NetnsTopology::Listeners(const std::string& host) const {
  std::string out;
  if (host.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(out, InRoot({ss_, "-Htulnp"}));
  } else {
    const std::vector<std::string> argv = Exec(host, {ss_, "-Htulnp"});
    const CommandResult r = RunCommand(argv);
    PENUMBRA_RETURN_IF_ERROR(Check(r, argv));
    out = r.output;
  }
  std::vector<Listener> v;
  std::stringstream ss(out);
  std::string line;
  static const std::regex kPid("pid=([0-9]+)");
  while (std::getline(ss, line)) {
    std::stringstream ls(line);
    std::string netid, state, rq, sq, local;
    if (!(ls >> netid >> state >> rq >> sq >> local)) continue;
    Listener l;
    l.protocol = netid;
    l.line = line;
    const size_t colon = local.rfind(':');
    if (colon == std::string::npos) continue;
    l.port = std::atoi(local.c_str() + colon + 1);
    std::string addr = local.substr(0, colon);
    if (addr.size() >= 2 && addr.front() == '[' && addr.back() == ']') addr = addr.substr(1, addr.size() - 2);
    const size_t pct = addr.find('%');  // 127.0.0.53%lo: bound to a device too
    if (pct != std::string::npos) addr = addr.substr(0, pct);
    l.address = addr;
    for (auto it = std::sregex_iterator(line.begin(), line.end(), kPid); it != std::sregex_iterator(); ++it) {
      l.pids.insert(static_cast<pid_t>(std::stol((*it)[1])));
    }
    v.push_back(std::move(l));
  }
  return v;
}

Result<std::string> NetnsTopology::RootSockets() const { return InRoot({ss_, "-Htuanp"}); }

}  // namespace penumbra::testing
