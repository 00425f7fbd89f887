"""Ring attention on several GPUs (issue 15; needs 2+ GPUs: the nvidia-h200-x2 machine; passes there).

One process per GPU (torch.multiprocessing, NCCL). Every rank builds the same whole-sequence q, k, v
and dout (same seed), takes its shard, runs cuflash.distributed.ring_attention forward and backward,
and gathers the results; they must be as close to a float32 reference of whole-sequence attention
as single-GPU cuflash is (FlashAttention's 2x rule, plus the dtype's rounding at the values' size)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: ring attention not tested")

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _reference(q, k, v, dout, causal):
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    group = qf.shape[2] // kf.shape[2]
    kr, vr = (x.repeat_interleave(group, dim=2) for x in (kf, vf))
    out = torch.nn.functional.scaled_dot_product_attention(qf.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                                           is_causal=causal).transpose(1, 2)
    grads = torch.autograd.grad(out, (qf, kf, vf), dout.float())
    return out.detach(), grads


def _allowed(got, ref, same):
    err = (got.float() - ref).abs().max().item()
    pt = (same.float() - ref).abs().max().item()
    return err, 2 * pt + 2 * torch.finfo(got.dtype).eps * ref.abs().max().item()


def _worker(rank, world, init, case):
    import torch.distributed as dist

    import cuflash
    from cuflash import distributed as cfd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        b, n, h, hkv, d, causal, dtype = case
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(b, n, hh, d, device="cuda", generator=g).to(dtype) for hh in (h, hkv, hkv, h))
        shard = (lambda x: cfd.zigzag_shard(x, rank, world)) if causal else (lambda x: x.chunk(world, dim=1)[rank])
        ql, kl, vl = (shard(x).detach().clone().requires_grad_() for x in (q, k, v))
        out_l = cfd.ring_attention(ql, kl, vl, causal=causal)
        grads_l = torch.autograd.grad(out_l, (ql, kl, vl), shard(dout))

        def gather(x):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            return cfd.zigzag_unshard(parts) if causal else torch.cat(parts, dim=1)

        out = gather(out_l.detach())
        grads = [gather(gl) for gl in grads_l]
        ref_out, ref_grads = _reference(q, k, v, dout, causal)
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))  # single-GPU cuflash
        single = cuflash.attention(qs, ks, vs, causal=causal)
        single_grads = torch.autograd.grad(single, (qs, ks, vs), dout)
        err, allowed = _allowed(out, ref_out, single)
        assert err <= allowed, f"rank {rank}: out err {err:.3e} > {allowed:.3e}"
        for name, gr, rf, sg in zip(("dq", "dk", "dv"), grads, ref_grads, single_grads):
            err, allowed = _allowed(gr, rf, sg)
            assert err <= allowed, f"rank {rank}: {name} err {err:.3e} > {allowed:.3e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", [
    (1, 2048, 4, 4, 128, True, torch.bfloat16), (2, 1000, 4, 2, 64, False, torch.float16),
    (1, 4104, 8, 2, 128, True, torch.float16), (1, 1024, 2, 1, 64, True, torch.bfloat16),
], ids=["causal-bf16", "full-gqa-fp16", "causal-odd-chunks-gqa", "causal-mqa"])
def test_ring_attention_matches_whole_sequence_attention(case, tmp_path):
    if _gpus() < 2:
        pytest.skip(f"ring attention needs 2 GPUs, this machine has {_gpus()}")
    world = 2
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the lent machines ask for NVLink multicast off
    torch.multiprocessing.spawn(_worker, args=(world, init, case), nprocs=world, join=True)
