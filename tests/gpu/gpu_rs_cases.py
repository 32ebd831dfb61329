"""Rank-side functions of the multi-rank GPU tests of matmul_reduce_scatter (several processes
sharing one GPU through the IPC provider)."""
from __future__ import annotations

import torch

import ficco
from ficco import config
from ficco.backends import get_backend
from ficco.runtime import path as runtime

from ..reference import ROW_TOL, max_row_rel_err
from ..rs_cases import expected, make_inputs
from .gpu_cases import capture


def schedule_case(rank, world, schedule, transport, dtype_name, seed, reduce_op="sum"):
    """One matmul_reduce_scatter on the GPU (uneven rows, two b) against float64."""
    dtype = getattr(torch, dtype_name)
    dev = get_backend().device()
    failures = []
    a_s, b_s, refs = make_inputs(seed, world, (13, 24), (7, 5), dtype)
    with config.scope(transport=transport):
        outs = ficco.matmul_reduce_scatter(a_s[rank].to(dev), [b.to(dev) for b in b_s[rank]],
                                           reduce_op=reduce_op, schedule=schedule)
    for j, out in enumerate(outs):
        ref = expected(refs, j, rank, reduce_op, world)
        err = max_row_rel_err(out, ref)
        if out.device.type != dev.type or not err <= ROW_TOL[dtype]:
            failures.append(f"b{j}: {out.device} err {err:.3g}")
    if world > 1 and runtime.last_run() != (schedule, transport):
        failures.append(f"ran {runtime.last_run()}, not {(schedule, transport)}")
    return failures


def capture_replay(rank, world, schedule, seed):
    """One dma call captured in a CUDA graph, replayed on fresh inputs: every replay must
    match float64 (the Reduce ops are torch kernels on the compute stream, captured too)."""
    device = get_backend().device()
    m, k, n = 24, 16, 12
    a = torch.empty(m, k, device=device)
    b = torch.empty(k, n, device=device)
    failures = []
    with config.scope(transport="dma"):
        a_s, b_s, _ = make_inputs(seed, world, (m, k), (n,), torch.float32)
        a.copy_(a_s[rank])
        b.copy_(b_s[rank][0])
        graph, out = capture(lambda: ficco.matmul_reduce_scatter(a, b, schedule=schedule))
        for replay in range(3):
            a_s, b_s, refs = make_inputs(seed + 1 + replay, world, (m, k), (n,), torch.float32)
            a.copy_(a_s[rank])
            b.copy_(b_s[rank][0])
            graph.replay()
            torch.cuda.synchronize()
            err = max_row_rel_err(out, refs[0][rank])
            if not err <= ROW_TOL[torch.float32]:
                failures.append(f"replay {replay}: error {err:.3g}")
    return failures
