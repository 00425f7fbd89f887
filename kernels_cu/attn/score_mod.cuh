// cuflash/kernels_cu/attn/score_mod.cuh
// Score modifiers: what happens to a raw score S = Q K^T between the Q K^T product and the mask,
// in fragment coordinates (any C-fragment tile acc[NT][4], core/frag.cuh; S^T alike, the
// modifier is element-wise). Every mainloop calls it at one hook point:
//   forward (sm80 v2, v1, sm90):   S -> ScoreMod::apply -> Mask -> OnlineSoftmax
//   backward (dK/dV, dQ, sm90):    S -> ScoreMod::apply -> P = exp2(. c - lse2) -> Mask
//                                  dS = P o (dP - delta) o ScoreMod::grad(modified score)
// Today's one modifier is softcap (Gemma 2; FlashAttention >= 2.6), V::kSoftcap:
//
//   score = c * tanh(softmax_scale * S / c)                (c = softcap > 0)
//
// computed as FlashAttention does, with softmax_scale folded into the tanh's argument:
// apply() leaves t = tanh(S * softcap_scale) in the tile, softcap_scale = softmax_scale / c (a
// params field), and the host sets the softmax's scale_log2 to c * log2(e), so OnlineSoftmax,
// the lse and the backward's exp2(t c log2e - lse2) run unchanged on t. The backward's dS is
// with respect to softmax_scale * S (the kernels apply softmax_scale to dQ and dK at the end), so
// the chain rule adds the factor d(c tanh(x / c)) / dx = 1 - t^2 (grad). t is recomputed from
// the recomputed S in the backward (nothing is stored by the forward).
//
// Masks apply after the modifier: a masked element is -inf (forward, dQ kernel: after apply) or
// has P = 0 (dK/dV kernels: P zeroed after the exp), and grad(-inf) = 0 so that dS stays 0 there,
// never 0 * inf.
//
// Without V::kSoftcap every member compiles to nothing (apply) or the constant 1 (grad).
#pragma once
#include "attn/features.cuh"
#include "core/frag.cuh"
#include "core/types.cuh"

namespace cuflash {

// tanh on the special function unit (MUFU.TANH, sm_75+): one instruction, where tanhf is a ~20
// instruction sequence with a branch. Softcap adds this op to EVERY score element of every tile,
// next to the softmax's ex2 on the same unit, so its cost is what decides softcap's speed.
// Accuracy: the PTX ISA bounds it at about 2^-11 relative; measured over all floats it is ~1.1e-5
// relative (~16.5 bits, N. Juffa on the NVIDIA developer forums), so a score c t is off by at most
// ~1e-5 |softmax_scale S|, far below the 16-bit rounding of P. FlashAttention uses the same
// instruction (cutlass fast_tanh). tanh(+-inf) = +-1.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <class V>
struct ScoreMod {
    static constexpr bool kOn = V::kSoftcap;
    float tanh_scale;  // softmax_scale / softcap (the params' softcap_scale); unused without softcap

    // From a pass's parameter struct (attn/params.cuh); the plain instances read nothing.
    template <class Params>
    __device__ __forceinline__ static ScoreMod of(const Params& p) {
        ScoreMod m;
        m.tanh_scale = kOn ? p.softcap_scale : 0.f;
        return m;
    }

    // One element: the modified score in the softmax's units (t; the softmax scales it by c).
    __device__ __forceinline__ float value(float s) const {
        if constexpr (kOn) return tanh_approx(s * tanh_scale);
        return s;
    }

    // S <- modified score in place over an m16 tile acc[NT][4] (rows and columns are irrelevant:
    // the Direct view of the forward and the dQ kernel, and the dK/dV kernels' S^T alike).
    template <int NT>
    __device__ __forceinline__ void apply_tile(float (&acc)[NT][4]) const {
        if constexpr (kOn) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] = value(acc[nt][e]);
        }
    }

    // A warp tile acc[MT][NT][4].
    template <int MT, int NT>
    __device__ __forceinline__ void apply(float (&acc)[MT][NT][4]) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) apply_tile(acc[mt]);
    }

    // d score / d (softmax_scale S) from the modified score t = value(S): 1 - t^2, which the
    // backward multiplies into dS. Clamped at 0: exact for |t| <= 1 (tanh.approx stays in
    // [-1, 1]) and 0 for a masked t = -inf (1 - inf would give dS = 0 * -inf = NaN). 1 without
    // a modifier (the multiply then folds away).
    __device__ __forceinline__ static float grad(float t) {
        if constexpr (kOn) return fmaxf(fmaf(-t, t, 1.f), 0.f);
        return 1.f;
    }
};

// ALiBi (BLOOM, MPT; FlashAttention's alibi_slopes), V::kAlibi: a position bias added to the
// modified score, on every tile, before the mask:
//
//   score(q, k) += -slope_h |q + offset - k|        (softmax units; offset: the mask geometry's)
//
// so under bottom-right alignment a row's own diagonal key (k = q + seqlen_k - seqlen_q) has bias 0,
// FlashAttention's convention, causal or not. The kernels hold scores in their own units (raw S,
// or softcap's t), which the softmax scales by scale_log2: the host folds the conversion into
// params.alibi_scale (1 / softmax_scale, or 1 / softcap), so the per-element cost is one FFMA on
// |distance|. The slope is read once per (batch, head) from alibi_slopes[b * alibi_sb + h]. The
// bias does not depend on S, so a backward's dS passes through it unchanged. The backward kernels
// add it inside the exp's argument instead (shift(), the slope pre-multiplied by scale_log2:
// P = exp2(t c + bias c - lse2)), which leaves t in place for softcap's derivative 1 - t^2.
template <class V>
struct AlibiBias {
    static constexpr bool kOn = V::kAlibi;
    float slope;  // -slope_h * alibi_scale: the bias per key of distance, in the kernel's score units
    int offset;   // query q's diagonal key is q + offset (MaskGeometry::offset, per batch where it moves)

    // `factor`: 1 for scores (the forward), scale_log2 for exp2 arguments (the backward's shift)
    template <class Params>
    __device__ __forceinline__ static AlibiBias of(const Params& p, const float* __restrict__ slopes, int b, int h,
                                                   int offset, float factor = 1.f) {
        AlibiBias a{0.f, 0};  // without ALiBi nothing is read (the plain instances' code stays as it was)
        if constexpr (kOn) {
            a.slope = -slopes[(long long)b * p.alibi_sb + h] * (p.alibi_scale * factor);
            a.offset = offset;
        }
        return a;
    }

    // The bias of (query q, key k), in the units `of` was given.
    __device__ __forceinline__ float at(int q, int k) const { return slope * fabsf((float)(q + offset - k)); }

    // x + the bias of (q, k): an exp2 argument (-lse2) shifted by it; x itself without ALiBi.
    __device__ __forceinline__ float shift(float x, int q, int k) const {
        if constexpr (kOn) return fmaf(slope, fabsf((float)(q + offset - k)), x);
        return x;
    }

    // One m16 tile acc[NT][4], rows queries q0 + 0..15, columns keys k0 + 0..8 NT-1 (Direct view:
    // the forward, the dQ kernel).
    template <int NT>
    __device__ __forceinline__ void apply_tile(float (&acc)[NT][4], int q0, int k0, int lane) const {
        if constexpr (kOn) {
            using F = FragSm80<1, NT>;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                // The signed distance of this lane's first column, converted once: each score then
                // takes an FADD with an immediate and an FFMA with |.| (full-rate FP32). Converting per
                // score (I2F) ran on the quarter-rate pipe that exp2 needs: the sm90 forward lost 18%.
                // Exact while distances stay below 2^24.
                const float diag0 = (float)(q0 + F::row_of_half(lane, 0, half) + offset - k0 - F::col(lane, 0, 0));
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float dist = fabsf(diag0 - (float)(F::col(lane, nt, e) - F::col(lane, 0, 0)));
                        acc[nt][2 * half + e] = fmaf(slope, dist, acc[nt][2 * half + e]);
                    }
            }
        }
    }

    // The sm90 forward's form: one FFMA per score on blocks away from the diagonal. When the warp's
    // 16 rows (queries q0..q0+15) see the whole block [k0, k0 + 8 NT) on one side of their
    // diagonals, the bias slope |D_r - c| (D_r the row's diagonal in block columns) splits into a
    // column part, FFMA'd into the score with the column as an immediate, and a row part (with the
    // lane's column offset) returned in row_shift[half]: the softmax adds that to this thread's
    // max before the quad reduction and subtracts it from m in the exp2
    // argument (OnlineSoftmax::max_get_scale_shifted), so no score pays for it. The column part is
    // small (slope x 8 NT at most), which also keeps the large distances out of the scores. A
    // block across a diagonal (one or two per row block) takes the full bias and a zero shift.
    template <int NT>
    __device__ __forceinline__ void apply_split(float (&acc)[NT][4], int q0, int k0, int lane,
                                                float (&row_shift)[2]) const {
        using F = FragSm80<1, NT>;
        const int first = q0 + offset - k0;  // the warp's first row's diagonal, in block columns
        const bool left = first >= 8 * NT - 1, right = first + 15 <= 0;  // warp-uniform
        if (left || right) {
            // left of every diagonal: slope (D - c); right: slope (c - D); c = lane part + immediate
            const float step = left ? -slope : slope;
#pragma unroll
            for (int half = 0; half < 2; ++half)
                row_shift[half] = -step * (float)(first + F::row_of_half(lane, 0, half) - F::col(lane, 0, 0));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc[nt][e] = fmaf((float)(F::col(lane, nt, e) - F::col(lane, 0, 0)), step, acc[nt][e]);
        } else {
            row_shift[0] = row_shift[1] = 0.f;
            apply_tile(acc, q0, k0, lane);
        }
    }

    // A warp tile acc[MT][NT][4] (rows = queries from q0, cols = keys from k0).
    template <int MT, int NT>
    __device__ __forceinline__ void apply(float (&acc)[MT][NT][4], int q0, int k0, int lane) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) apply_tile(acc[mt], q0 + 16 * mt, k0, lane);
    }
};

// A user modification (cuflash.ScoreMod, V::kUserMod): the caller's CUDA C++ snippets, which the
// generated shell compiles in as the specialisation UserModDefs<true> (cuflash/score_mods.py
// ModSource.cxx): static score(score, b, h, q_idx, kv_idx, aux) -> the modified score in softmax
// units, mask(b, h, q_idx, kv_idx, aux) -> whether the key is visible, and grad(score, b, h, q_idx,
// kv_idx, aux) -> d score_mod / d score (the backward), with kScore / kMask saying which the caller
// wrote. The backward masks the raw S first and takes the score and its derivative per element
// (value_grad). The primary template is the identity (instances without a user modification never
// call it). The kernels keep raw scores S; with a score snippet the host sets
// params.softcap_scale = softmax_scale (the snippet's `score` is softmax_scale S) and scale_log2 =
// log2(e) (the snippet's result is already in softmax units). q_idx, kv_idx are positions in the
// batch's sequences, clamped to them for padding rows and columns (which the masks remove and the
// stores skip), so a snippet may index aux arrays by position.
template <bool ON>
struct UserModDefs {
    static constexpr bool kScore = false, kMask = false;
    __device__ __forceinline__ static float score(float s, int, int, int, int, const void* const*) { return s; }
    __device__ __forceinline__ static bool mask(int, int, int, int, const void* const*) { return true; }
    __device__ __forceinline__ static float grad(float, int, int, int, int, const void* const*) { return 1.f; }
};

template <class V>
struct UserMod {
    using Defs = UserModDefs<V::kUserMod>;
    static constexpr bool kOn = V::kUserMod;
    static constexpr bool kScore = kOn && Defs::kScore;
    static constexpr bool kMask = kOn && Defs::kMask;
    const void* const* aux;  // the aux arrays' pointer table (mod_aux)
    float scale;             // softmax_scale: the snippet's score is scale * S
    int b, h, seqlen_q, seqlen_k;

    template <class Params>
    __device__ __forceinline__ static UserMod of(const Params& p, const void* const* __restrict__ mod_aux, int b, int h,
                                                 int seqlen_q, int seqlen_k) {
        UserMod m{nullptr, 0.f, 0, 0, 0, 0};
        if constexpr (kOn) m = UserMod{mod_aux, p.softcap_scale, b, h, seqlen_q, seqlen_k};
        return m;
    }

    // One score of (query q, key k), both inside their sequences. MASK false: the score snippet
    // alone (a block a block mask knows the mask keeps whole: attn/block_mask.cuh).
    template <bool MASK = true>
    __device__ __forceinline__ float at(float s, int q, int k) const {
        float r = s;
        if constexpr (kScore) r = Defs::score(s * scale, b, h, q, k, aux);
        if constexpr (kMask && MASK) {
            if (!Defs::mask(b, h, q, k, aux)) r = neg_inf();
        }
        return r;
    }

    // One m16 tile acc[NT][4], rows queries q0 + 0..15, columns keys k0 + 0..8 NT-1 (Direct view:
    // the forwards). MASK as at()'s.
    template <bool MASK = true, int NT>
    __device__ __forceinline__ void apply_tile(float (&acc)[NT][4], int q0, int k0, int lane) const {
        if constexpr (kOn && (kScore || MASK)) {
            using F = FragSm80<1, NT>;
            // The positions made opaque per tile: otherwise the compiler hoists each element's part
            // of a snippet that does not depend on k0 (q_idx - 8 nt - e ...) out of the key loop, one
            // register per element (a band mask spilled 36-300 B)
            asm volatile("" : "+r"(q0), "+r"(k0));
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                // padding rows and columns take the last position's value (clamped, so that a snippet
                // may index aux arrays by position); the mask and the store drop them anyway. A
                // branch to an unclamped copy for interior tiles made the band-mask instance spill.
                const int q = min(q0 + F::row_of_half(lane, 0, half), seqlen_q - 1);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int k = min(k0 + F::col(lane, nt, e), seqlen_k - 1);
                        acc[nt][2 * half + e] = at<MASK>(acc[nt][2 * half + e], q, k);
                    }
            }
        }
    }

    // A warp tile acc[MT][NT][4] (rows = queries from q0, cols = keys from k0).
    template <bool MASK = true, int MT, int NT>
    __device__ __forceinline__ void apply(float (&acc)[MT][NT][4], int q0, int k0, int lane) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) apply_tile<MASK>(acc[mt], q0 + 16 * mt, k0, lane);
    }

    // The backward's S^T tiles (keys are rows): element e of n8 tile nt is query q0 + 8 nt + 2 (lane
    // % 4) + e % 2 and key k0 + lane / 4 + 8 (e / 2) (the dK/dV kernels' view, sm80 and sm90).
    template <int NT>
    __device__ __forceinline__ void apply_transposed(float (&acc)[NT][4], int q0, int k0, int lane) const {
        if constexpr (kOn) {
            asm volatile("" : "+r"(q0), "+r"(k0));  // see apply_tile
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int q = min(q0 + 8 * nt + 2 * (lane % 4) + (e & 1), seqlen_q - 1);
                    const int k = min(k0 + lane / 4 + 8 * (e >> 1), seqlen_k - 1);
                    acc[nt][e] = at(acc[nt][e], q, k);
                }
        }
    }

    // The backward's per-element form with a score snippet, where the exp needs the modified score
    // and dS its derivative: raw S of (q, k), -inf where a built-in mask removed the key (the
    // kernels mask the raw tile first, so no copy of it is kept) -> the modified score, -inf where
    // either mask hides the key, and in g d score_mod / d score there (0 where hidden). Selects,
    // not branches: the snippets' values at hidden keys are computed and dropped.
    __device__ __forceinline__ float value_grad(float s, int q, int k, float& g) const {
        q = min(q, seqlen_q - 1);
        k = min(k, seqlen_k - 1);
        const float x = s * scale;
        const float r = Defs::score(x, b, h, q, k, aux);
        const float d = Defs::grad(x, b, h, q, k, aux);
        bool visible = s != neg_inf();
        if constexpr (kMask) visible = visible && Defs::mask(b, h, q, k, aux);
        g = visible ? d : 0.f;
        return visible ? r : neg_inf();
    }
};

}  // namespace cuflash
