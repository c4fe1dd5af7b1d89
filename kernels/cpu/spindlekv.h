// CPU reference of SpindleKV attention (kernels/spindlekv_args.h): f32
// q, out and codebook entries, host pointers; sums in double.
#pragma once

#include "kernels/spindlekv_args.h"

namespace penumbra::kernels::cpu {

void SpindlekvAttention(const SpindlekvAttentionArgs& a);

}  // namespace penumbra::kernels::cpu
