// cuflash/kernels_cu/flash_fwd_v1.cuh
// Entry header of the v1 forward (FlashAttention-1, Algorithm 1) for the generated shells
// (cuflash/_compile.py, _KERNELS["fwd_v1"]). See README.md for the map of kernels_cu/.
#pragma once
#include "common.cuh"
#include "attn/params.cuh"
#include "sm80/fwd_v1.cuh"
