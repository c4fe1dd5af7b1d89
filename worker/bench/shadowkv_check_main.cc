// penumbra-shadowkv-check: runs the engine's ShadowKV ops on an inputs file of
// the independent reference check and writes the results file its comparator
// reads (tests/reference/README.md).
//   penumbra-shadowkv-check --in in.safetensors --out ours.safetensors
//                           [--device cpu|cuda] [--dtype f32|bf16] [--threads N]
//                           [--mode direct|attached|cp2]
// Exit status: 0 on success, 2 on bad arguments or a bad inputs file, 1 on
// any other failure.
#include <iostream>
#include <string>

#include "common/args.h"
#include "common/logging.h"
#include "worker/bench/shadowkv_check.h"

namespace penumbra {
namespace {

constexpr char kUsage[] =
    "usage: penumbra-shadowkv-check --in IN.safetensors --out OUT.safetensors [--device cpu|cuda] "
    "[--dtype f32|bf16] [--threads N] [--mode direct|attached|cp2]";

// 2 for the caller's mistakes (arguments, inputs file), 1 otherwise.
int ExitCode(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kCorruption:
      return 2;
    default:
      return 1;
  }
}

int Fail(const Status& s, int code) {
  std::cerr << "penumbra-shadowkv-check: " << s.ToString() << std::endl;
  return code;
}

int Main(int argc, char** argv) {
  Args a;
  a.Flag("in", "inputs file (safetensors, tests/reference/README.md)")
      .Flag("out", "results file to write")
      .Flag("device", "cpu or cuda (default cuda when a GPU is present, else cpu)")
      .Flag("dtype", "f32 or bf16 (bf16 needs --device cuda; default: bf16 on cuda, f32 on cpu)")
      .Flag("threads", "CPU threads (0 = all cores)")
      .Flag("mode",
            "direct (the context is the prompt), attached (a document taken, exported, imported and attached) or "
            "cp2 (two context-parallel ranks, global selection); default direct")
      .Switch("help", "this text");
  Status st = a.Parse(argc, argv, 1);
  if (!st.ok()) return Fail(Status::InvalidArgument(st.message() + "\n" + kUsage + "\n" + a.Help()), 2);
  if (a.Has("help")) {
    std::cout << kUsage << "\n" << a.Help();
    return 0;
  }
  if (!a.Has("in") || !a.Has("out"))
    return Fail(Status::InvalidArgument(std::string("--in and --out are required\n") + kUsage), 2);
  BackendOptions bo;
  bo.device = a.Get("device", "auto");
  bo.dtype = a.Get("dtype", "auto");
  if (bo.device != "cpu" && bo.device != "cuda" && bo.device != "auto") {
    return Fail(Status::InvalidArgument("--device must be cpu or cuda, got '" + bo.device + "'"), 2);
  }
  if (bo.dtype != "f32" && bo.dtype != "bf16" && bo.dtype != "auto") {
    return Fail(Status::InvalidArgument("--dtype must be f32 or bf16, got '" + bo.dtype + "'"), 2);
  }
  auto threads = a.GetInt("threads", 0);
  if (!threads.ok()) return Fail(threads.status(), 2);
  bo.cpu_threads = static_cast<int>(*threads);
  const std::string mode = a.Get("mode", "direct");
  st = shadowkv_check::ValidateMode(mode);
  if (!st.ok()) return Fail(st, 2);

  auto in = shadowkv_check::ReadInputs(a.Get("in"));
  if (!in.ok()) return Fail(in.status(), ExitCode(in.status()));
  auto backend = CreateBackend(bo);
  if (!backend.ok()) {
    // A dtype the device does not offer is a bad argument; no GPU is not.
    const int code = backend.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
    return Fail(backend.status(), code);
  }
  auto res = shadowkv_check::RunShadowkvCheck(*in, **backend, mode);
  if (!res.ok()) return Fail(res.status(), res.status().code() == StatusCode::kInvalidArgument ? 2 : 1);
  st = shadowkv_check::WriteResults(*res, a.Get("out"));
  if (!st.ok()) return Fail(st, 1);
  std::cerr << "penumbra-shadowkv-check: " << (*backend)->name() << " " << DTypeName((*backend)->act_dtype()) << " "
            << mode << ": seq " << in->seq << ", hkv " << in->hkv << ", hq " << in->hq << ", d " << in->d
            << ", n_chunks " << res->n_chunks << ", outliers " << res->outliers << ", kslots " << res->kslots
            << ", steps " << res->steps << " -> " << a.Get("out") << std::endl;
  return 0;
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  penumbra::InitLogging(argv[0]);
  return penumbra::Main(argc, argv);
}
