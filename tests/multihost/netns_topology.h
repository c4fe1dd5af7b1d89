// Hosts for a test, made of Linux network namespaces: one namespace per
// host, each with one interface (eth0, its own address on a private /24),
// all plugged into one bridge that lives in a namespace of its own (the
// "switch"). Nothing is added to the namespace the test runs in: no
// interface, no address, no route, so traffic between the hosts cannot
// leave them, and pulling a host's cable (SetLink) is one switch port going
// down.
//
// Names are unique per run (<kPrefix><pid>-<host>), so two runs coexist;
// the subnet may be the same in both (their bridges are separate). Cleanup
// happens three ways: the destructor (kills what runs inside, deletes the
// namespaces, removes the run folder); a watchdog process started by
// Create, detached from the test, that does the same as soon as the test
// process is gone for any reason (a failed assertion, a signal, SIGKILL
// from a CTest timeout); and RemoveLeftovers, for namespaces of a run whose
// watchdog did not get to run (e.g. it was killed itself).
//
// Needs root, iproute2 (`ip`, `ss`) and a kernel with network namespaces,
// veth and bridge: CannotCreate() says in one line why not when they are
// missing.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra::testing {

// Finds `name` in $PATH, /usr/sbin, /sbin and /usr/bin; "" when missing.
std::string FindProgram(const std::string& name);

struct CommandResult {
  int code = -1;       // the exit status, -signal when killed, -1 when it could not start
  std::string output;  // stdout and stderr together
};
// Runs argv (argv[0] a path) to the end and returns its output; SIGKILLs it
// after `timeout` (code then -9). Safe from a multi-threaded process.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));

// The calling thread in another network namespace (the file of one, e.g.
// /var/run/netns/NAME, or a descriptor of one) until destroyed, when it
// goes back where it was. Sockets opened meanwhile stay in that namespace
// for their life; processes started meanwhile start there.
class ScopedNetns {
 public:
  static Result<std::unique_ptr<ScopedNetns>> Enter(const std::string& netns_file);
  static Result<std::unique_ptr<ScopedNetns>> Enter(int netns_fd);
  ~ScopedNetns();
  ScopedNetns(const ScopedNetns&) = delete;
  ScopedNetns& operator=(const ScopedNetns&) = delete;

 private:
  explicit ScopedNetns(int back) : back_(back) {}
  int back_;  // the namespace to go back to
};

// A socket listening in a namespace, as `ss -tulnp` shows it.
struct Listener {
  std::string protocol;  // tcp or udp
  std::string address;   // the local address (no brackets), "*" or "0.0.0.0" for any
  int port = 0;
  std::set<pid_t> pids;  // the processes holding it
  std::string line;      // ss's line, for messages
};

class NetnsTopology {
 public:
  static constexpr const char* kPrefix = "pnmh";
  struct HostSpec {
    std::string name;  // short: [a-z0-9], at most 8 characters (its switch port is p-<name>)
    int host_id = 0;   // its address is <subnet>.<host_id>, in [1, 254]
  };

  // "" when this process can make network namespaces (root, `ip` and `ss`
  // present, `ip netns add` works), else a one-line reason.
  static std::string CannotCreate();
  // Deletes the namespaces (and kills the processes inside) of earlier runs
  // whose test process is gone. Returns how many namespaces it deleted.
  static int RemoveLeftovers();

  // The hosts, on <subnet>.0/24 (subnet: three octets, e.g. "10.77.37").
  // `run_dir` is removed with the topology (its cleanup included).
  static Result<std::unique_ptr<NetnsTopology>> Create(const std::string& subnet, const std::vector<HostSpec>& hosts,
                                                       const std::string& run_dir);
  ~NetnsTopology();
  NetnsTopology(const NetnsTopology&) = delete;
  NetnsTopology& operator=(const NetnsTopology&) = delete;

  const std::string& prefix() const { return prefix_; }  // <kPrefix><pid>
  std::string Namespace(const std::string& host) const;  // its namespace's name
  std::string NetnsFile(const std::string& host) const;  // /var/run/netns/<namespace>
  std::string Address(const std::string& host) const;    // its IPv4 address
  std::vector<std::string> Namespaces() const;           // every one, the switch's included

  // The command line that runs argv inside `host`, with `env` (NAME=VALUE)
  // added to its environment: ip netns exec NS env ... argv.
  std::vector<std::string> Exec(const std::string& host, const std::vector<std::string>& argv,
                                const std::vector<std::string>& env = {}) const;
  // Runs argv in `host`'s namespace to its end.
  CommandResult Run(const std::string& host, const std::vector<std::string>& argv) const;
  // The host's switch port up or down (its cable plugged in or pulled).
  Status SetLink(const std::string& host, bool up) const;
  // The processes in `host`'s namespace.
  Result<std::set<pid_t>> Pids(const std::string& host) const;
  // The namespace process `pid` is in (`ip netns identify`; "" for none of
  // the named ones).
  std::string NamespaceOf(pid_t pid) const;
  // The listening TCP and UDP sockets in `host`'s namespace, or in the
  // namespace this test started in (host "").
  Result<std::vector<Listener>> Listeners(const std::string& host) const;
  // Every socket (any state) in the namespace the test started in, as ss
  // prints them (-tuanp).
  Result<std::string> RootSockets() const;

 private:
  NetnsTopology() = default;
  Status Build(const std::string& subnet, const std::vector<HostSpec>& hosts);
  void StartWatchdog();
  // Kills every process in our namespaces, deletes them.
  void TearDown();
  Result<std::string> InRoot(const std::vector<std::string>& argv) const;

  std::string ip_, ss_, env_, prefix_, run_dir_;
  std::map<std::string, std::string> address_;  // host -> address
  std::vector<std::string> namespaces_;         // made so far, the switch first
  int root_netns_ = -1;                         // the namespace the test started in
  int watchdog_pipe_ = -1;                      // its write end: closing it (or exiting) wakes the watchdog
};

}  // namespace penumbra::testing
