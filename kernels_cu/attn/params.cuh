// cuflash/kernels_cu/attn/params.cuh
// Kernel parameter lists: the ABI between the generated extern "C" shells (cuflash/_compile.py)
// and the launch code (cuflash/_forward.py, _forward_v1.py, _backward.py). Order matters: the host
// passes arguments positionally. Strides are in elements and 64-bit, so batch*seqlen*heads*head_dim
// may pass 2^31. (Target: one __grid_constant__ struct per pass, mirrored in Python.)
//
// v1 workspace: ws_o fp32 (batch*heads, seqlen_q, D) contiguous; ws_ml fp32 (batch*heads,
// seqlen_q, 2) = (m, l), m in raw (unscaled) score units. Neither needs initialising.
#pragma once
#include "core/types.cuh"

#define CUFLASH_FWD_PARAMS                                                              \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,       \
    const cuflash::elem_t* __restrict__ v, cuflash::elem_t* __restrict__ o,             \
    float* __restrict__ lse,                                                            \
    long long q_sb, long long q_sn, long long q_sh,                                     \
    long long k_sb, long long k_sn, long long k_sh,                                     \
    long long v_sb, long long v_sn, long long v_sh,                                     \
    long long o_sb, long long o_sn, long long o_sh,                                     \
    int n_heads, int seqlen_q, int seqlen_k, int m_blocks, float scale_log2, int causal, \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale

#define CUFLASH_FWD_ARGS                                                                \
    q, k, v, o, lse, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh,              \
    o_sb, o_sn, o_sh, n_heads, seqlen_q, seqlen_k, m_blocks, scale_log2, causal,        \
    drop_seed, drop_threshold, drop_scale

#define CUFLASH_FWDV1_PARAMS                                                            \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,       \
    const cuflash::elem_t* __restrict__ v, cuflash::elem_t* __restrict__ o,             \
    float* __restrict__ lse, float* ws_o, float* ws_ml,                                 \
    long long q_sb, long long q_sn, long long q_sh,                                     \
    long long k_sb, long long k_sn, long long k_sh,                                     \
    long long v_sb, long long v_sn, long long v_sh,                                     \
    long long o_sb, long long o_sn, long long o_sh,                                     \
    int n_heads, int seqlen_q, int seqlen_k, int m_blocks, float scale_log2, int causal, \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale

#define CUFLASH_FWDV1_ARGS                                                              \
    q, k, v, o, lse, ws_o, ws_ml, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, \
    o_sb, o_sn, o_sh, n_heads, seqlen_q, seqlen_k, m_blocks, scale_log2, causal,        \
    drop_seed, drop_threshold, drop_scale

#define CUFLASH_PREP_PARAMS                                                               \
    const cuflash::elem_t* __restrict__ o, const cuflash::elem_t* __restrict__ dout,      \
    const float* __restrict__ lse, float* __restrict__ delta, float* __restrict__ lse2,   \
    float* __restrict__ dq_acc,                                                           \
    long long o_sb, long long o_sn, long long o_sh,                                       \
    long long do_sb, long long do_sn, long long do_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_q_pad, long long n_rows

#define CUFLASH_PREP_ARGS                                                                 \
    o, dout, lse, delta, lse2, dq_acc, o_sb, o_sn, o_sh, do_sb, do_sn, do_sh, n_heads,    \
    seqlen_q, seqlen_q_pad, n_rows

#define CUFLASH_CONVERT_PARAMS                                                            \
    const float* __restrict__ dq_acc, cuflash::elem_t* __restrict__ dq,                   \
    long long dq_sb, long long dq_sn, long long dq_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_q_pad, float scale, long long n_rows

#define CUFLASH_CONVERT_ARGS dq_acc, dq, dq_sb, dq_sn, dq_sh, n_heads, seqlen_q, seqlen_q_pad, scale, n_rows

#define CUFLASH_BWD_PARAMS                                                                \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,         \
    const cuflash::elem_t* __restrict__ v, const cuflash::elem_t* __restrict__ dout,      \
    const float* __restrict__ lse2, const float* __restrict__ delta,                      \
    float* __restrict__ dq_acc, cuflash::elem_t* __restrict__ dk,                         \
    cuflash::elem_t* __restrict__ dv,                                                     \
    long long q_sb, long long q_sn, long long q_sh,                                       \
    long long k_sb, long long k_sn, long long k_sh,                                       \
    long long v_sb, long long v_sn, long long v_sh,                                       \
    long long do_sb, long long do_sn, long long do_sh,                                    \
    long long dk_sb, long long dk_sn, long long dk_sh,                                    \
    long long dv_sb, long long dv_sn, long long dv_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_k, int seqlen_q_pad, int n_blocks,              \
    float scale_log2, float scale, int causal,                                            \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale

#define CUFLASH_BWD_ARGS                                                                  \
    q, k, v, dout, lse2, delta, dq_acc, dk, dv, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh,       \
    v_sb, v_sn, v_sh, do_sb, do_sn, do_sh, dk_sb, dk_sn, dk_sh, dv_sb, dv_sn, dv_sh,      \
    n_heads, seqlen_q, seqlen_k, seqlen_q_pad, n_blocks, scale_log2, scale, causal,       \
    drop_seed, drop_threshold, drop_scale

#define CUFLASH_DQ_PARAMS                                                                 \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,         \
    const cuflash::elem_t* __restrict__ v, const cuflash::elem_t* __restrict__ dout,      \
    const float* __restrict__ lse2, const float* __restrict__ delta,                      \
    cuflash::elem_t* __restrict__ dq,                                                     \
    long long q_sb, long long q_sn, long long q_sh,                                       \
    long long k_sb, long long k_sn, long long k_sh,                                       \
    long long v_sb, long long v_sn, long long v_sh,                                       \
    long long do_sb, long long do_sn, long long do_sh,                                    \
    long long dq_sb, long long dq_sn, long long dq_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_k, int seqlen_q_pad, int m_blocks,              \
    float scale_log2, float scale, int causal,                                            \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale

#define CUFLASH_DQ_ARGS                                                                   \
    q, k, v, dout, lse2, delta, dq, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, \
    do_sb, do_sn, do_sh, dq_sb, dq_sn, dq_sh, n_heads, seqlen_q, seqlen_k, seqlen_q_pad,  \
    m_blocks, scale_log2, scale, causal, drop_seed, drop_threshold, drop_scale
