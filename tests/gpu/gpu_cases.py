"""Rank-side functions of the multi-rank GPU tests (several processes sharing one GPU through
the IPC provider; importable by the harness's spawned ranks)."""
from __future__ import annotations

import time

import torch

import ficco
from ficco import api, config
from ficco.backends import get_backend
from ficco.errors import CommTimeoutError
from ficco.plan.problem import Problem
from ficco.symm_mem.barrier import plan_barrier

from ..reference import ROW_TOL, make_inputs, max_row_rel_err


def _pattern(rank: int, rows: int, cols: int, device) -> torch.Tensor:
    """Distinct values per rank, row and column (exact in float32)."""
    r = torch.arange(rows, device=device, dtype=torch.float32)[:, None]
    c = torch.arange(cols, device=device, dtype=torch.float32)[None, :]
    return rank * 10000 + r * 100 + c


def ipc_pull(rank, world, m, k):
    """Publish a pattern into this rank's rows, barrier on the compute stream, then pull every
    peer's shard: rows 1-D by uneven row chunks, columns 2-D by uneven column chunks, each peer
    on its own copy stream. Returns the number of wrong elements."""
    backend = get_backend()
    dev = backend.device()
    symm = backend.symm_provider().allocate(2 * world * m * k * 4, None, dev)
    try:
        problem = Problem(m=m, k=k, ns=(1,), dtype="float32", world=world, rank=rank)
        rows_buf = symm.get_buffer(rank, (world * m, k), torch.float32)
        cols_buf = symm.get_buffer(rank, (world * m, k), torch.float32, offset=world * m * k * 4)
        rows_buf.fill_(float("nan"))
        cols_buf.fill_(float("nan"))
        compute = backend.queue("compute")
        mine = _pattern(rank, m, k, dev)
        rows_buf[rank * m:(rank + 1) * m].copy_(mine)
        cols_buf[rank * m:(rank + 1) * m].copy_(mine)
        plan_barrier(backend, symm, 0, compute, 30.0, 0)
        published = backend.new_event()
        backend.record(published, compute)
        queues = [compute]
        for peer in range(world):
            if peer == rank:
                continue
            q = backend.queue(f"copy{peer}")
            queues.append(q)
            backend.wait(published, q)
            theirs_rows = symm.get_buffer(peer, (world * m, k), torch.float32)
            theirs_cols = symm.get_buffer(peer, (world * m, k), torch.float32,
                                          offset=world * m * k * 4)
            base = peer * m
            for r0, nr in problem.row_chunks():
                backend.copy(rows_buf[base + r0: base + r0 + nr],
                             theirs_rows[base + r0: base + r0 + nr], q)
            for c0, nc in problem.col_chunks():
                backend.copy_2d(cols_buf[base: base + m, c0: c0 + nc],
                                theirs_cols[base: base + m, c0: c0 + nc], q)
        backend.finish(queues)
        plan_barrier(backend, symm, 1, compute, 30.0, 1)  # nobody frees while a peer still reads
        backend.synchronize()
        expect = torch.cat([_pattern(p, m, k, dev) for p in range(world)])
        wrong = int((rows_buf != expect).sum()) + int((cols_buf != expect).sum())
    finally:
        symm.close()
    return wrong


def stalled_peer(rank, world, timeout_s):
    """Rank 0 enters a barrier rank 1 never enters: rank 0 must raise CommTimeoutError naming
    rank 1 within about ``timeout_s``, and its stream must be released. Returns rank 0's error
    text (others return "")."""
    backend = get_backend()
    symm = backend.symm_provider().allocate(1024, None, backend.device())
    message = ""
    try:
        if rank == 0:
            start = time.monotonic()
            plan_barrier(backend, symm, 0, backend.queue("compute"), timeout_s, 5)
            try:
                backend.synchronize()   # returns once the watchdog released the stream
                backend.raise_pending(symm)    # the group's error
            except CommTimeoutError as exc:
                message = f"{exc} after {time.monotonic() - start:.1f}s"
    finally:
        symm.close()
    return message


def schedule_case(rank, world, schedule, transport, dtype_name, seed):
    """One all_gather_matmul on the GPU against the float64 reference; returns failures."""
    dtype = getattr(torch, dtype_name)
    dev = get_backend().device()
    failures = []
    shape, ns = (13, 24), (7, 5)          # uneven: 13 rows and 24 columns over W chunks
    with config.scope(transport=transport):
        shards, bs, full, refs = make_inputs(seed, world, shape, ns, dtype)
        a = shards[rank].to(dev)
        b_list = [b.to(dev) for b in bs]
        gathered, outs = ficco.all_gather_matmul(a, b_list, schedule=schedule,
                                                 return_gathered=True)
        for j, (out, ref) in enumerate(zip(outs, refs)):
            err = max_row_rel_err(out, ref)
            if out.device != a.device or not err <= ROW_TOL[dtype]:
                failures.append(f"b{j}: {out.device} err {err:.3g}")
        if not torch.equal(gathered.cpu(), full):
            failures.append("gathered A differs")
        if world > 1 and api.last_run() != (schedule, transport):
            failures.append(f"ran {api.last_run()}, not {(schedule, transport)}")
    return failures


def capture(call):
    """One eager ``call()`` (agreement, workspace, plan cache), then ``call()`` captured into
    a CUDA graph: returns (graph, the captured call's output)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def replays_match_float64(graph, out, shard, b, rank, world, seed, replays, label="replay"):
    """Replay an all_gather_matmul ``graph`` on fresh inputs written into its captured
    ``shard`` and ``b``; returns a failure line per replay whose ``out`` is off float64."""
    m, k = shard.shape
    n = b.shape[1]
    failures = []
    for replay in range(replays):
        gen = torch.Generator().manual_seed(seed + 1 + replay)
        full = torch.randn(world * m, k, generator=gen)
        b_host = torch.randn(k, n, generator=gen)
        shard.copy_(full[rank * m:(rank + 1) * m])
        b.copy_(b_host)
        graph.replay()
        torch.cuda.synchronize()
        ref = full.double() @ b_host.double()
        err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        if not err < 1e-5:
            failures.append(f"{label} {replay}: relative error {err:.3g}")
    return failures


def capture_replay(rank, world, schedule, seed):
    """One call captured in a CUDA graph, then replayed on fresh inputs written into the
    captured input: every replay must match float64 (barriers write only constants, so a
    replay is a full, correctly synchronised call). Returns the failures."""
    device = get_backend().device()
    m, k, n = 24, 40, 16
    shard = torch.empty(m, k, device=device)
    b = torch.empty(k, n, device=device)
    with ficco.config.scope(transport="dma"):
        gen = torch.Generator().manual_seed(seed)
        shard.copy_(torch.randn(world * m, k, generator=gen)[rank * m:(rank + 1) * m])
        b.copy_(torch.randn(k, n, generator=gen))
        graph, out = capture(lambda: ficco.all_gather_matmul(shard, b, schedule=schedule))
        return replays_match_float64(graph, out, shard, b, rank, world, seed, 4)
