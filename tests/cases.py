"""Rank-side functions for the multi-rank tests (importable by the spawned ranks)."""
from __future__ import annotations

import torch

import ficco
from ficco import api, config

from .reference import ROW_TOL, make_inputs, max_row_rel_err

# (label, shard shape, ns, gather_dim, return_gathered)
SHAPES = [
    ("divisible", (16, 24), (20,), 0, False),
    ("uneven", (13, 10), (7,), 0, True),
    ("rows<W", (2, 9), (5,), 0, False),
    ("3d-dim1", (2, 5, 12), (6,), 1, True),
    ("several-b", (9, 16), (7, 11, 3), 0, False),
]
DTYPES = (torch.float32, torch.bfloat16)


def run_matrix(rank, world, schedule, transport, seed):
    """Every shape x dtype for one schedule/transport; returns failures as strings."""
    failures = []
    with config.scope(transport=transport):
        for case, (label, shape, ns, gdim, ret) in enumerate(SHAPES):
            for dtype in DTYPES:
                shards, bs, full, refs = make_inputs(seed + case, world, shape, ns, dtype, gdim)
                b_arg = bs if len(bs) > 1 else bs[0]
                result = ficco.all_gather_matmul(shards[rank], b_arg, gather_dim=gdim,
                                                 schedule=schedule, return_gathered=ret)
                gathered, outs = result if ret else (None, result)
                outs = outs if isinstance(outs, list) else [outs]
                expect_shape = tuple(full.shape[:-1])
                for j, (out, ref) in enumerate(zip(outs, refs)):
                    err = max_row_rel_err(out, ref)
                    if tuple(out.shape) != expect_shape + (ns[j],) or not err <= ROW_TOL[dtype]:
                        failures.append(f"{label}/{dtype}/b{j}: shape {tuple(out.shape)} "
                                        f"err {err:.3g}")
                if ret and not torch.equal(gathered, full):
                    failures.append(f"{label}/{dtype}: gathered A differs")
                if world > 1 and api.last_run() != (schedule, transport):
                    failures.append(f"{label}: ran {api.last_run()}, not {(schedule, transport)}")
    return failures


def fail_next_gemm(backend):
    """Make this rank's next GEMM raise ``RuntimeError("injected GEMM failure")`` once,
    whichever entry the executor takes (GPUs run compute-queue GEMMs through
    ``gemm_current``, other queues through ``gemm``). Returns the function that undoes it
    (for when no GEMM ran)."""
    names = [name for name in ("gemm", "gemm_current") if hasattr(backend, name)]
    real = {name: getattr(backend, name) for name in names}

    def restore():
        for name in names:
            setattr(backend, name, real[name])

    def broken(*args, **kwargs):
        restore()
        raise RuntimeError("injected GEMM failure")
    for name in names:
        setattr(backend, name, broken)
    return restore
