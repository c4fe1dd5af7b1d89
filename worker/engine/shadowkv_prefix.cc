#include "worker/engine/shadowkv_prefix.h"

#include <glog/logging.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <tuple>

#include "kernels/landmark_format.h"
#include "kernels/value_format.h"

namespace penumbra {
namespace {

// v2: the "values" blob is chunk-major ([layer][chunk][hkv][row]: one chunk
// of every head together, what a question that selects chunks reads; a row
// is ShadowKvPrefixGeometry::ValueRowBytes()).
constexpr const char* kMetaHead = "shadowkv-prefix v2";

// Reads blob `name` (n bytes) from `r` into device memory `dst` in pieces
// through two pinned staging buffers (*staging; allocated on first use): a
// piece is read while the one before it is copied, and no pageable copy of
// the blob is made (first touches of fresh memory cost more than the disk).
Status StreamToDevice(storage::BlobReader& r, const std::string& name, size_t n, void* dst, Backend* backend,
                      std::vector<DeviceBuffer>* staging) {
  constexpr size_t kPiece = size_t{128} << 20;
  if (staging->empty()) {
    for (int i = 0; i < 2; ++i) {
      PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer b, backend->AllocateHost(kPiece));
      staging->push_back(std::move(b));
    }
  }
  for (size_t off = 0, i = 0; off < n; off += kPiece, ++i) {
    const size_t len = std::min(kPiece, n - off);
    DeviceBuffer& buf = (*staging)[i % 2];
    if (i >= 2) PENUMBRA_RETURN_IF_ERROR(backend->Synchronize());  // its previous copy is done
    PENUMBRA_RETURN_IF_ERROR(r.Read(name, off, len, buf.get()));
    PENUMBRA_RETURN_IF_ERROR(backend->CopyToDevice(static_cast<char*>(dst) + off, buf.get(), len));
  }
  return backend->Synchronize();
}

// Bytes [offset, offset + length) of a chunk-major "values" blob
// ([layer][chunk][hkv][row]) into a value buffer laid out [layer][hkv]
// [n_chunks][row].
void ValuesFromChunkMajor(const ShadowKvPrefixGeometry& g, uint64_t offset, const char* data, size_t length,
                          char* values) {
  const uint64_t row = g.ValueRowBytes();
  const uint64_t n = g.n_chunks, H = g.hkv;
  for (uint64_t pos = offset, end = offset + length; pos < end;) {
    const uint64_t r = pos / row, in = pos % row, take = std::min(row - in, end - pos);
    const uint64_t h = r % H, c = (r / H) % n, l = r / H / n;
    std::memcpy(values + ((l * H + h) * n + c) * row + in, data + (pos - offset), take);
    pos += take;
  }
}

// Each blob's bytes (Export's names) in U: size_t for BlobBytes, 128 bits
// for Validate's bound (the fields' own ranges allow products that wrap
// size_t).
template <typename U>
std::map<std::string, U> BlobSizes(const ShadowKvPrefixGeometry& g) {
  const U es = DTypeSize(g.dtype), L = g.layers, H = g.hkv, d = g.head_dim, r = g.rank, C = g.chunk_size;
  const U n = g.n_chunks, O = g.outliers, T = g.tail, D = H * d;
  const U lm = static_cast<U>(
      kernels::LandmarkChunkBytes(g.landmarks_per_chunk, g.head_dim, g.landmark_fp8, DTypeSize(g.dtype)));
  return {
      {"a", L * n * C * r * es},
      {"b", g.sparse ? L * H * r * d * es : 0},
      {"p", g.sparse ? L * D * r * sizeof(float) : 0},
      {"lm", L * H * n * lm},
      {"excl", L * H * n},
      {"out_k", L * H * O * C * d * es},
      {"out_v", L * H * O * C * d * es},
      {"tail_k", L * H * T * d * es},
      {"tail_v", L * H * T * d * es},
      {"tail_prek", g.sparse ? L * T * D * sizeof(float) : 0},
      {"values", L * H * n * static_cast<U>(g.ValueRowBytes())},
      {"outlier_ids", L * H * O * sizeof(int32_t)},
  };
}

}  // namespace

size_t ShadowKvPrefixGeometry::ValueRowBytes() const {
  return static_cast<size_t>(kernels::ValueRowBytes(value_fp8, chunk_size, head_dim, DTypeSize(dtype)));
}

std::map<std::string, size_t> ShadowKvPrefixGeometry::BlobBytes() const { return BlobSizes<size_t>(*this); }

std::string ShadowKvPrefixGeometry::Meta() const {
  std::ostringstream os;
  os << kMetaHead << " tokens=" << tokens << " factored=" << factored << " sparse=" << (sparse ? 1 : 0)
     << " chunks=" << n_chunks << " outliers=" << outliers << " tail=" << tail << " layers=" << layers
     << " kv_heads=" << hkv << " head_dim=" << head_dim << " rank=" << rank << " chunk_size=" << chunk_size
     << " dtype=" << DTypeName(dtype);
  if (landmarks_per_chunk != 1) os << " landmarks_per_chunk=" << landmarks_per_chunk;
  if (landmark_fp8) os << " landmark_format=fp8";
  if (value_fp8) os << " value_format=fp8";
  return os.str();
}

Result<ShadowKvPrefixGeometry> ShadowKvPrefixGeometry::ParseMeta(const std::string& meta) {
  const std::string head = std::string(kMetaHead) + " ";
  if (meta.rfind(head, 0) != 0) return Status::InvalidArgument("shadowkv prefix: unknown format '" + meta + "'");
  std::map<std::string, std::string> kv;
  std::istringstream is(meta.substr(head.size()));
  for (std::string field; is >> field;) {
    const size_t eq = field.find('=');
    if (eq == std::string::npos) return Status::InvalidArgument("shadowkv prefix: bad field '" + field + "'");
    kv[field.substr(0, eq)] = field.substr(eq + 1);
  }
  ShadowKvPrefixGeometry g;
  auto num = [&](const char* key, int64_t lo, int64_t hi) -> Result<int64_t> {
    auto it = kv.find(key);
    if (it == kv.end()) return Status::InvalidArgument(std::string("shadowkv prefix: field '") + key + "' is missing");
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(it->second, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != it->second.size() || v < lo || v > hi) {
      return Status::InvalidArgument(std::string("shadowkv prefix: field '") + key + "' = '" + it->second +
                                     "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return v;
  };
  constexpr int64_t kBig = int64_t{1} << 40;
  PENUMBRA_ASSIGN_OR_RETURN(g.tokens, num("tokens", 1, kBig));
  PENUMBRA_ASSIGN_OR_RETURN(g.factored, num("factored", 1, kBig));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t sparse, num("sparse", 0, 1));
  g.sparse = sparse == 1;
  PENUMBRA_ASSIGN_OR_RETURN(int64_t chunks, num("chunks", 0, INT32_MAX));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t outliers, num("outliers", 0, INT32_MAX));
  g.n_chunks = static_cast<int>(chunks);
  g.outliers = static_cast<int>(outliers);
  PENUMBRA_ASSIGN_OR_RETURN(g.tail, num("tail", 0, kBig));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t layers, num("layers", 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t hkv, num("kv_heads", 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t d, num("head_dim", 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t rank, num("rank", 1, 1 << 20));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t C, num("chunk_size", 1, 1 << 20));
  g.layers = static_cast<int>(layers);
  g.hkv = static_cast<int>(hkv);
  g.head_dim = static_cast<int>(d);
  g.rank = static_cast<int>(rank);
  g.chunk_size = static_cast<int>(C);
  if (kv.count("landmarks_per_chunk")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t lpc, num("landmarks_per_chunk", 1, 16));
    g.landmarks_per_chunk = static_cast<int>(lpc);
  }
  if (auto lf = kv.find("landmark_format"); lf != kv.end()) {
    if (lf->second != "fp8") {
      return Status::InvalidArgument("shadowkv prefix: unknown landmark_format '" + lf->second + "'");
    }
    g.landmark_fp8 = true;
  }
  if (auto vf = kv.find("value_format"); vf != kv.end()) {
    if (vf->second != "fp8")
      return Status::InvalidArgument("shadowkv prefix: unknown value_format '" + vf->second + "'");
    g.value_fp8 = true;
  }
  auto dt = kv.find("dtype");
  if (dt == kv.end()) return Status::InvalidArgument("shadowkv prefix: field 'dtype' is missing");
  if (dt->second == DTypeName(DType::kF32)) {
    g.dtype = DType::kF32;
  } else if (dt->second == DTypeName(DType::kBF16)) {
    g.dtype = DType::kBF16;
  } else {
    return Status::InvalidArgument("shadowkv prefix: unknown dtype '" + dt->second + "'");
  }
  PENUMBRA_RETURN_IF_ERROR(g.Validate());
  return g;
}

Status ShadowKvPrefixGeometry::Validate() const {
  auto bad = [](const std::string& what) { return Status::InvalidArgument("shadowkv prefix: " + what); };
  if (tokens < 1) return bad("tokens must be >= 1");
  if (factored < 1 || factored > tokens) return bad("factored must be in [1, tokens]");
  if (layers < 1 || hkv < 1 || head_dim < 1 || rank < 1 || chunk_size < 1 || n_chunks < 0 || outliers < 0 || tail < 0) {
    return bad("a dimension is not positive");
  }
  // A meta read from disk names sizes that are then allocated and copied:
  // every blob under 1 TiB, none wrapping size_t.
  using Wide = unsigned __int128;
  for (const auto& [name, bytes] : BlobSizes<Wide>(*this)) {
    if (bytes > (Wide{1} << 40)) return bad("its state would take more than 1 TiB (blob '" + name + "')");
  }
  if (!sparse) {
    if (n_chunks != 0 || outliers != 0 || tail != tokens) return bad("a dense prefix is only its tail rows");
    return Status::OK();
  }
  if (landmarks_per_chunk < 1 || chunk_size % landmarks_per_chunk != 0) {
    return bad("landmarks_per_chunk must divide chunk_size");
  }
  if (n_chunks < 1) return bad("a sparse prefix needs at least one chunk");
  if (outliers < 0 || outliers >= n_chunks) return bad("outliers must be in [0, chunks)");
  if (tail != tokens - static_cast<int64_t>(n_chunks) * chunk_size || tail < 0) {
    return bad("tail must be tokens - chunks * chunk_size");
  }
  return Status::OK();
}

Result<std::shared_ptr<ShadowKvPrefix>> ShadowKvPrefix::Allocate(const ShadowKvPrefixGeometry& g, Backend* backend,
                                                                 bool values) {
  PENUMBRA_RETURN_IF_ERROR(g.Validate());
  std::shared_ptr<ShadowKvPrefix> p(new ShadowKvPrefix(g, backend));
  const std::map<std::string, size_t> bytes = g.BlobBytes();
  for (auto& [name, buf, host] : p->Buffers()) {
    const size_t n = bytes.at(name);
    if (n == 0 || (host && !values)) continue;
    auto* b = const_cast<DeviceBuffer*>(buf);
    if (host) {
      PENUMBRA_ASSIGN_OR_RETURN(*b, backend->AllocateHost(n));
    } else {
      PENUMBRA_ASSIGN_OR_RETURN(*b, backend->Allocate(n));
    }
  }
  p->outlier_ids.assign(static_cast<size_t>(g.layers) * g.hkv * g.outliers, 0);
  return p;
}

Status ShadowKvPrefix::AdoptValues(std::vector<DeviceBuffer> layers, int stride) {
  const size_t row = g_.ValueRowBytes();
  const size_t want = row * g_.hkv * static_cast<size_t>(std::max(stride, 0));
  bool fits = stride >= g_.n_chunks && g_.n_chunks > 0 && layers.size() == static_cast<size_t>(g_.layers);
  for (const DeviceBuffer& b : layers) fits = fits && b.get() && b.bytes() == want;
  if (!fits) {
    return Status::InvalidArgument("shadowkv prefix: " + std::to_string(layers.size()) +
                                   " layers of values with a stride of " + std::to_string(stride) +
                                   " chunks do not fit '" + g_.Meta() + "'");
  }
  values = DeviceBuffer();
  value_layers_ = std::move(layers);
  value_stride_ = stride;
  return Status::OK();
}

size_t ShadowKvPrefix::host_bytes() const {
  size_t n = values.bytes() + outlier_ids.size() * sizeof(int32_t);
  for (const DeviceBuffer& b : value_layers_) n += b.bytes();
  return n;
}

std::vector<std::tuple<std::string, const DeviceBuffer*, bool>> ShadowKvPrefix::Buffers() const {
  return {{"a", &a, false},           {"b", &b, false},
          {"p", &p, false},           {"lm", &lm, false},
          {"excl", &excl, false},     {"out_k", &out_k, false},
          {"out_v", &out_v, false},   {"tail_k", &tail_k, false},
          {"tail_v", &tail_v, false}, {"tail_prek", &tail_prek, false},
          {"values", &values, true}};
}

size_t ShadowKvPrefix::device_bytes() const {
  size_t n = 0;
  for (const auto& [name, buf, host] : Buffers()) {
    if (!host) n += buf->bytes();
  }
  return n;
}

ShadowKvPrefix::~ShadowKvPrefix() {
  lazy_.reset();  // its threads write into `values`
  if (registered_) backend_->UnregisterHost(values.get());
}

const void* ShadowKvPrefix::values_device(int layer) const {
  if (values_on_device(layer)) return tier0_[static_cast<size_t>(layer)].get();
  if (!values_complete()) return nullptr;  // not pinned yet
  const char* h = values_host(layer);
  return h ? backend_->DeviceAddressOfHost(h) : nullptr;
}

size_t ShadowKvPrefix::LayerValueBytes() const {
  return static_cast<size_t>(g_.hkv) * value_stride_ * g_.ValueRowBytes();
}

size_t ShadowKvPrefix::promotable_bytes() const {
  if (!g_.sparse || g_.n_chunks == 0 || !values_complete()) return 0;
  return LayerValueBytes() * static_cast<size_t>(g_.layers);
}

Result<bool> ShadowKvPrefix::PromoteStep(size_t max_bytes) const {
  if (promotable_bytes() == 0) return false;
  const size_t bytes = LayerValueBytes(), row = bytes / g_.hkv;
  if (tier0_.empty()) tier0_.resize(static_cast<size_t>(g_.layers));
  for (int l = 0; l < g_.layers; ++l) {
    DeviceBuffer& dst = tier0_[static_cast<size_t>(l)];
    if (dst.get()) continue;
    if (bytes > max_bytes) {
      return Status::ResourceExhausted("tier 0: a layer of values (" + std::to_string(bytes) +
                                       " bytes) does not fit in " + std::to_string(max_bytes));
    }
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, backend_->Allocate(bytes));
    // Rows [0, n_chunks) of each head (the rest of a stride are unused);
    // ordered before the work issued after it on the policy's stream.
    const size_t used = static_cast<size_t>(g_.n_chunks) * g_.ValueRowBytes();
    PENUMBRA_RETURN_IF_ERROR(backend_->Copy2D(buf.get(), row, values_host(l), row, used, g_.hkv));
    dst = std::move(buf);
    tier0_bytes_ += bytes;
    return l + 1 == g_.layers;
  }
  return true;
}

void ShadowKvPrefix::Demote() const {
  tier0_.clear();  // frees after the device's work (cudaFree synchronizes)
  tier0_bytes_ = 0;
}

const void* ShadowKvPrefix::a_layer(int layer) const {
  if (!a.get()) return nullptr;
  return a.as<const char>() + a.bytes() / g_.layers * layer;
}

const void* ShadowKvPrefix::lm_layer(int layer) const {
  if (!lm.get()) return nullptr;
  return lm.as<const char>() + lm.bytes() / g_.layers * layer;
}

const char* ShadowKvPrefix::values_host(int layer) const {
  if (!value_layers_.empty()) return value_layers_[static_cast<size_t>(layer)].as<char>();
  if (!values.get()) return nullptr;
  return values.as<char>() + values.bytes() / g_.layers * layer;
}

Status ShadowKvPrefix::EnsureValues(int layer, const int32_t* chunk, int per_head) const {
  if (values_complete()) return Status::OK();
  const uint64_t row = g_.ValueRowBytes();
  std::vector<storage::LazyBlob::Range> ranges;
  ranges.reserve(static_cast<size_t>(g_.hkv) * per_head);
  for (int h = 0; h < g_.hkv; ++h) {
    for (int j = 0; j < per_head; ++j) {
      const int32_t c = chunk[static_cast<size_t>(h) * per_head + j];
      if (c < 0 || c >= g_.n_chunks) continue;
      ranges.push_back({((static_cast<uint64_t>(layer) * g_.n_chunks + c) * g_.hkv + h) * row, row});  // chunk-major
    }
  }
  return lazy_->Ensure(ranges);
}

void ShadowKvPrefix::StartValueRestore() const {
  if (lazy_) lazy_->StartRestore();
}

Status ShadowKvPrefix::EnsureAllValues() const {
  if (!lazy_) return Status::OK();
  PENUMBRA_RETURN_IF_ERROR(lazy_->EnsureAll());
  if (!registered_.load()) return Status::Internal("shadowkv prefix: its values could not be pinned (see the log)");
  return Status::OK();
}

Result<std::map<std::string, std::string>> ShadowKvPrefix::Export() const {
  PENUMBRA_RETURN_IF_ERROR(EnsureAllValues());
  std::map<std::string, std::string> out;
  out["meta"] = g_.Meta();
  PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());
  for (const auto& [name, buf, host] : Buffers()) {
    std::string bytes(host ? g_.BlobBytes().at(name) : buf->bytes(), '\0');
    if (host && !bytes.empty()) {
      // The values chunk-major (format v2), from each head's first n_chunks
      // rows of each layer (adopted values keep room to grow).
      const size_t row = g_.ValueRowBytes();
      const size_t n = g_.n_chunks, H = g_.hkv;
      for (int l = 0; l < g_.layers; ++l) {
        const char* src = values_host(l);
        for (size_t c = 0; c < n; ++c) {
          for (size_t h = 0; h < H; ++h) {
            std::memcpy(bytes.data() + ((l * n + c) * H + h) * row, src + (h * value_stride_ + c) * row, row);
          }
        }
      }
    } else if (buf->bytes() > 0) {
      if (host) {
        std::memcpy(bytes.data(), buf->get(), bytes.size());
      } else {
        PENUMBRA_RETURN_IF_ERROR(backend_->CopyToHost(bytes.data(), buf->get(), bytes.size()));
      }
    }
    out[name] = std::move(bytes);
  }
  out["outlier_ids"] =
      std::string(reinterpret_cast<const char*>(outlier_ids.data()), outlier_ids.size() * sizeof(int32_t));
  return out;
}

Result<std::shared_ptr<ShadowKvPrefix>> ShadowKvPrefix::Import(const std::map<std::string, std::string>& given,
                                                               const ShadowKvPrefixGeometry& expect, Backend* backend,
                                                               std::shared_ptr<storage::BlobReader> lazy_values,
                                                               int read_threads) {
  // The blobs checked on the host (meta, the exclusion mask, the outlier
  // table) are read from the reader when they were not given.
  std::map<std::string, std::string> own;
  const std::map<std::string, std::string>* src = &given;
  if (lazy_values) {
    for (const char* name : {"meta", "excl", "outlier_ids"}) {
      if (given.count(name)) continue;
      if (src == &given) {
        own = given;
        src = &own;
      }
      PENUMBRA_ASSIGN_OR_RETURN(uint64_t size, lazy_values->Size(name));
      if (size > (uint64_t{1} << 32)) {
        return Status::Corruption(std::string("shadowkv prefix: blob '") + name + "' is too large");
      }
      std::string& b = own[name];
      b.resize(size);
      PENUMBRA_RETURN_IF_ERROR(lazy_values->Read(name, 0, size, b.data()));
    }
  }
  const std::map<std::string, std::string>& blobs = *src;
  auto meta = blobs.find("meta");
  if (meta == blobs.end()) return Status::InvalidArgument("shadowkv prefix: blob 'meta' is missing");
  PENUMBRA_ASSIGN_OR_RETURN(ShadowKvPrefixGeometry g, ShadowKvPrefixGeometry::ParseMeta(meta->second));
  if (g.layers != expect.layers || g.hkv != expect.hkv || g.head_dim != expect.head_dim || g.rank != expect.rank ||
      g.chunk_size != expect.chunk_size || g.landmarks_per_chunk != expect.landmarks_per_chunk ||
      g.landmark_fp8 != expect.landmark_fp8 || g.value_fp8 != expect.value_fp8 || g.dtype != expect.dtype) {
    ShadowKvPrefixGeometry want = g;
    want.layers = expect.layers;
    want.hkv = expect.hkv;
    want.head_dim = expect.head_dim;
    want.rank = expect.rank;
    want.chunk_size = expect.chunk_size;
    want.landmarks_per_chunk = expect.landmarks_per_chunk;
    want.landmark_fp8 = expect.landmark_fp8;
    want.value_fp8 = expect.value_fp8;
    want.dtype = expect.dtype;
    return Status::InvalidArgument("shadowkv prefix: made for another geometry, dtype or format ('" + meta->second +
                                   "'; this policy: '" + want.Meta() + "')");
  }
  const std::map<std::string, size_t> bytes = g.BlobBytes();
  for (const auto& [name, n] : bytes) {
    // With a reader: the values, and any blob not given, come from it.
    if (lazy_values && (name == "values" || !blobs.count(name))) {
      PENUMBRA_ASSIGN_OR_RETURN(uint64_t size, lazy_values->Size(name));
      if (size != n) {
        return Status::Corruption("shadowkv prefix: blob '" + name + "' holds " + std::to_string(size) +
                                  " bytes, expected " + std::to_string(n));
      }
      continue;
    }
    auto it = blobs.find(name);
    if (it == blobs.end()) return Status::InvalidArgument("shadowkv prefix: blob '" + name + "' is missing");
    if (it->second.size() != n) {
      return Status::Corruption("shadowkv prefix: blob '" + name + "' holds " + std::to_string(it->second.size()) +
                                " bytes, expected " + std::to_string(n));
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> p, Allocate(g, backend, /*values=*/!lazy_values));
  if (bytes.at("outlier_ids") > 0) {  // none (no outliers): the vector's data() may be null
    std::memcpy(p->outlier_ids.data(), blobs.at("outlier_ids").data(), bytes.at("outlier_ids"));
  }
  std::vector<DeviceBuffer> staging;  // StreamToDevice's, freed after the copies
  // The outlier table must name, per (layer, head), ascending chunks that
  // are exactly the ones the exclusion mask marks.
  const std::string& excl = blobs.at("excl");
  const size_t rows = static_cast<size_t>(g.layers) * g.hkv;
  for (size_t row = 0; row < rows; ++row) {
    const int32_t* ids = p->outlier_ids.data() + row * g.outliers;
    const char* mask = excl.data() + row * g.n_chunks;
    int marked = 0;
    for (int c = 0; c < g.n_chunks; ++c) {
      if (mask[c] != 0 && mask[c] != 1)
        return Status::Corruption("shadowkv prefix: exclusion mask holds a byte not 0 or 1");
      marked += mask[c];
    }
    if (marked != g.outliers) return Status::Corruption("shadowkv prefix: exclusion mask and outlier table disagree");
    for (int j = 0; j < g.outliers; ++j) {
      if (ids[j] < 0 || ids[j] >= g.n_chunks || (j > 0 && ids[j] <= ids[j - 1]) || mask[ids[j]] != 1) {
        return Status::Corruption("shadowkv prefix: outlier table entry " + std::to_string(j) + " of row " +
                                  std::to_string(row) + " is out of order or unmarked");
      }
    }
  }
  for (auto& [name, buf, host] : p->Buffers()) {
    if (lazy_values && name == "values") {
      const size_t n = bytes.at(name);
      if (n == 0) continue;
      PENUMBRA_ASSIGN_OR_RETURN(size_t block, lazy_values->BlockBytes(name));
      // Plain host memory now, pinned when every block is in (on_complete);
      // huge pages where the kernel gives them (fewer faults as blocks land).
      constexpr size_t kHuge = size_t{2} << 20;
      const size_t alloc = (n + kHuge - 1) / kHuge * kHuge;
      void* mem = std::aligned_alloc(kHuge, alloc);
      if (mem == nullptr) return Status::ResourceExhausted("shadowkv prefix: no host memory for its values");
      (void)madvise(mem, alloc, MADV_HUGEPAGE);
      p->values = DeviceBuffer(mem, n, [](void* q) { std::free(q); });
      ShadowKvPrefix* self = p.get();
      p->lazy_ = std::make_unique<storage::LazyBlob>(
          lazy_values, name, /*dst=*/nullptr, n, block, read_threads,
          [self, backend] {
            Status st = backend->RegisterHost(self->values.get(), self->values.bytes());
            if (st.ok()) {
              self->registered_ = true;
            } else {
              LOG(WARNING) << "shadowkv prefix: values not pinned (read through the host): " << st;
            }
          },
          [self, g](uint64_t offset, const char* data, size_t length) {
            ValuesFromChunkMajor(g, offset, data, length, self->values.as<char>());
          });
      continue;
    }
    if (lazy_values && !blobs.count(name)) {  // a large device blob, streamed from the reader
      PENUMBRA_RETURN_IF_ERROR(StreamToDevice(*lazy_values, name, bytes.at(name), buf->get(), backend, &staging));
      continue;
    }
    const std::string& src = blobs.at(name);
    if (src.empty()) continue;
    auto* b = const_cast<DeviceBuffer*>(buf);
    if (host) {
      ValuesFromChunkMajor(g, 0, src.data(), src.size(), b->as<char>());
    } else {
      PENUMBRA_RETURN_IF_ERROR(backend->CopyToDevice(b->get(), src.data(), src.size()));
    }
  }
  PENUMBRA_RETURN_IF_ERROR(backend->Synchronize());
  return p;
}

}  // namespace penumbra
