// cuflash/kernels_cu/flash_bwd.cuh
// Entry header of the backward for the generated shells (cuflash/_compile.py: _KERNELS["bwd"],
// ["bwd_dq"] and aux_source): bwd_prep -> flash_bwd_dkdv (dQ by atomics) -> bwd_dq_convert, or
// bwd_prep -> flash_bwd_dkdv (no dQ) + flash_bwd_dq (deterministic dQ); GQA/MQA adds bwd_dkdv_reduce
// (dK, dV per query head -> summed over each k/v head's group).
// Scales: S is raw Q K^T; c = softmax_scale * log2(e) is folded into the exp2; dK and dQ get
// their softmax_scale factor once at the end. See README.md for the map of kernels_cu/.
#pragma once
#include "common.cuh"
#include "attn/params.cuh"
#include "rowwise/bwd_prep.cuh"
#include "rowwise/bwd_post.cuh"
#include "rowwise/bwd_dkdv_reduce.cuh"
#include "sm80/bwd_dkdv.cuh"
#include "sm80/bwd_dq.cuh"
