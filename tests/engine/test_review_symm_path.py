"""Silent wrong results found by the desk review of the symmetric-memory, barrier and kernel
path (ficco/symm_mem, ficco/kernels, ficco/backends/gpu/fence|watchdog|rescue): each test
failed on the code before its fix. The gated GEMM runs in Triton's interpreter (CPU), which
computes pointer offsets in the same integer widths the compiled kernel does."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_gated_gemm_reads_column_major_b_past_2_31_elements():
    """``b`` is the caller's weight as given, and ``w.t()`` (column-major, ``stride(1) == K``)
    is the common case. The kernel built B's column offsets as ``offs_n * stride_bn`` in int32:
    once ``(N - 1) * K`` passes 2**31 the offset wrapped and the columns past it were read from
    ``2**32`` elements before ``b`` (an LM head of 256k vocabulary x 8k hidden on one rank;
    an illegal address, or silently other memory). Here ``b`` is a 3-column view with a column
    stride of 2**30 + 8 into memory that is reserved, not touched (the pages read are the
    kernel's), so the third column starts past 2**31 elements."""
    from ficco.kernels.gated_gemm import Segment, gated_gemm

    gen = torch.Generator().manual_seed(11)
    k, n, m = 16, 3, 5
    stride = 2 ** 30 + 8
    base = 2 ** 31      # a wrapped offset lands inside the reservation: wrong data, no crash
    store = torch.empty(base + (n - 1) * stride + k, dtype=torch.float16)
    b = store.as_strided((k, n), (1, stride), base)
    values = torch.randn(k, n, generator=gen).half()
    for j in range(n):
        b[:, j] = values[:, j]
    a = torch.randn(m, k, generator=gen).half()
    c = torch.empty(m, n)
    err = gated_gemm(a, a, b, c, (Segment(0, m, ((0, k, -1),)),),
                     torch.ones(1, dtype=torch.int32), local_row0=0, device_kind="cpu")
    ref = a.double() @ values.double()
    assert int(err[0]) == 0
    assert torch.allclose(c.double(), ref, rtol=1e-3, atol=1e-3), \
        (c.double() - ref).abs().amax(dim=0)


def test_cpu_gated_launch_never_returns_nan_tiles_without_an_error():
    """On the CPU backend the launch's watch thread raises the kernel's ``halt`` word at the
    call's deadline (or when another queue of the call failed). Tiles that start after that
    are written as NaN without waiting for anything, so the kernel's error word stays 0 when
    every flag had already arrived: the launch returned normally with NaN rows in ``out``
    (a call past its deadline returning data). It must raise instead. The deadline is made
    to pass while the interpreted kernel runs (its flags are all raised)."""
    from ficco import schedules
    from ficco.backends import get_backend
    from ficco.errors import CommTimeoutError
    from ficco.kernels.launch import gated_task
    from ficco.plan import GatedGemm
    from ficco.plan.problem import Problem

    problem = Problem(m=64, k=32, ns=(96,), dtype="float32", world=2, rank=0)
    plan = schedules.get("gated-1d").plan(problem)
    op = next(o for o in plan.ops if isinstance(o, GatedGemm))
    gen = torch.Generator().manual_seed(5)
    gathered = torch.randn(2 * problem.m, problem.k, generator=gen)
    b = torch.randn(problem.k, 96, generator=gen)
    out = torch.empty(2 * problem.m, 96)
    flags = torch.ones(op.num_flags, dtype=torch.int32)
    # The deadline is 5 ms after the launch is made; the watch thread looks every 10 ms and
    # the interpreted kernel (4 x 3 tiles of 32 rows, one at a time) runs far longer.
    task = gated_task(get_backend("cpu"), problem, op, gathered[: problem.m], gathered, b, out,
                      flags, timeout_s=0.005)
    try:
        task()
    except CommTimeoutError:
        return      # the call fails: nothing it computed is returned
    ref = gathered.double() @ b.double()
    assert not out.isnan().any(), "a gated launch returned NaN tiles and no error"
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_interpreted_gated_gemms_of_two_threads_both_right():
    """On the CPU backend each session (group) runs its gated GEMMs on its own compute worker,
    in Triton's interpreter, and two groups' calls may run at once. The interpreter patches
    ``triton.language`` process-wide for the length of a launch and keeps the program id in one
    global: a launch that ended restored the patches under a running one (which then raised
    "Did you forget to add @triton.jit"), and a launch could read another's program id (tiles
    computed twice, others never). One long launch runs while another thread makes short
    ones; every result must match float64."""
    import threading

    from ficco.kernels.gated_gemm import Segment, gated_gemm

    results: dict = {}
    start = threading.Barrier(2)

    def launches(seed, m, n, count):
        gen = torch.Generator().manual_seed(seed)
        k = 32
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        ref = a.double() @ b.double()
        start.wait()
        errors = []
        for _ in range(count):
            c = torch.full((m, n), float("nan"))
            try:
                gated_gemm(a, a, b, c, (Segment(0, m, ((0, k, -1),)),),
                           torch.ones(1, dtype=torch.int32), local_row0=0, device_kind="cpu")
                errors.append(float((c.double() - ref).abs().max()))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(repr(exc)[:120])
        results[seed] = errors

    threads = [threading.Thread(target=launches, args=(0, 256, 256, 1)),
               threading.Thread(target=launches, args=(1, 32, 32, 12))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, errors in results.items():
        assert all(isinstance(e, float) and e < 1e-4 for e in errors), (seed, errors)


def two_caller_streams(rank, world, seed):
    """Rank side of the test below: a warm-up call, then call 1 on stream s1 and call 2 on
    s2, same group and shape, other inputs; each call's error against float64."""
    import ficco

    from .. import fake_gpu
    from .. import fault_cases as cases
    from ..reference import make_inputs, max_row_rel_err

    cases._setup("cuda", 8)
    m, k, n = 1024, 512, 1024      # call 1's GEMM takes a while on the fake GPU
    shards1, bs1, _, refs1 = make_inputs(seed, world, (m, k), (n,), torch.float32)
    shards2, bs2, _, refs2 = make_inputs(seed + 1, world, (m, k), (n,), torch.float32)
    try:
        with ficco.config.scope(transport="dma"):
            ficco.all_gather_matmul(shards1[rank], bs1[0], schedule="serial")   # workspace
            torch.cuda.synchronize()
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
            with torch.cuda.stream(s1):
                out1 = ficco.all_gather_matmul(shards1[rank], bs1[0], schedule="serial")
            with torch.cuda.stream(s2):
                out2 = ficco.all_gather_matmul(shards2[rank], bs2[0], schedule="serial")
            torch.cuda.synchronize()
    finally:
        fake_gpu.uninstall()
    return max_row_rel_err(out1, refs1[0]), max_row_rel_err(out2, refs2[0])


@pytest.mark.parametrize("poison", ["0", "1"])
def test_two_caller_streams_keep_the_barrier_flags_and_workspace_apart(poison):
    """Two dma calls of one group from two caller streams, two ranks on the fake GPU, through
    the API with real barriers. Before main's stream ordering (the copy-path review) call 2's
    copies filled the workspace's gathered rows under call 1's GEMM (call 1 returned call 2's
    rows, error ~0.1), and call 2's barrier 0 (on s2) was not ordered after call 1's
    barriers: a call-2 flag overwrote a call-1 flag in a peer's slot before the peer read it,
    breaking the flag protocol's channel alternation (ficco/symm_mem/barrier.py); the peer
    saw a foreign flag and the group failed (NaN). Both calls must match float64.
    With FICCO_POISON=1 call 2's NaN fill of the symmetric ``gathered`` rows runs on s2 in
    stream order (on the fake GPU as on a GPU): it was enqueued before s2 was ordered after
    s1, so it landed under call 1's GEMM (call 1 returned NaN rows)."""
    from .. import harness

    results = harness.pool(2, {"FICCO_POISON": poison}).run(two_caller_streams, 3,
                                                              timeout_s=120)
    for errors in results:
        assert all(e < 1e-4 for e in errors), results


# -- on a GPU (skipped without one): a suspicion the interpreter cannot show ------------------
def _divergence_probe(mode: str, launches: int, device: str, programs: int | None = None) -> str:
    """Launch the gated GEMM ``launches`` times with many programs waiting for a flag that never
    comes, ended by the clock (``mode`` "clock": every wait runs out at about the same moment)
    or by the host raising the halt word in pinned host memory while they wait ("halt").
    Every launch must finish, own rows must match float64, waiting rows must be NaN and the
    error word must name the flag. ``programs`` caps the grid (None: the device's resident
    programs, one tile each here; a small cap makes each program walk several tiles, so a
    wait ends also in a program that already finished tiles, and in one that has more).
    Returns "" or what went wrong. The compiled kernel's wait loop holds CTA barriers (the
    poll's reduction); its exit is decided by one thread's reads of the halt word and the
    clock, handed to every thread by that reduction (tests/engine/test_kernel_uniform.py reads that
    in the sm_90 PTX): warps deciding apart would leave the loop at different iterations and
    hang here."""
    import time

    from ficco.kernels import configs
    from ficco.kernels.gated_gemm import Segment, gated_gemm
    from ficco.symm_mem.device import tensor_at

    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    family = configs.family(configs.current_target()) if on_gpu else "cpu"
    m, waiting, k, n = (128, 128 * 24, 64, 256) if on_gpu else (32, 64, 32, 32)
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(m + waiting, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(k, n, generator=gen).to(torch.bfloat16)
    ref = a[:m].double() @ b.double()
    segs = (Segment(0, m, ((0, k, -1),)), Segment(m, waiting, ((0, k, 0),)))
    a_dev, b_dev = a.to(dev), b.to(dev)
    host = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
    halt = tensor_at(host.data_ptr(), 4, dev).view(torch.int32) if on_gpu else host
    for launch in range(launches):
        host.zero_()
        c = torch.zeros(m + waiting, n, dtype=torch.bfloat16, device=dev)
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
        done = torch.cuda.Event() if on_gpu else None
        err = gated_gemm(a_dev[:m], a_dev, b_dev, c, segs, flags, local_row0=0, halt=halt,
                         timeout_s=0.05 if mode == "clock" else 30.0, family=family,
                         device_kind=None if on_gpu else "cpu", max_programs=programs)
        if on_gpu:
            done.record()
            if mode == "halt":
                time.sleep(0.02)
                host[0] = 1            # what the watchdog does: a host store
            deadline = time.monotonic() + 20.0
            while not done.query():
                if time.monotonic() > deadline:
                    return f"launch {launch} ({mode}): the kernel never finished"
                time.sleep(0.001)
        got = c.double().cpu()
        if int(err.reshape(-1)[0].cpu()) != 1:
            return f"launch {launch} ({mode}): error word {int(err[0])}, not 1 (flag 0)"
        if not torch.allclose(got[:m], ref, rtol=2e-2, atol=2e-2):
            return f"launch {launch} ({mode}): own rows wrong"
        if not got[m:].isnan().all():
            return f"launch {launch} ({mode}): {int((~got[m:].isnan()).sum())} waiting " \
                   f"elements are numbers, not NaN"
    return ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("mode", ["clock", "halt"])
def test_gated_waits_end_alike_in_every_warp_on_gpu(mode):
    """A suspicion of the symmetric-path review, for a GPU: many programs
    ending their waits at once, by the clock or by the halt word, must all finish with NaN
    tiles and the flag named, launch after launch, with one tile per program and with
    several (a grid of 4 programs). Run in a subprocess: a CTA whose warps left the wait loop
    at different iterations can hang at a barrier, and a hung kernel would hang this process.
    The subprocess is bounded by FICCO_PROBE_TIMEOUT_S (default 20 s: a lease part runs both
    modes inside its own bound)."""
    import os
    import subprocess
    import sys

    bound = float(os.environ.get("FICCO_PROBE_TIMEOUT_S", "20"))
    code = ("import sys, tests.engine.test_review_symm_path as t; "
            "r = t._divergence_probe(sys.argv[1], 10, 'cuda') or "
            "t._divergence_probe(sys.argv[1], 10, 'cuda', programs=4); print(r or 'ok'); "
            "sys.exit(1 if r else 0)")
    try:
        proc = subprocess.run([sys.executable, "-c", code, mode], check=False,
                              capture_output=True, text=True, timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: the probe did not finish within {bound:g} s (a gated GEMM hung, "
                    f"or its first compile outlasted the bound)")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- a failed call's fence on one caller stream, the group's next call on another ------------
def failed_call_then_other_stream(rank, world, tag, timeout_s):
    """Rank side of the test below. The last rank makes no call after the warm-up; the others
    make call 1 on stream s1 (its first barrier expires after ``timeout_s``: the watchdog
    raises the group's error word and releases it, and s1 goes on with the call's GEMM and
    its fence), wait until their watchdog has failed the group, then make call 2 on s2,
    which must raise the group's error. Returns (how many of call 1's output elements are
    numbers, not NaN; what call 2 raised)."""
    import time

    from ficco.runtime import session as sessions

    from .. import fake_gpu
    from .. import fault_cases as cases

    cases._setup("cuda", 8)
    try:   # the pool is the plain one: the next test on it must find no fake device
        m, k, n = 512, 256, 512     # call 1's GEMM keeps s1 busy after the release
        shards, bs, _, _ = cases._inputs(tag % 1000, world, (m, k), n)
        with ficco_scope():
            cases._call(shards[rank], bs[0], "serial", 20.0)      # the workspace, every rank
        torch.cuda.synchronize()
        if rank == world - 1:
            return cases._stall(tag, world, 60)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            out1 = cases._call(shards[rank], bs[0], "serial", timeout_s)
        deadline = time.monotonic() + 10 * timeout_s + 10
        while not any(s.workspace is not None and s.workspace.fault is not None
                      and s.workspace.fault.failed() for s in sessions.every()):
            assert time.monotonic() < deadline, "the watchdog never failed the group"
            time.sleep(0.005)

        def call_2():
            with torch.cuda.stream(s2):       # (stream contexts are per thread)
                return cases._call(shards[rank], bs[0], "serial", timeout_s)
        nxt = cases._bounded(call_2, 5 * timeout_s + 10)
        drained = cases._bounded(torch.cuda.synchronize, 10 * timeout_s + 20)
        cases._signal_done(tag)
        assert drained[0] == "ok", drained
        return int((~out1.isnan()).sum()), cases._outcome(nxt)
    finally:
        fake_gpu.uninstall()


def ficco_scope():
    import ficco

    return ficco.config.scope(transport="dma")


def test_a_failed_calls_fence_on_one_stream_sees_the_word_the_next_call_lowers_on_another():
    """The group's next dma call raises the group's error and lowers its error word in stream
    order, so that fences already queued still see it raised. The lowering runs on the new
    call's caller stream: before that stream was ordered after the last call's (s1, still
    busy with the failed call's GEMM, its fence behind it), the word was lowered at once, the
    fence read 0 and call 1's outputs came back as numbers computed from rows that never
    arrived. Every element of call 1's output must be NaN, and call 2 must raise."""
    import random

    from .. import harness

    # a pool of its own: the call leaves the group failed on two ranks of three (their
    # exchanges out of step with the third's), which no later test on a shared pool may meet
    pool = harness.pool(3, {"FICCO_TEST_POOL": "failed-group"})
    results = pool.run(failed_call_then_other_stream, random.randrange(1 << 40), 1.0,
                       timeout_s=120)
    for numbers, nxt in results[:-1]:
        assert nxt.startswith("CommTimeoutError"), results
        assert numbers == 0, results
    assert results[-1] == "stalled"
