"""Rank functions: fp8 all-gather matmul and matmul reduce-scatter on the fake GPU
(tests/fake_gpu.py) through dma and ccl, returning the largest error against float64."""
from __future__ import annotations

import torch

import ficco
from ficco import config

from . import fake_gpu

E4 = torch.float8_e4m3fn
AG = ("uniform-fused-1d", "uniform-fused-2d", "hetero-unfused-2d", "ring")
RS = ("ring", "uniform-unfused-1d", "hetero-fused-1d", "hetero-unfused-2d")


def _quantized(t: torch.Tensor, scaling: str):
    """(fp8 t, its float32 scale): one scale, or one per row."""
    amax = t.abs().amax(1, keepdim=True) if scaling == "row" else t.abs().max()
    scale = (amax.clamp_min(1e-12) / 224.0).float()
    return (t / scale).to(E4), scale


def _weight(w: torch.Tensor, scaling: str):
    """A (K, n) column-major fp8 weight from an (n, K) one, and its scale ((1, n) or one)."""
    q, scale = _quantized(w, scaling)
    return q.t(), (scale.t().contiguous() if scaling == "row" else scale)


def errors(rank, world, seed):
    """{(op, schedule, transport, scaling, out dtype): max |out - ref| / max |ref|}."""
    ficco.shutdown()
    real_shutdown = ficco.shutdown
    fake_gpu.install("cuda", 8)
    ficco.shutdown = lambda: (real_shutdown(), fake_gpu.ensure("cuda", 8))
    try:
        return _errors(rank, world, seed)
    finally:
        ficco.shutdown = real_shutdown
        ficco.shutdown()
        fake_gpu.uninstall()


def _errors(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    m, k, n = 5, 32, 16
    out = {}
    for scaling in ("tensor", "row"):
        shards = [torch.randn(m, k, generator=gen) for _ in range(world)]
        if scaling == "tensor":   # one scale on every rank
            shared = torch.cat(shards).abs().max() / 224.0
            qs = [((s / shared).to(E4), shared.float()) for s in shards]
        else:
            qs = [_quantized(s, "row") for s in shards]
        qb, sb = _weight(torch.randn(n, k, generator=gen), scaling)
        full = torch.cat([q.double() * s.double() for q, s in qs])
        ref = full @ (qb.double() * sb.double())
        parts = [(_quantized(torch.randn(world * m, k, generator=gen), scaling),
                  _weight(torch.randn(n, k, generator=gen), scaling)) for _ in range(world)]
        rs_ref = sum((qa.double() * sa.double()) @ (w.double() * sw.double())
                     for (qa, sa), (w, sw) in parts)[rank * m:(rank + 1) * m]
        (qa, sa), (w, sw) = parts[rank]
        for transport in ("dma", "ccl"):
            for dtype in (torch.float32, torch.bfloat16):
                with config.scope(transport=transport):
                    for name in AG:
                        got = ficco.all_gather_matmul(qs[rank][0], qb, schedule=name,
                                                      a_scale=qs[rank][1], b_scale=sb,
                                                      out_dtype=dtype)
                        torch.cuda.synchronize()   # host reads: after the stream ran
                        err = (got.double() - ref).abs().max() / ref.abs().max()
                        out["ag", name, transport, scaling, str(dtype)] = err.item()
                    for name in RS:
                        got = ficco.matmul_reduce_scatter(qa, w, schedule=name, a_scale=sa,
                                                          b_scale=sw, out_dtype=dtype)
                        torch.cuda.synchronize()
                        err = (got.double() - rs_ref).abs().max() / rs_ref.abs().max()
                        out["rs", name, transport, scaling, str(dtype)] = err.item()
    return out
