// cuflash/kernels_cu/flash_bwd_sm90.cuh
// Entry header of the Hopper backward's dK/dV (+ atomic dQ) kernel (sm_90a only) for the generated
// shells: the Q, K, V, dO tensor maps by value, then lse2, delta, dq_acc, dk, dv and the BwdParams
// fields. bwd_prep and bwd_dq_convert (flash_bwd.cuh) run around it, as in the sm80 backward.
#pragma once
#include "common.cuh"
#include "attn/params.cuh"
#include "sm90/bwd.cuh"
