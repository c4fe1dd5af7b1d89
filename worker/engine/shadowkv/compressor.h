// ShadowKV's prefill compressor (Algorithm 1): the exact K/V of one layer of
// a prompt in temporaries, then the low-rank factors of its pre-RoPE keys
// (A, B and the ShadowKV+ projection P), the chunks' landmarks and the
// outlier chunks (their exact K/V into the attention rows, their ids on the
// host).
//
// Owns the prefill temporaries (one layer of one prompt, reused by the next
// layer and the next prompt): exact post-RoPE K and V [hkv][tmp_cap][d], f32
// pre-RoPE keys [tmp_cap][hkv*d], the chunks' minimum cosine and the outlier
// ids; and the pointer table StoreTokens uploads. Needs the layout (geometry,
// options) and the backend; writes into the sequence's own buffers, and
// (OffloadValues) into the value store the caller names. The policy and the
// independent check call the same steps.
#pragma once

#include <cstdint>
#include <future>
#include <map>

#include "storage/dram_value_store.h"
#include "worker/engine/shadowkv/layout.h"

namespace penumbra {

class ShadowKvCompressor {
 public:
  ShadowKvCompressor(const ShadowKvLayout& layout, Backend& backend) : lay_(layout), backend_(backend) {}

  // Temporaries for `tokens` rows (kept when large enough; else the old ones
  // freed after a synchronization).
  Status EnsureTemp(int64_t tokens);
  // Keeps the temporaries for the next prompt unless they are large.
  void ReleaseTempIfLarge();
  DeviceBuffer& tmp_k() { return tmp_k_; }
  DeviceBuffer& tmp_v() { return tmp_v_; }
  DeviceBuffer& tmp_prek() { return tmp_prek_; }
  const DeviceBuffer& tmp_outliers() const { return tmp_outl_; }
  int64_t tmp_cap() const { return tmp_cap_; }

  // RoPE + store for tokens [start, start + n) into K/V bases laid out
  // [hkv][stride] (row t at +t*d); queries to q_out; pre-RoPE keys to
  // pre_rope (may be null).
  Status StoreTokens(const float* qkv, const int32_t* positions, int n, int64_t start, void* q_out, void* kbase,
                     void* vbase, int64_t stride, float* pre_rope);

  // Algorithm 1 on the temporaries' first S rows (a first prefill) for
  // `layer` of s, in the order the policy runs them:
  // the SVD of the pre-RoPE keys into s's A, B and P;
  Status Factor(ShadowKvSeq& s, int layer, int64_t S);
  // the landmarks of its n_chunks chunks and their minimum cosine;
  void Landmarks(ShadowKvSeq& s, int layer, int n_chunks);
  // the outliers (s.outliers lowest minimum cosine chunks per head): exact
  // K/V into rows [0, O*C), marked excluded, their ids appended to
  // s.outlier_ids (layer-major). Nothing when s.outliers == 0.
  Status Outliers(ShadowKvSeq& s, int layer, int n_chunks);
  // the `tail` tokens from temporaries' row tail0 on into `layer`'s local
  // rows: exact K/V and pre-RoPE keys (Internal when they do not fit; the
  // caller sets the counts).
  Status TailToLocal(ShadowKvSeq& s, int layer, int64_t tail0, int64_t tail);

  // Writes n value chunks of every head of `layer` from a device buffer laid
  // out [hkv][head_stride elements] of rows of d (from row src_row) to chunks
  // [store_first, store_first + n) of s's segment in `store` (its layer
  // allocated), through the pinned staging buffer *stage (grown when short).
  Status OffloadValues(storage::DramValueStore& store, DeviceBuffer* stage, ShadowKvSeq& s, int layer, const void* src,
                       int64_t head_stride, int64_t src_row, int n, int store_first);
  // The same with the store's put (a copy and a checksum per row: ~70 ms a
  // layer at 124928 tokens, during which no kernel would be launched) on a
  // helper thread, so that the next layer's work is queued meanwhile: the
  // rows go to one of two staging buffers of its own (one waits for its last
  // put before it is reused). Nothing may read the rows before
  // DrainPuts(s.segment) returns.
  Status OffloadValuesAsync(storage::DramValueStore& store, ShadowKvSeq& s, int layer, const void* src,
                            int64_t head_stride, int64_t src_row, int n, int store_first);
  // Waits for every put in flight; the first failure of one for `segment`
  // (a failure of another segment's is kept for its own drain, or dropped by
  // ForgetPuts).
  Status DrainPuts(storage::SegmentId segment);
  // Waits for every put in flight and drops `segment`'s failures (its
  // sequence is gone).
  void ForgetPuts(storage::SegmentId segment);

 private:
  // A device buffer's value rows of `layer` into *stage (grown when short),
  // each head's n rows as the store keeps them; returns the bytes per head.
  Result<size_t> StageValues(DeviceBuffer* stage, const void* src, int64_t head_stride, int64_t src_row, int n);
  struct Put {
    DeviceBuffer stage;
    storage::SegmentId segment = 0;
    std::future<Status> done;
  };
  void Collect(Put& p);

  Put puts_[2];
  int next_put_ = 0;
  std::map<storage::SegmentId, Status> put_errors_;  // the first failure per segment

  const ShadowKvLayout& lay_;
  Backend& backend_;
  DeviceBuffer tmp_k_, tmp_v_, tmp_prek_, tmp_cos_, tmp_outl_, ptr_buf_;
  DeviceBuffer fp8_tmp_;  // OffloadValues: a layer's rows encoded as fp8, before the copy to the host
  int64_t tmp_cap_ = 0;
};

}  // namespace penumbra
