"""The signal-gated Triton GEMM alone, in Triton's interpreter on CPU, against float64.

Tiny shapes: the interpreter runs each program in Python (about a millisecond per tile-step).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import re
import threading
import time
import uuid

import pytest
import torch

pytest.importorskip("triton", reason="Triton is an optional extra (pip install 'ficco[triton]')")
from ficco.errors import CommTimeoutError
from ficco.kernels import interpreter_reason
from ficco.kernels.gated_gemm import Segment, check_error, gated_gemm

from ..reference import ROW_TOL, max_row_rel_err

#: the tests that run the kernel in Triton's interpreter (CPU) skip one by one where it cannot
#: (Triton < 3.8, the GPU image's 3.6): the offline compiles and the GPU tests below still run
interpreted = pytest.mark.skipif(interpreter_reason() is not None,
                                 reason=interpreter_reason() or "")


def _reference(a, b):
    ref = a.to(torch.float64) @ b.to(torch.float64)
    ref.scale = a.to(torch.float64).abs() @ b.to(torch.float64).abs()
    return ref


def _segments_1d(world, rank, m, k, row_chunks):
    """Own shard first, then chunk c of every peer: flag c*W + q."""
    peers = [(rank + i) % world for i in range(1, world)]
    segs = [Segment(rank * m, m, ((0, k, -1),))]
    for c, (r0, rows) in enumerate(row_chunks):
        segs += [Segment(q * m + r0, rows, ((0, k, c * world + q),)) for q in peers if rows]
    return tuple(segs)


def _segments_2d(world, rank, m, col_chunks):
    peers = [(rank + i) % world for i in range(1, world)]
    k = sum(kc for _, kc in col_chunks)
    segs = [Segment(rank * m, m, ((0, k, -1),))]
    segs += [Segment(q * m, m, tuple((k0, kc, c * world + q)
                                     for c, (k0, kc) in enumerate(col_chunks) if kc))
             for q in peers]
    return tuple(segs)


def _split(total, parts):
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (i < extra)
        out.append((start, n))
        start += n
    return out


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_d,world", [(False, 3), (True, 4)])
def test_gated_gemm_matches_float64(dtype, two_d, world):
    """Uneven chunks (m=7 rows over W chunks, K=37 over W columns), n not a tile multiple,
    outputs poisoned with NaN so a tile left unwritten fails."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    m, k, n, rank = 7, 37, 45, 1
    a = torch.randn(world * m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    c = torch.full((world * m, n), float("nan"), dtype=dtype)
    segs = (_segments_2d(world, rank, m, _split(k, world)) if two_d
            else _segments_1d(world, rank, m, k, _split(m, world)))
    flags = torch.ones(world * world, dtype=torch.int32)
    local = a[rank * m:(rank + 1) * m].clone()
    a_gathered = a.clone()
    a_gathered[rank * m:(rank + 1) * m] = float("nan")   # own rows must come from `local`
    check_error(gated_gemm(local, a_gathered, b, c, segs, flags, local_row0=rank * m))
    assert max_row_rel_err(c, _reference(a, b)) <= ROW_TOL[dtype], f"seed {seed}"


@interpreted
@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("two_d", [False, True])
def test_persistent_grid_smaller_than_the_tiles_computes_every_tile(programs, two_d):
    """GPU launches cap the grid below the device's SMs/CUs, so each
    program walks several tiles (pid, pid + grid, ... in arrival order); every tile is still
    computed once, right, whatever the cap."""
    from ficco.kernels import configs

    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    world, m, k, n, rank = 3, 40, 37, 70, 2        # 32x32 tiles: more tiles than programs
    a = torch.randn(world * m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    c = torch.full((world * m, n), float("nan"))
    segs = (_segments_2d(world, rank, m, _split(k, world)) if two_d
            else _segments_1d(world, rank, m, k, _split(m, world)))
    flags = torch.ones(world * world, dtype=torch.int32)
    local = a[rank * m:(rank + 1) * m].clone()
    check_error(gated_gemm(local, a, b, c, segs, flags, local_row0=rank * m,
                           max_programs=programs))
    assert max_row_rel_err(c, _reference(a, b)) <= ROW_TOL[torch.float32], f"seed {seed}"
    assert configs.resident_programs(132) == 128 and configs.resident_programs(1) == 1


@interpreted
def test_wait_past_its_deadline_raises_naming_the_chunk_and_leaves_no_stale_value():
    """A flag that never comes: the wait ends at its deadline by the clock (it never hangs),
    raises the halt word (on GPUs the group's error word, so the call's fence
    poisons it and the next call raises), and every tile it did not compute is NaN, never the
    values C held before; the host error names the chunk."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    world, rank, m, k, n = 3, 0, 4, 8, 8
    a = torch.randn(world * m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    c = torch.randn(world * m, n, generator=gen)       # an earlier call's values
    stale = c.clone()
    segs = _segments_1d(world, rank, m, k, _split(m, world))
    flags = torch.ones(world * world, dtype=torch.int32)
    missing = 1 * world + 2            # chunk 1 of peer 2
    flags[missing] = 0
    halt = torch.zeros(1, dtype=torch.int32)
    start = time.monotonic()
    err = gated_gemm(a[:m].clone(), a, b, c, segs, flags, local_row0=0, timeout_s=0.2,
                     halt=halt)
    assert 0.2 <= time.monotonic() - start < 60
    with pytest.raises(CommTimeoutError, match="chunk 1 of peer 2"):
        check_error(err, lambda f: f"chunk {f // world} of peer {f % world}", 0.2)
    from ficco.symm_mem.fault import KERNEL

    assert int(halt[0]) == KERNEL
    ref = _reference(a, b)
    chunk_rows = slice(2 * m + 2, 2 * m + 3)   # peer 2's chunk 1: row 2 of its 4 rows
    assert torch.isnan(c[chunk_rows]).all()
    computed = ~c.isnan().any(dim=1)
    assert not (c == stale).any(), f"seed {seed}"       # nothing left from before
    assert max_row_rel_err(c[computed], ref[computed]) <= ROW_TOL[torch.float32], f"seed {seed}"


@interpreted
def test_a_wait_lasts_until_its_deadline_in_time():
    """Flags raised by a host thread 0.6 s into a 1.5 s deadline: the kernel waits for them
    and computes every tile (the budget counted polls at a guessed rate)."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    world, m, k, n = 2, 4, 8, 8
    a = torch.randn(world * m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    c = torch.full((world * m, n), float("nan"))
    segs = _segments_1d(world, 0, m, k, [(0, m)])
    flags = torch.zeros(world, dtype=torch.int32)
    timer = threading.Timer(0.6, lambda: flags.fill_(1))
    timer.start()
    try:
        err = gated_gemm(a[:m].clone(), a, b, c, segs, flags, local_row0=0, timeout_s=1.5)
    finally:
        timer.join()
    check_error(err)
    assert max_row_rel_err(c, _reference(a, b)) <= ROW_TOL[torch.float32], f"seed {seed}"


def _late_writer(path, numel, rows_slice, values, flag_offset, delay_s):
    """Another process: wait, write the peer rows into the shared file, then raise the flag."""
    shared = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
    time.sleep(delay_s)
    shared[rows_slice[0]:rows_slice[1]] = values.reshape(-1)
    flag = torch.from_file(path + ".flags", shared=True, size=4, dtype=torch.int32)
    flag[flag_offset] = 1


@interpreted
def test_interpreted_kernel_waits_for_a_flag_raised_by_another_process():
    """The CPU backend's symmetric memory lives in /dev/shm: a kernel in this process spins on
    a flag that another process raises after writing the rows; the result must hold the rows
    written after the launch (NaN before), so the wait is real."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    world, _rank, m, k, n = 2, 0, 3, 8, 5
    a = torch.randn(world * m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    path = f"/dev/shm/ficco-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        shared = torch.from_file(path, shared=True, size=a.numel(), dtype=torch.float32)
        flags_all = torch.from_file(path + ".flags", shared=True, size=4, dtype=torch.int32)
        flags_all.zero_()
        gathered = shared.view(world * m, k)
        gathered.fill_(float("nan"))
        gathered[:m] = a[:m]
        segs = (Segment(0, m, ((0, k, -1),)), Segment(m, m, ((0, k, 2),)))
        ctx = mp.get_context("spawn")
        writer = ctx.Process(target=_late_writer, args=(
            path, a.numel(), (m * k, 2 * m * k), a[m:].clone(), 2, 1.0))
        writer.start()
        c = torch.full((world * m, n), float("nan"))
        err = gated_gemm(a[:m].clone(), gathered, b, c, segs, flags_all, local_row0=0,
                         timeout_s=120.0)
        writer.join(60)
        assert writer.exitcode == 0
        check_error(err)
        assert max_row_rel_err(c, _reference(a, b)) <= ROW_TOL[torch.float32], f"seed {seed}"
    finally:
        for p in (path, path + ".flags"):
            if os.path.exists(p):
                os.unlink(p)


def _raise_in_order(flags, counter, order, delay_s, seen):
    """The copy engines' part: raise each flag in turn, noting the trace counter just before
    (every tick the kernel takes after it sees the flag is at least that)."""
    for flag in order:
        time.sleep(delay_s)
        seen[flag] = int(counter[0])
        flags[flag] = 1


def _early_tiles(tiles, seen):
    """Tiles that saw their first (last) flag before it was raised: none when gated."""
    return [t for t in tiles if t["flags"] and (t["first_seen"] < seen[t["flags"][0]]
                                                or t["last_seen"] < seen[t["flags"][-1]])]


@interpreted
@pytest.mark.parametrize("two_d", [False, True])
def test_traced_tiles_start_only_after_their_chunk_lands(two_d):
    """The per-tile trace (order counter, interpreter): a thread raises the flags one by one
    in arrival order; every tile's 'flag seen' tick comes after the raise of the flag it
    waited for (2d: its first and its last K chunk), the traced tiles cover C exactly once,
    and the result is right. The same check flags every tile of a kernel that did not wait
    (flags preset, the copies landing after it ran): the invariant is the gate's."""
    from ficco.kernels.trace import TRACE_COUNTER, read_trace, trace_buffer

    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    world, rank, m, k, n = 3, 2, 5, 12, 40          # n = 40: two column tiles of 32
    a = torch.randn(world * m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    segs = (_segments_2d(world, rank, m, _split(k, world)) if two_d
            else _segments_1d(world, rank, m, k, _split(m, world)))
    order = [c * world + q for c in range(world) for q in range(world) if q != rank]
    for gated in (True, False):
        c = torch.full((world * m, n), float("nan"))
        flags = torch.zeros(world * world, dtype=torch.int32) if gated else \
            torch.ones(world * world, dtype=torch.int32)
        trace = trace_buffer(segs, n, "cpu", "cpu")
        seen = {}
        writer = threading.Thread(target=_raise_in_order,
                                  args=(flags, trace, order, 0.02 if gated else 0.0, seen))
        if gated:
            writer.start()
        err = gated_gemm(a[rank * m:(rank + 1) * m].clone(), a, b, c, segs, flags,
                         local_row0=rank * m, timeout_s=120.0, trace=trace,
                         trace_mode=TRACE_COUNTER)
        if gated:
            writer.join(60)
        else:      # ungated: the copies land after the kernel ran
            _raise_in_order(torch.zeros_like(flags), trace, order, 0.0, seen)
        check_error(err)
        assert max_row_rel_err(c, _reference(a, b)) <= ROW_TOL[torch.float32], f"seed {seed}"
        tiles = read_trace(trace, segs, n, TRACE_COUNTER, origin=0)
        covered = torch.zeros(world * m, n, dtype=torch.int32)
        for t in tiles:
            covered[t["row0"]:t["row0"] + t["rows"], t["col0"]:t["col0"] + t["cols"]] += 1
            assert t["start"] <= t["first_seen"] <= t["last_seen"] <= t["end"] and t["ok"]
        assert torch.equal(covered, torch.ones_like(covered))
        early = _early_tiles(tiles, seen)
        if gated:
            assert early == [], f"seed {seed}: tiles ahead of their flag: {early} seen {seen}"
        else:
            assert len(early) == sum(1 for t in tiles if t["flags"])


@interpreted
def test_trace_host_clock_is_the_interpreter_programs_time():
    """TRACE_HOST_NS (what the CPU timeline uses): each tile's times lie inside the launch's
    wall-clock window, in order, on the host's monotonic clock."""
    from ficco.kernels.trace import TRACE_HOST_NS, read_trace, trace_buffer

    world, rank, m, k, n = 2, 0, 4, 8, 8
    a, b = torch.randn(world * m, k), torch.randn(k, n)
    segs = _segments_1d(world, rank, m, k, _split(m, world))
    trace = trace_buffer(segs, n, "cpu", "cpu")
    c = torch.empty(world * m, n)
    before = time.perf_counter_ns()
    check_error(gated_gemm(a[:m].clone(), a, b, c, segs, torch.ones(4, dtype=torch.int32),
                           local_row0=0, trace=trace, trace_mode=TRACE_HOST_NS))
    after = time.perf_counter_ns()
    tiles = read_trace(trace, segs, n, TRACE_HOST_NS, origin=before)
    assert len(tiles) == len(segs)
    for t in tiles:
        assert 0 <= t["start"] <= t["first_seen"] <= t["last_seen"] <= t["end"] \
            <= (after - before) / 1e9


@pytest.mark.parametrize("target,mode,clock", [
    ("cuda:sm_90", "TRACE_GLOBALTIMER", "%globaltimer"),
    ("rocm:gfx942", "TRACE_MEMREALTIME", "s_memrealtime"),
    ("rocm:gfx1100", "TRACE_RDNA3", "s_sendmsg_rtn_b64")])
def test_compiled_trace_reads_the_device_clock_and_costs_nothing_when_off(target, mode, clock):
    """Offline builds: with tracing on, the kernel reads the GPU clock three more times (start,
    flag seen, end); with it off (the default) the only clock reads are the two that time a
    wait (its start, and each poll)."""
    from ficco.kernels import gated_gemm as gg
    from ficco.kernels import trace

    options = {"num_stages": 2, "block": (64, 64, 32), "num_warps": 4}
    on = gg.compile_offline(target, "bf16", trace_mode=getattr(trace, mode), **options)
    off = gg.compile_offline(target, "bf16", **options)
    stage = "ptx" if target.startswith("cuda") else "amdgcn"
    waits = off[stage].count(clock)     # a wait's start and each poll (AMD may duplicate one)
    assert 2 <= waits <= 3 and on[stage].count(clock) >= 3 + waits
    if mode == "TRACE_MEMREALTIME":   # SMEM: its result is ready only after lgkmcnt(0)
        lines = on[stage].splitlines()
        for i, line in enumerate(lines):
            if "s_memrealtime" in line:
                assert "lgkmcnt(0)" in lines[i + 1], lines[i:i + 2]


@pytest.mark.parametrize("target,dtype", [("cuda:sm_90", "bf16"), ("cuda:sm_80", "bf16"),
                                          ("rocm:gfx942", "bf16")])
def test_compiled_kernel_builds_for_gpus_and_polls_with_acquire_loads(target, dtype):
    """No GPU here, but Triton compiles offline: the real (non-interpreted) kernel must build
    to a binary for Hopper/Ampere and MI300, use the matrix units, and poll its flags with
    acquire semantics (an interpreter-only kernel could hide a compile error until a GPU)."""
    from ficco.kernels.gated_gemm import compile_offline

    stages = 2 if target.startswith("rocm") else 3
    asm = compile_offline(target, dtype, num_stages=stages)
    if target.startswith("cuda"):
        assert asm["cubin"]
        ptx = asm["ptx"]
        assert re.search(r"\b(ld|atom)\.global(\.gpu)?\.acquire\b", ptx)
        assert ("wgmma" if target == "cuda:sm_90" else "mma.sync") in ptx
    else:
        assert asm["hsaco"]
        assert "mfma" in asm["amdgcn"]


@interpreted
def test_kernel_benchmark_code_path_runs_in_the_interpreter(tmp_path):
    """``kernel --interpret``: the GPU benchmark's code (segments of both variants, flags
    preset, sampled check against float64, the JSON) on CPU, so a GPU session does not find
    a script bug; its times mean nothing and are not looked at."""
    import json

    from ficco.bench.kernels import run

    out = tmp_path / "rows.json"
    assert run(["kernel", "--interpret", "--shape", "48,64,40", "--world", "4", "--dtype",
                 "bfloat16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["1d", "2d"]
    assert all(r["M"] == 48 and r["n"] == 16 and r["max_rel_err_sampled"] < 1e-2 for r in rows)


@interpreted
def test_one_device_timeline_command_runs_on_cpu(tmp_path):
    """``python -m ficco.bench kernels timeline`` (the GPU session's one-call check) runs end
    to end here: W ranks spawned on the one device, a traced gated call, its result within
    float32 rounding of float64, a mark per tile, none before its flag's signal op."""
    import json

    from ficco.bench.kernels import run

    code = run(["timeline", "--world", "2", "--shape", "64,40,24", "--no-plots",
                 "--out", str(tmp_path), "--warmup", "0", "--seed", str(random.randrange(99))])
    assert code == 0
    record = json.loads((tmp_path / "timeline.json").read_text())
    assert record["schedule"] == "gated-1d" and record["max_abs_err"] < 1e-4
    for rank in ("0", "1"):
        marks = [r for r in record["measured_rows"][rank] if r.get("mark")]
        assert sum(r["rows"] * r["cols"] for r in marks) == 64 * 20
        assert record["chunks"][rank] and all(c["early"] == 0 for c in record["chunks"][rank])
    trace = json.loads((tmp_path / "timeline-gated-1d.trace.json").read_text())
    assert any(e["ph"] == "i" and e["cat"] == "gated_tile" for e in trace["traceEvents"])


# -- on a GPU (skipped without one) --------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("two_d,world", [(False, 4), (True, 4), (False, 8)])
def test_compiled_kernel_on_the_gpu_matches_float64(dtype, two_d, world):
    """The autotuned, compiled kernel (not the interpreter) with every flag preset."""
    from ficco.kernels import configs

    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    m, k, n, rank = 300, 520, 260, 1       # several tiles, uneven chunks and K tail
    a = torch.randn(world * m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    segs = (_segments_2d(world, rank, m, _split(k, world)) if two_d
            else _segments_1d(world, rank, m, k, _split(m, world)))
    dev = torch.device("cuda")
    c = torch.full((world * m, n), float("nan"), dtype=dtype, device=dev)
    flags = torch.ones(world * world, dtype=torch.int32, device=dev)
    a_dev = a.to(dev)
    err = gated_gemm(a_dev[rank * m:(rank + 1) * m], a_dev, b.to(dev), c, segs, flags,
                     local_row0=rank * m, family=configs.family(configs.current_target()))
    torch.cuda.synchronize()
    check_error(err)
    tol = {torch.bfloat16: 3e-2, torch.float16: 6e-3, torch.float32: 1e-4}[dtype]
    assert max_row_rel_err(c.cpu(), _reference(a, b)) <= tol, f"seed {seed}"


@pytest.mark.gpu
@needs_gpu
def test_compiled_kernel_trace_reads_the_device_clock():
    """Traced on the GPU (flags preset): one record per tile covering C once, timestamps in
    order and on a nanosecond-like scale (a tile takes well under a second), result right."""
    from ficco.kernels import configs
    from ficco.kernels.trace import clock_mode, read_trace, trace_buffer

    target = configs.current_target()
    family, mode = configs.family(target), clock_mode(target)
    world, m, k, n, rank = 4, 300, 520, 260, 1
    dev = torch.device("cuda")
    a = torch.randn(world * m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.full((world * m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    segs = _segments_1d(world, rank, m, k, _split(m, world))
    trace = trace_buffer(segs, n, family, dev)
    err = gated_gemm(a[rank * m:(rank + 1) * m], a, b, c, segs,
                     torch.ones(world * world, dtype=torch.int32, device=dev),
                     local_row0=rank * m, family=family, trace=trace, trace_mode=mode)
    torch.cuda.synchronize()
    check_error(err)
    tiles = read_trace(trace, segs, n, mode)
    covered = torch.zeros(world * m, n, dtype=torch.int32)
    for t in tiles:
        covered[t["row0"]:t["row0"] + t["rows"], t["col0"]:t["col0"] + t["cols"]] += 1
        assert 0 <= t["start"] <= t["first_seen"] <= t["last_seen"] <= t["end"] < 1.0, t
    assert torch.equal(covered, torch.ones_like(covered))
    assert max_row_rel_err(c.cpu(), _reference(a.cpu(), b.cpu())) <= 3e-2


@pytest.mark.gpu
@needs_gpu
def test_compiled_kernel_gives_up_on_a_flag_that_never_comes():
    """On the GPU too the wait is bounded: the kernel finishes, the error word names the flag."""
    from ficco.kernels import configs

    world, m, k, n = 2, 128, 64, 64
    dev = torch.device("cuda")
    a = torch.randn(world * m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(world * m, n, device=dev, dtype=torch.bfloat16)
    flags = torch.zeros(world * world, dtype=torch.int32, device=dev)
    segs = (Segment(0, m, ((0, k, -1),)), Segment(m, m, ((0, k, 3),)))
    err = gated_gemm(a[:m], a, b, c, segs, flags, local_row0=0, timeout_s=0.2,
                     family=configs.family(configs.current_target()))
    torch.cuda.synchronize()    # returns: the kernel did not spin forever
    with pytest.raises(CommTimeoutError, match="flag 3"):
        check_error(err)
