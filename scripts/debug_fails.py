"""One-off: the seqused test's inputs with NaN against finite fill in the unused rows (which part fails)."""
import numpy as np
import cupy
from cuflash import varlen
from cuflash.mask import MaskOptions
from tests.gpu import test_seqused_gpu as t

for fill in (np.nan, 1000.0):
    rng = np.random.default_rng(0)
    (q, k, v, dout), oq, ok = t._inputs(rng, 4, 4, 64, cupy.float16, fill)
    cu_q, cu_k = cupy.asarray(oq), cupy.asarray(ok)
    used = dict(seqused_q=t.USED_Q, seqused_k=t.USED_K)
    out, lse = varlen._forward_cupy(q, k, v, cu_q, cu_k, max(t.LENS_Q), max(t.LENS_K), MaskOptions.of(), None, **used)
    dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(t.LENS_Q), max(t.LENS_K), **used)
    for b in range(6):
        uq = slice(int(oq[b]), int(oq[b]) + t.USED_Q[b]); rq = slice(uq.stop, int(oq[b + 1]))
        uk = slice(int(ok[b]), int(ok[b]) + t.USED_K[b]); rk = slice(uk.stop, int(ok[b + 1]))
        f = lambda x: (int(cupy.isnan(x.astype(cupy.float32)).sum()), float(cupy.nan_to_num(x.astype(cupy.float32)).__abs__().max()) if x.size else 0.0)
        print(f"fill {fill} seq {b}: out used {f(out[uq])} rest {f(out[rq])} lse rest {cupy.asnumpy(lse[:, rq]).ravel()[:3]} "
              f"dq used {f(dq[uq])} rest {f(dq[rq])} dk used {f(dk[uk])} rest {f(dk[rk])} dv used {f(dv[uk])}")
