// `penumbra serve` (service_cli.h): the topology file (configs/service.yaml)
// and the processes it names (store nodes, workers, the coordinator) started,
// restarted when they die, and stopped together.
#include "coordinator/cli/service_cli.h"

#include <limits.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/file.h"
#include "common/process.h"

namespace penumbra {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// This executable's folder: penumbra-worker and penumbra-coordinator are its siblings.
std::string ExeDir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  return std::filesystem::path(buf).parent_path().string();
}

// How `penumbra serve` restarts a child that died: after `initial`, doubling
// at each death up to `max`; a child that stayed up `stable` starts again
// from `initial`. A child that keeps dying is retried at `max` for as long
// as serve runs (each death on stderr with its count).
struct RestartPolicy {
  milliseconds initial{1000};  // Default: 1 s.
  milliseconds max{30000};     // Default: 30 s.
  milliseconds stable{60000};  // Default: 60 s.
};

// After this many deaths in a row (none staying up `stable`), a death's line
// says the child keeps crashing.
constexpr int kCrashLoopDeaths = 5;

// A process serve started and supervises.
struct Child {
  std::string name;
  std::string kind;               // "coordinator", "worker", "store node"
  std::string host;               // where it listens (for messages)
  std::vector<std::string> argv;  // what it is (re)started with, without --port-file
  pid_t pid = -1;                 // -1: not running (stopped, or waiting to restart)
  std::string log, port_file;
  int port = 0, metrics_port = -1, openai_port = -1;
  bool serving = false;     // its port file was read since its last start
  int restarts = 0;         // times serve restarted it
  int deaths_in_row = 0;    // deaths without staying up RestartPolicy::stable
  milliseconds backoff{0};  // the delay before the next restart
  Clock::time_point started, restart_at;
};

// Starts `c` (its argv plus --port-file); `append` keeps its log's earlier lines.
Status Spawn(Child& c, bool append) {
  std::filesystem::remove(c.port_file);
  std::vector<std::string> argv = c.argv;
  argv.insert(argv.end(), {"--port-file", c.port_file});
  PENUMBRA_ASSIGN_OR_RETURN(c.pid, SpawnProcess(argv, c.log, append));
  c.serving = false;
  c.started = Clock::now();
  return Status::OK();
}

Child MakeChild(const std::string& name, const std::string& kind, const std::string& host,
                std::vector<std::string> argv, const std::string& dir) {
  Child c;
  c.name = name;
  c.kind = kind;
  c.host = host;
  c.argv = std::move(argv);
  c.log = dir + "/" + name + ".log";
  c.port_file = dir + "/" + name + ".port";
  return c;
}

// Every value of `flag` in argv becomes `value` (a restart keeps the port
// the first start got).
void PinFlag(std::vector<std::string>& argv, const std::string& flag, int value) {
  for (size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == flag) argv[i + 1] = std::to_string(value);
  }
}

std::string Tail(const std::string& path, size_t bytes = 4000) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  std::string t = s.str();
  return t.size() > bytes ? "..." + t.substr(t.size() - bytes) : t;
}

// The last `lines` lines of a file, each indented.
std::string TailLines(const std::string& path, size_t lines = 12) {
  const std::string t = Tail(path, 16000);
  std::vector<std::string> all;
  std::stringstream in(t);
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "    " + all[i] + "\n";
  return out.empty() ? "    (empty)\n" : out;
}

// Reads `c`'s port file; true once it is there and whole.
bool ReadPortFile(Child& c) {
  std::ifstream f(c.port_file);
  if (!f) return false;
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    c.port = j.at("port").get<int>();
    c.metrics_port = j.at("metrics_port").get<int>();
    c.openai_port = j.value("openai_port", -1);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Waits until `c` wrote its port file; fails with its log when it exits first.
Status WaitServing(Child& c, milliseconds timeout) {
  const Clock::time_point until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (ReadPortFile(c)) {
      c.serving = true;
      return Status::OK();
    }
    int st = 0;
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.pid = -1;
      return Status::Unavailable(c.name + " exited before serving (" + DescribeWaitStatus(st) + "); its log (" + c.log +
                                 "):\n" + Tail(c.log));
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  return Status::DeadlineExceeded(c.name + " not serving after " + std::to_string(timeout.count() / 1000) +
                                  " s; its log: " + c.log);
}

// SIGTERM, then SIGKILL after `grace`.
void StopChild(Child& c, milliseconds grace) {
  if (c.pid <= 0) return;
  kill(c.pid, SIGTERM);
  const Clock::time_point until = Clock::now() + grace;
  int st = 0;
  while (Clock::now() < until) {
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.pid = -1;
      return;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  kill(c.pid, SIGKILL);
  waitpid(c.pid, &st, 0);
  c.pid = -1;
}

std::string Seconds(Clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(d).count());
  return buf;
}

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// `c` died with wait status `st`: says so on stderr (its status, how long it
// was up, the end of its log) and schedules its restart by `policy`.
void OnChildDeath(Child& c, int st, const RestartPolicy& policy) {
  const Clock::time_point now = Clock::now();
  const Clock::duration up = now - c.started;
  const pid_t pid = c.pid;
  c.pid = -1;
  if (up >= policy.stable || c.backoff.count() == 0) {
    c.backoff = policy.initial;
    if (up >= policy.stable) c.deaths_in_row = 0;
  }
  ++c.deaths_in_row;
  const milliseconds delay = c.backoff;
  c.restart_at = now + delay;
  c.backoff = std::min(policy.max, c.backoff * 2);
  std::string port = c.port > 0 ? ", port " + std::to_string(c.port) : "";
  std::fprintf(stderr, "serve: %s %s (pid %d) died: %s after %s up (%s); restart %d in %s (same arguments%s)\n",
               c.kind.c_str(), c.name.c_str(), static_cast<int>(pid), DescribeWaitStatus(st).c_str(),
               Seconds(up).c_str(), c.serving ? "it was serving" : "before it served", c.restarts + 1,
               Seconds(delay).c_str(), port.c_str());
  if (c.deaths_in_row >= kCrashLoopDeaths) {
    std::fprintf(stderr,
                 "serve: %s %s keeps crashing (%d deaths in a row, none up %lld s): retried every %s at most, for "
                 "as long as serve runs\n",
                 c.kind.c_str(), c.name.c_str(), c.deaths_in_row, static_cast<long long>(policy.stable.count() / 1000),
                 Seconds(policy.max).c_str());
  }
  std::fprintf(stderr, "serve: the end of %s's log (%s):\n%s", c.name.c_str(), c.log.c_str(), TailLines(c.log).c_str());
}

// serve's own port file: the coordinator's ports, serve's pid and each
// child's state (pid, port, restarts: the crash-loop counter operators watch).
Status WriteServePortFile(const std::string& path, const Child& coordinator, const std::vector<Child*>& all) {
  nlohmann::json children = nlohmann::json::object();
  int64_t restarts = 0;
  for (const Child* c : all) {
    const char* state = c->pid <= 0 ? "down" : c->serving ? "serving" : "starting";
    children[c->name] = {{"kind", c->kind},         {"pid", static_cast<int64_t>(c->pid)},
                         {"port", c->port},         {"state", state},
                         {"restarts", c->restarts}, {"deaths_in_row", c->deaths_in_row}};
    restarts += c->restarts;
  }
  nlohmann::json j = {{"port", coordinator.port},
                      {"metrics_port", coordinator.metrics_port},
                      {"openai_port", coordinator.openai_port},
                      {"pid", static_cast<int64_t>(getpid())},
                      {"restarts", restarts},
                      {"children", children}};
  return WriteFileAtomically(path, j.dump() + "\n");
}

}  // namespace

namespace {

// Unknown keys are errors naming them (a typo must not be ignored).
Status CheckKeys(const YAML::Node& n, const std::vector<std::string>& allowed, const std::string& where) {
  if (!n.IsMap()) return Status::InvalidArgument(where + " must be a map");
  for (const auto& kv : n) {
    const std::string key = kv.first.as<std::string>();
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return Status::InvalidArgument(where + ": unknown key '" + key + "'");
    }
  }
  return Status::OK();
}

template <typename T>
Status ReadKey(const YAML::Node& n, const std::string& key, const std::string& where, T* out) {
  if (!n[key]) return Status::OK();
  try {
    *out = n[key].as<T>();
  } catch (const YAML::Exception&) {
    return Status::InvalidArgument(where + "." + key + ": not a valid value");
  }
  return Status::OK();
}

Status ReadPort(const YAML::Node& n, const std::string& key, const std::string& where, int lo, int* out) {
  PENUMBRA_RETURN_IF_ERROR(ReadKey(n, key, where, out));
  if (*out < lo || *out > 65535) {
    return Status::InvalidArgument(where + "." + key + " must be in [" + std::to_string(lo) + ", 65535], got " +
                                   std::to_string(*out));
  }
  return Status::OK();
}

// A process's name (its log, port file and metrics label): non-empty,
// without separators, and not another worker's or node's.
Status CheckProcessName(const ServiceTopology& t, const std::string& where, const std::string& name) {
  if (name.empty() || name.find_first_of(",=: /") != std::string::npos) {
    return Status::InvalidArgument(where + ".name '" + name + "' must be non-empty, without , = : / or spaces");
  }
  // Certificates are named after processes (penumbra cert init).
  for (const char* reserved : {"coordinator", "admin", "client", "ca", "cluster"}) {
    if (name == reserved) return Status::InvalidArgument(where + ".name '" + name + "' is reserved");
  }
  for (const auto& w : t.workers) {
    if (w.name == name) return Status::InvalidArgument(where + ": two processes named " + name);
  }
  for (const auto& n : t.store_nodes) {
    if (n.name == name) return Status::InvalidArgument(where + ": two processes named " + name);
  }
  return Status::OK();
}

}  // namespace

Result<ServiceTopology> LoadServiceTopology(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(path + ": " + e.what());
  }
  ServiceTopology t;
  PENUMBRA_RETURN_IF_ERROR(CheckKeys(
      root, {"model", "api_keys", "tenants", "data_dir", "security", "coordinator", "workers", "groups", "store_nodes"},
      path));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "model", path, &t.model));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "api_keys", path, &t.api_keys));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "tenants", path, &t.tenants));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "data_dir", path, &t.data_dir));
  if (!t.api_keys.empty() && !t.tenants.empty()) {
    return Status::InvalidArgument(path + ": api_keys and tenants are exclusive: give one of them");
  }
  if (const YAML::Node sec = root["security"]) {
    const std::string where = path + ": security";
    PENUMBRA_RETURN_IF_ERROR(CheckKeys(sec, {"certs", "insecure"}, where));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(sec, "certs", where, &t.certs));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(sec, "insecure", where, &t.insecure));
  }
  if (root["coordinator"]) {
    const YAML::Node c = root["coordinator"];
    const std::string where = path + ": coordinator";
    PENUMBRA_RETURN_IF_ERROR(
        CheckKeys(c, {"host", "port", "metrics_port", "openai_port", "admin_host", "args"}, where));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(c, "host", where, &t.host));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(c, "admin_host", where, &t.admin_host));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(c, "port", where, 0, &t.port));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(c, "metrics_port", where, -1, &t.metrics_port));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(c, "openai_port", where, -1, &t.openai_port));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(c, "args", where, &t.coordinator_args));
  }
  const YAML::Node ws = root["workers"];
  const YAML::Node gs = root["groups"];
  if ((ws && !ws.IsSequence()) || (gs && !gs.IsSequence()) || ((!ws || ws.size() == 0) && (!gs || gs.size() == 0)))
    return Status::InvalidArgument(path + ": workers (or groups) must be a non-empty list");
  auto read_worker = [&](const YAML::Node& n, const std::string& where, WorkerProcessSpec* s) -> Status {
    PENUMBRA_RETURN_IF_ERROR(CheckKeys(n, {"name", "host", "port", "metrics_port", "admin_host", "args"}, where));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(n, "name", where, &s->name));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(n, "host", where, &s->host));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(n, "admin_host", where, &s->admin_host));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(n, "port", where, 0, &s->port));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(n, "metrics_port", where, -1, &s->metrics_port));
    std::vector<std::string> args;
    PENUMBRA_RETURN_IF_ERROR(ReadKey(n, "args", where, &args));
    s->args.insert(s->args.end(), args.begin(), args.end());
    return CheckProcessName(t, where, s->name);
  };
  for (size_t i = 0; ws && i < ws.size(); ++i) {
    WorkerProcessSpec s;
    s.name = "w" + std::to_string(i);
    PENUMBRA_RETURN_IF_ERROR(read_worker(ws[i], path + ": workers[" + std::to_string(i) + "]", &s));
    t.workers.push_back(std::move(s));
  }
  // Context groups: N ranks (one per GPU) serving one sequence sharded over
  // them; the coordinator forms each group.
  for (size_t g = 0; gs && g < gs.size(); ++g) {
    const std::string where = path + ": groups[" + std::to_string(g) + "]";
    PENUMBRA_RETURN_IF_ERROR(CheckKeys(gs[g], {"name", "ranks", "args"}, where));
    std::string name = "g" + std::to_string(g);
    std::vector<std::string> args;
    PENUMBRA_RETURN_IF_ERROR(ReadKey(gs[g], "name", where, &name));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(gs[g], "args", where, &args));
    if (name.empty() || name.find_first_of(",=:;/ ") != std::string::npos) {
      return Status::InvalidArgument(where + ".name '" + name + "' must be non-empty, without , = : ; / or spaces");
    }
    for (const auto& w : t.workers) {
      if (w.group == name) return Status::InvalidArgument(where + ": two groups named " + name);
    }
    const YAML::Node rs = gs[g]["ranks"];
    if (!rs || !rs.IsSequence() || rs.size() < 2) {
      return Status::InvalidArgument(where + ".ranks must be a list of 2 or more workers (one per GPU)");
    }
    for (size_t r = 0; r < rs.size(); ++r) {
      WorkerProcessSpec s;
      s.name = name + "r" + std::to_string(r);
      s.args = args;
      s.group = name;
      s.rank = static_cast<int>(r);
      s.world = static_cast<int>(rs.size());
      PENUMBRA_RETURN_IF_ERROR(read_worker(rs[r], where + ".ranks[" + std::to_string(r) + "]", &s));
      t.workers.push_back(std::move(s));
    }
  }
  if (const YAML::Node ns = root["store_nodes"]) {
    if (!ns.IsSequence()) return Status::InvalidArgument(path + ": store_nodes must be a list");
    for (size_t i = 0; i < ns.size(); ++i) {
      const std::string where = path + ": store_nodes[" + std::to_string(i) + "]";
      StoreNodeSpec s;
      s.name = "s" + std::to_string(i);
      PENUMBRA_RETURN_IF_ERROR(CheckKeys(ns[i], {"name", "host", "port", "path", "args"}, where));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "name", where, &s.name));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "host", where, &s.host));
      PENUMBRA_RETURN_IF_ERROR(ReadPort(ns[i], "port", where, 0, &s.port));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "path", where, &s.path));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "args", where, &s.args));
      if (s.path.empty()) return Status::InvalidArgument(where + ".path is required (the node's RocksDB directory)");
      PENUMBRA_RETURN_IF_ERROR(CheckProcessName(t, where, s.name));
      t.store_nodes.push_back(std::move(s));
    }
  }
  return t;
}

std::vector<std::string> SecurityArgs(const ServiceTopology& t, const std::string& name) {
  std::vector<std::string> args;
  if (!t.certs.empty()) {
    args = {"--tls-ca",
            JoinPath(t.certs, "ca.pem"),
            "--tls-cert",
            JoinPath(t.certs, name + ".pem"),
            "--tls-key",
            JoinPath(t.certs, name + ".key"),
            "--cluster-secret-file",
            JoinPath(t.certs, "cluster.secret")};
  }
  if (t.insecure) args.push_back("--insecure");
  return args;
}

Status ServeCommand(int argc, char** argv) {
  Args a;
  a.Flag("config", "the service topology YAML (default configs/service.yaml)")
      .Flag("model", "override the topology's model")
      .Flag("data-dir", "override the topology's data_dir (batch jobs; \"\" = off)")
      .Flag("port", "override the coordinator's port (0: the OS picks)")
      .Flag("metrics-port", "override the coordinator's metrics port (0: the OS picks, -1: off)")
      .Flag("worker-args",
            "more flags for every worker, space-separated (e.g. \"--kv-policy shadowkv\"); "
            "they replace the topology's same flags")
      .Flag("port-file",
            "write {\"port\": P, \"metrics_port\": M, \"pid\": N, \"restarts\": R, \"children\": "
            "{NAME: {pid, port, state, restarts, ...}}} here once serving (P, M: the coordinator's; "
            "rewritten whenever a process dies or comes back)")
      .Flag("run-dir", "logs and port files of the processes (default build/run/serve-PID)")
      .Flag("start-timeout-s", "how long each process may take to start (default 300)")
      .Flag("restart-backoff-ms",
            "a process that dies is restarted after this long, doubling at each death "
            "(default 1000)")
      .Flag("restart-backoff-max-ms",
            "the restart delay's cap: a process that keeps dying is retried this often "
            "(default 30000)")
      .Flag("restart-stable-s",
            "a process up this long restarts after --restart-backoff-ms again when it dies "
            "(default 60)");
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 2));
  PENUMBRA_ASSIGN_OR_RETURN(ServiceTopology t, LoadServiceTopology(a.Get("config", "configs/service.yaml")));
  if (a.Has("model")) t.model = a.Get("model");
  if (a.Has("data-dir")) t.data_dir = a.Get("data-dir");
  if (a.Has("port")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t p, a.GetIntIn("port", 0, 0, 65535));
    t.port = static_cast<int>(p);
  }
  if (a.Has("metrics-port")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t p, a.GetIntIn("metrics-port", 0, -1, 65535));
    t.metrics_port = static_cast<int>(p);
  }
  if (a.Has("worker-args")) {
    std::stringstream words(a.Get("worker-args"));
    std::string w;
    std::vector<std::string> extra;
    while (words >> w) extra.push_back(w);
    for (auto& spec : t.workers) spec.args = OverrideFlags(spec.args, extra);
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t start_s, a.GetIntIn("start-timeout-s", 300, 1, 86400));
  const std::string dir = a.Get("run-dir", "build/run/serve-" + std::to_string(getpid()));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create " + dir + ": " + ec.message());
  const std::string bin = ExeDir();

  RestartPolicy policy;
  {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t initial, a.GetIntIn("restart-backoff-ms", policy.initial.count(), 10, 3600000));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t max, a.GetIntIn("restart-backoff-max-ms", policy.max.count(), initial, 3600000));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t stable, a.GetIntIn("restart-stable-s", policy.stable.count() / 1000, 1, 86400));
    policy.initial = milliseconds(initial);
    policy.max = milliseconds(max);
    policy.stable = std::chrono::seconds(stable);
  }

  BlockTerminationSignals();  // the children start with a clean mask (Spawn)
  std::vector<Child> workers, nodes;
  workers.reserve(t.workers.size());
  nodes.reserve(t.store_nodes.size());
  Child coordinator;
  auto stop_all = [&] {
    StopChild(coordinator, milliseconds(35000));
    for (auto& w : workers) StopChild(w, milliseconds(35000));
    for (auto& n : nodes) StopChild(n, milliseconds(35000));
  };
  // Starts `c` the first time and waits until it serves; a restart reuses its
  // ports (what the OS picked now), which the others were given.
  auto first_start = [&](Child& c, milliseconds timeout) -> Status {
    PENUMBRA_RETURN_IF_ERROR(Spawn(c, false));
    PENUMBRA_RETURN_IF_ERROR(WaitServing(c, timeout));
    PinFlag(c.argv, "--port", c.port);
    if (c.metrics_port > 0) PinFlag(c.argv, "--metrics-port", c.metrics_port);
    if (c.openai_port > 0) PinFlag(c.argv, "--openai-port", c.openai_port);
    return Status::OK();
  };
  // Value-store nodes first: the workers connect to them.
  std::string store_list;
  for (const StoreNodeSpec& s : t.store_nodes) {
    std::vector<std::string> argv = {bin + "/penumbra-store", "--path", s.path, "--host", s.host, "--port",
                                     std::to_string(s.port)};
    for (const std::string& f : SecurityArgs(t, s.name)) argv.push_back(f);
    argv.insert(argv.end(), s.args.begin(), s.args.end());
    nodes.push_back(MakeChild(s.name, "store node", s.host, std::move(argv), dir));
    if (Status st = first_start(nodes.back(), std::chrono::seconds(start_s)); !st.ok()) {
      stop_all();
      return st;
    }
    store_list += (store_list.empty() ? "" : ",") + s.host + ":" + std::to_string(nodes.back().port);
    std::fprintf(stderr, "serve: store node %s on %s:%d (%s), log %s\n", s.name.c_str(), s.host.c_str(),
                 nodes.back().port, s.path.c_str(), nodes.back().log.c_str());
  }
  for (const WorkerProcessSpec& s : t.workers) {
    std::vector<std::string> argv = {bin + "/penumbra-worker",
                                     "--model",
                                     t.model,
                                     "--name",
                                     s.name,
                                     "--host",
                                     s.host,
                                     "--port",
                                     std::to_string(s.port),
                                     "--metrics-port",
                                     std::to_string(s.metrics_port),
                                     "--admin-host",
                                     s.admin_host};
    if (!store_list.empty()) argv.insert(argv.end(), {"--store-node", store_list});
    if (!s.group.empty()) {
      argv.insert(argv.end(), {"--group", s.group, "--group-rank", std::to_string(s.rank), "--group-world",
                               std::to_string(s.world)});
    }
    for (const std::string& f : SecurityArgs(t, s.name)) argv.push_back(f);
    argv.insert(argv.end(), s.args.begin(), s.args.end());
    workers.push_back(MakeChild(s.name, "worker", s.host, std::move(argv), dir));
    if (Status st = Spawn(workers.back(), false); !st.ok()) {
      stop_all();
      return st;
    }
  }
  std::string list, groups;
  for (size_t i = 0; i < workers.size(); ++i) {
    Child& w = workers[i];
    const WorkerProcessSpec& spec = t.workers[i];
    Status s = WaitServing(w, std::chrono::seconds(start_s));
    if (!s.ok()) {
      stop_all();
      return s;
    }
    PinFlag(w.argv, "--port", w.port);
    if (w.metrics_port > 0) PinFlag(w.argv, "--metrics-port", w.metrics_port);
    const std::string member = w.name + "=" + w.host + ":" + std::to_string(w.port);
    if (spec.group.empty()) {
      list += (list.empty() ? "" : ",") + member;
    } else {
      groups += spec.rank == 0 ? (groups.empty() ? "" : ";") + spec.group + "=" + member : "," + member;
    }
    std::fprintf(stderr, "serve: worker %s on %s:%d (metrics %d), log %s\n", w.name.c_str(), w.host.c_str(), w.port,
                 w.metrics_port, w.log.c_str());
  }
  std::vector<std::string> cargv = {bin + "/penumbra-coordinator",
                                    "--model",
                                    t.model,
                                    "--workers",
                                    list,
                                    "--host",
                                    t.host,
                                    "--port",
                                    std::to_string(t.port),
                                    "--metrics-port",
                                    std::to_string(t.metrics_port),
                                    "--admin-host",
                                    t.admin_host};
  if (t.openai_port >= 0) cargv.insert(cargv.end(), {"--openai-port", std::to_string(t.openai_port)});
  if (!groups.empty()) cargv.insert(cargv.end(), {"--groups", groups});
  if (!t.api_keys.empty()) cargv.insert(cargv.end(), {"--api-keys", t.api_keys});
  if (!t.tenants.empty()) cargv.insert(cargv.end(), {"--tenants", t.tenants});
  if (!t.data_dir.empty()) cargv.insert(cargv.end(), {"--data-dir", t.data_dir});
  for (const std::string& f : SecurityArgs(t, "coordinator")) cargv.push_back(f);
  cargv.insert(cargv.end(), t.coordinator_args.begin(), t.coordinator_args.end());
  coordinator = MakeChild("coordinator", "coordinator", t.host, std::move(cargv), dir);
  if (Status s = first_start(coordinator, milliseconds(60000)); !s.ok()) {
    stop_all();
    return s;
  }
  std::vector<Child*> all{&coordinator};
  for (auto& w : workers) all.push_back(&w);
  for (auto& n : nodes) all.push_back(&n);
  auto write_port_file = [&]() -> Status {
    if (!a.Has("port-file")) return Status::OK();
    return WriteServePortFile(a.Get("port-file"), coordinator, all);
  };
  if (Status s = write_port_file(); !s.ok()) {
    stop_all();
    return s;
  }
  std::fprintf(stderr,
               "serve: coordinator on %s:%d (metrics %d), log %s; SIGHUP reloads every process's configuration, "
               "Ctrl-C or SIGTERM stops everything; a process that dies is restarted (after %s, doubling up to %s)\n",
               t.host.c_str(), coordinator.port, coordinator.metrics_port, coordinator.log.c_str(),
               Seconds(policy.initial).c_str(), Seconds(policy.max).c_str());

  // Supervision, until SIGTERM or SIGINT: SIGHUP is passed to every child; a
  // child that dies is restarted by `policy` with the same arguments (ports
  // pinned), its log appended to.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  int stop_signal = 0;
  while (stop_signal == 0) {
    timespec tick{0, 100 * 1000 * 1000};
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) {
      stop_signal = sig;
      break;
    }
    if (sig == SIGHUP) {
      std::string to;
      for (Child* c : all) {
        if (c->pid > 0 && kill(c->pid, SIGHUP) == 0) {
          to += (to.empty() ? "" : ", ") + c->name + " (pid " + std::to_string(c->pid) + ")";
        }
      }
      std::fprintf(stderr,
                   "serve: SIGHUP: passed to %s; each rereads its configuration (see its log), nothing "
                   "stops; the topology itself is read only when serve starts\n",
                   to.empty() ? "no process (none running)" : to.c_str());
    }
    bool changed = false;
    const Clock::time_point now = Clock::now();
    for (Child* c : all) {
      if (c->pid > 0) {
        int st = 0;
        if (waitpid(c->pid, &st, WNOHANG) == c->pid) {
          OnChildDeath(*c, st, policy);
          changed = true;
        } else if (!c->serving) {
          const int pinned = c->port;
          if (ReadPortFile(*c)) {
            c->serving = true;
            changed = true;
            std::fprintf(
                stderr, "serve: %s %s serving again on %s:%d (pid %d, restart %d)%s\n", c->kind.c_str(),
                c->name.c_str(), c->host.c_str(), c->port, static_cast<int>(c->pid), c->restarts,
                pinned > 0 && pinned != c->port ? " -- NOT on its old port: the others still name that one" : "");
          }
        }
      } else if (now >= c->restart_at) {
        ++c->restarts;
        std::ofstream(c->log, std::ios::app)
            << "---- penumbra serve: restart " << c->restarts << " of " << c->name << " at " << UtcNow() << " ----\n";
        if (Status s = Spawn(*c, true); !s.ok()) {
          std::fprintf(stderr, "serve: cannot restart %s %s: %s; trying again in %s\n", c->kind.c_str(),
                       c->name.c_str(), s.ToString().c_str(), Seconds(c->backoff).c_str());
          c->restart_at = now + c->backoff;
          c->backoff = std::min(policy.max, c->backoff * 2);
          continue;
        }
        std::fprintf(stderr, "serve: %s %s restarted (pid %d, restart %d), log %s\n", c->kind.c_str(), c->name.c_str(),
                     static_cast<int>(c->pid), c->restarts, c->log.c_str());
        changed = true;
      }
    }
    if (changed) {
      if (Status s = write_port_file(); !s.ok()) std::fprintf(stderr, "serve: %s\n", s.ToString().c_str());
    }
  }
  std::fprintf(stderr,
               "serve: signal %d: stopping (the coordinator, then the workers, each draining, then the store "
               "nodes)\n",
               stop_signal);
  stop_all();
  std::fprintf(stderr, "serve: stopped\n");
  return Status::OK();
}

}  // namespace penumbra
