#include "worker/engine/shadowkv_prefix.h"

#include <cstring>
#include <sstream>
#include <tuple>

namespace penumbra {
namespace {

constexpr const char* kMetaHead = "shadowkv-prefix v1";

}  // namespace

std::map<std::string, size_t> ShadowKvPrefixGeometry::BlobBytes() const {
  const size_t es = DTypeSize(dtype), L = layers, H = hkv, d = head_dim, r = rank, C = chunk_size;
  const size_t n = n_chunks, O = outliers, T = tail, D = H * d;
  return {
      {"a", L * n * C * r * es},
      {"b", sparse ? L * H * r * d * es : 0},
      {"p", sparse ? L * D * r * sizeof(float) : 0},
      {"lm", L * H * n * d * es},
      {"excl", L * H * n},
      {"out_k", L * H * O * C * d * es},
      {"out_v", L * H * O * C * d * es},
      {"tail_k", L * H * T * d * es},
      {"tail_v", L * H * T * d * es},
      {"tail_prek", sparse ? L * T * D * sizeof(float) : 0},
      {"values", L * H * n * C * d * es},
      {"outlier_ids", L * H * O * sizeof(int32_t)},
  };
}

std::string ShadowKvPrefixGeometry::Meta() const {
  std::ostringstream os;
  os << kMetaHead << " tokens=" << tokens << " factored=" << factored << " sparse=" << (sparse ? 1 : 0)
     << " chunks=" << n_chunks << " outliers=" << outliers << " tail=" << tail << " layers=" << layers
     << " kv_heads=" << hkv << " head_dim=" << head_dim << " rank=" << rank << " chunk_size=" << chunk_size
     << " dtype=" << DTypeName(dtype);
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
  if (!sparse) {
    if (n_chunks != 0 || outliers != 0 || tail != tokens) return bad("a dense prefix is only its tail rows");
    return Status::OK();
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
  const size_t row = static_cast<size_t>(g_.chunk_size) * g_.head_dim * DTypeSize(g_.dtype);
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
  return {{"a", &a, false},         {"b", &b, false},           {"p", &p, false},
          {"lm", &lm, false},       {"excl", &excl, false},     {"out_k", &out_k, false},
          {"out_v", &out_v, false}, {"tail_k", &tail_k, false}, {"tail_v", &tail_v, false},
          {"tail_prek", &tail_prek, false}, {"values", &values, true}};
}

size_t ShadowKvPrefix::device_bytes() const {
  size_t n = 0;
  for (const auto& [name, buf, host] : Buffers()) {
    if (!host) n += buf->bytes();
  }
  return n;
}

const void* ShadowKvPrefix::values_device(int layer) const {
  const char* h = values_host(layer);
  return h ? backend_->DeviceAddressOfHost(h) : nullptr;
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

Result<std::map<std::string, std::string>> ShadowKvPrefix::Export() const {
  std::map<std::string, std::string> out;
  out["meta"] = g_.Meta();
  PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());
  for (const auto& [name, buf, host] : Buffers()) {
    const bool adopted = host && !value_layers_.empty();
    std::string bytes(adopted ? g_.BlobBytes().at(name) : buf->bytes(), '\0');
    if (adopted) {
      // Each head's first n_chunks rows of each layer's buffer (adopted
      // values keep room to grow).
      const size_t row = static_cast<size_t>(g_.chunk_size) * g_.head_dim * DTypeSize(g_.dtype);
      const size_t used = row * g_.n_chunks, pitch = row * value_stride_;
      for (int l = 0; l < g_.layers; ++l) {
        for (int h = 0; h < g_.hkv; ++h) {
          std::memcpy(bytes.data() + (static_cast<size_t>(l) * g_.hkv + h) * used, values_host(l) + h * pitch, used);
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

Result<std::shared_ptr<ShadowKvPrefix>> ShadowKvPrefix::Import(const std::map<std::string, std::string>& blobs,
                                                               const ShadowKvPrefixGeometry& expect, Backend* backend) {
  auto meta = blobs.find("meta");
  if (meta == blobs.end()) return Status::InvalidArgument("shadowkv prefix: blob 'meta' is missing");
  PENUMBRA_ASSIGN_OR_RETURN(ShadowKvPrefixGeometry g, ShadowKvPrefixGeometry::ParseMeta(meta->second));
  if (g.layers != expect.layers || g.hkv != expect.hkv || g.head_dim != expect.head_dim || g.rank != expect.rank ||
      g.chunk_size != expect.chunk_size || g.dtype != expect.dtype) {
    ShadowKvPrefixGeometry want = g;
    want.layers = expect.layers;
    want.hkv = expect.hkv;
    want.head_dim = expect.head_dim;
    want.rank = expect.rank;
    want.chunk_size = expect.chunk_size;
    want.dtype = expect.dtype;
    return Status::InvalidArgument("shadowkv prefix: made for another geometry or dtype ('" + meta->second +
                                   "'; this policy: '" + want.Meta() + "')");
  }
  const std::map<std::string, size_t> bytes = g.BlobBytes();
  for (const auto& [name, n] : bytes) {
    auto it = blobs.find(name);
    if (it == blobs.end()) return Status::InvalidArgument("shadowkv prefix: blob '" + name + "' is missing");
    if (it->second.size() != n) {
      return Status::Corruption("shadowkv prefix: blob '" + name + "' holds " + std::to_string(it->second.size()) +
                                " bytes, expected " + std::to_string(n));
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> p, Allocate(g, backend));
  std::memcpy(p->outlier_ids.data(), blobs.at("outlier_ids").data(), bytes.at("outlier_ids"));
  // The outlier table must name, per (layer, head), ascending chunks that
  // are exactly the ones the exclusion mask marks.
  const std::string& excl = blobs.at("excl");
  const size_t rows = static_cast<size_t>(g.layers) * g.hkv;
  for (size_t row = 0; row < rows; ++row) {
    const int32_t* ids = p->outlier_ids.data() + row * g.outliers;
    const char* mask = excl.data() + row * g.n_chunks;
    int marked = 0;
    for (int c = 0; c < g.n_chunks; ++c) {
      if (mask[c] != 0 && mask[c] != 1) return Status::Corruption("shadowkv prefix: exclusion mask holds a byte not 0 or 1");
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
    const std::string& src = blobs.at(name);
    if (src.empty()) continue;
    auto* b = const_cast<DeviceBuffer*>(buf);
    if (host) {
      std::memcpy(b->get(), src.data(), src.size());
    } else {
      PENUMBRA_RETURN_IF_ERROR(backend->CopyToDevice(b->get(), src.data(), src.size()));
    }
  }
  PENUMBRA_RETURN_IF_ERROR(backend->Synchronize());
  return p;
}

}  // namespace penumbra
