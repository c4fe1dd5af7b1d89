// The ShadowKV decode kernels' launchers (contracts, parallelization and
// argument structs in shadowkv_decode_args.h; one .cu per stage:
// shadowkv_score.cu (scores, top-k, global selection, MaxRows),
// shadowkv_query_scores.cu (many queries over one sequence),
// shadowkv_shared_scores.cu (many sequences over one prefix),
// shadowkv_slot_update.cu, shadowkv_rebuild_k.cu, shadowkv_fetch_v.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/shadowkv_decode_args.h"
#include "kernels/topk.cuh"

namespace penumbra::kernels {

// then_update (optional, with a selection): the slot update of this
// selection (its selection, stride, batch and hkv those of args), run in the
// selection's blocks where the selection is fused, else launched after it.
void LaunchShadowkvScore(const ShadowkvScoreArgs& args, cudaStream_t stream,
                         const ShadowkvSlotUpdateArgs* then_update = nullptr);
void LaunchMaxRows(const MaxRowsArgs& args, cudaStream_t stream);
// ShadowkvScoreArgs::one_prefix's scores (args.scores, none of the selection)
// with `workspace` (at least ShadowkvSharedScoresWorkspaceBytes(args.batch,
// args.hq, args.max_chunks, args.landmarks_per_chunk) bytes); false (nothing
// launched): a shape or call it does not cover.
bool LaunchShadowkvSharedScores(const ShadowkvScoreArgs& args, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);
size_t ShadowkvSharedScoresWorkspaceBytes(int batch, int hq, int max_chunks, int landmarks_per_chunk);
// Whether LaunchShadowkvSharedScores covers the call's shape (given the workspace).
bool ShadowkvSharedScoresCovers(const ShadowkvScoreArgs& args);
// false (nothing launched): a shape the tensor-core path does not cover.
bool LaunchShadowkvQueryScores(const ShadowkvQueryScoresArgs& args, cudaStream_t stream);
// then_update (optional): the slot update of this selection (its selection,
// stride, batch * hkv = rows), run after it (in the same blocks on the GPU).
void LaunchShadowkvGlobalSelect(const ShadowkvGlobalSelectArgs& args, cudaStream_t stream,
                                const ShadowkvSlotUpdateArgs* then_update = nullptr);
void LaunchShadowkvSlotUpdate(const ShadowkvSlotUpdateArgs& args, cudaStream_t stream);
void LaunchShadowkvRebuildK(const ShadowkvRebuildKArgs& args, cudaStream_t stream);
void LaunchShadowkvFetchV(const ShadowkvFetchVArgs& args, cudaStream_t stream);
inline void LaunchShadowkvScatterV(const ShadowkvFetchVArgs& args, cudaStream_t stream) {
  LaunchShadowkvFetchV(args, stream);
}

}  // namespace penumbra::kernels
