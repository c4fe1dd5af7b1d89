// KernelTrace on CUPTI's activity API: CUPTI fills buffers we hand it with
// records and returns them (on its own thread, or at the flush in Stop());
// the records are decoded into TraceRecords under a lock.
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "worker/bench/kernel_trace.h"

namespace penumbra {
namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kAlign = 8;

std::mutex g_mu;
bool g_on = false;                   // a KernelTrace is recording
std::vector<TraceRecord> g_records;  // guarded by g_mu
uint64_t g_dropped = 0;              // records CUPTI could not store

std::string ShortName(const char* mangled) {
  if (mangled == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  for (const std::string anon = "(anonymous namespace)::";;) {
    const size_t at = s.find(anon);
    if (at == std::string::npos) break;
    s.erase(at, anon.size());
  }
  // "void ns::Kernel<...>(args)" -> "ns::Kernel<...>": drop the return type and the arguments.
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0) {
      s.resize(i);
      break;
    }
  }
  if (s.rfind("void ", 0) == 0) s = s.substr(5);
  return s;
}

const char* CopyKindName(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "PtoP";
    default:
      return "copy";
  }
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kAlign, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<TraceRecord> out;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    TraceRecord t;
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      t.kind = TraceRecord::Kind::kKernel;
      t.name = ShortName(k->name);
      t.start_ns = k->start;
      t.end_ns = k->end;
      t.stream = k->streamId;
      t.blocks = static_cast<uint32_t>(k->gridX) * k->gridY * k->gridZ;
      t.threads = static_cast<uint32_t>(k->blockX) * k->blockY * k->blockZ;
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      t.kind = TraceRecord::Kind::kMemcpy;
      t.name = CopyKindName(m->copyKind);
      t.start_ns = m->start;
      t.end_ns = m->end;
      t.stream = m->streamId;
      t.bytes = m->bytes;
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      t.kind = TraceRecord::Kind::kMemset;
      t.name = "memset";
      t.start_ns = m->start;
      t.end_ns = m->end;
      t.stream = m->streamId;
      t.bytes = m->bytes;
    } else {
      continue;
    }
    if (t.start_ns == 0 || t.end_ns < t.start_ns) continue;  // incomplete record
    out.push_back(std::move(t));
  }
  size_t dropped = 0;
  (void)cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_dropped += dropped;
  if (g_on) g_records.insert(g_records.end(), std::make_move_iterator(out.begin()), std::make_move_iterator(out.end()));
}

Status CuptiStatus(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return Status::OK();
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  return Status::Internal(std::string("CUPTI ") + what + ": " + (msg ? msg : "error"));
}

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                     CUPTI_ACTIVITY_KIND_MEMSET};

}  // namespace

Result<std::unique_ptr<KernelTrace>> KernelTrace::Start() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_on) return Status::FailedPrecondition("a kernel trace is already on");
    g_on = true;
    g_records.clear();
    g_dropped = 0;
  }
  std::unique_ptr<KernelTrace> t(new KernelTrace());
  t->on_ = true;  // from here the destructor undoes the above
  PENUMBRA_RETURN_IF_ERROR(
      CuptiStatus(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted), "cuptiActivityRegisterCallbacks"));
  for (CUpti_ActivityKind k : kKinds)
    PENUMBRA_RETURN_IF_ERROR(CuptiStatus(cuptiActivityEnable(k), "cuptiActivityEnable"));
  return t;
}

KernelTrace::~KernelTrace() {
  if (!on_) return;
  for (CUpti_ActivityKind k : kKinds) (void)cuptiActivityDisable(k);
  (void)cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mu);
  g_on = false;
  g_records.clear();
}

Result<std::vector<TraceRecord>> KernelTrace::Stop() {
  if (!on_) return Status::FailedPrecondition("the kernel trace was stopped already");
  for (CUpti_ActivityKind k : kKinds) (void)cuptiActivityDisable(k);
  PENUMBRA_RETURN_IF_ERROR(CuptiStatus(cuptiActivityFlushAll(1), "cuptiActivityFlushAll"));
  std::vector<TraceRecord> out;
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    out.swap(g_records);
    dropped = g_dropped;
    g_on = false;
  }
  on_ = false;
  if (dropped > 0)
    return Status::ResourceExhausted("kernel trace: CUPTI dropped " + std::to_string(dropped) + " records");
  std::sort(out.begin(), out.end(), [](const TraceRecord& a, const TraceRecord& b) { return a.start_ns < b.start_ns; });
  return out;
}

}  // namespace penumbra
