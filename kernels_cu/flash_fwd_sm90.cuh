// cuflash/kernels_cu/flash_fwd_sm90.cuh
// Entry header of the Hopper forward (sm_90a only: wgmma, setmaxnreg) for the generated shells
// (cuflash/families/sm90.py). The shell takes the Q, K, V tensor maps by value
// (`const __grid_constant__ cuflash::TmaMap`), then out, lse and the FwdParams fields.
#pragma once
#include "common.cuh"
#include "attn/params.cuh"
#include "sm90/fwd.cuh"
