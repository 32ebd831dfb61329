"""The gated schedules (ficco/ops/all_gather_matmul/schedules/gated.py): plans, simulation, who offers them, and end
to end on the CPU backend (the gated GEMM in Triton's interpreter) against float64."""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco import kernels, schedules
from ficco.errors import InvalidArgumentError
from ficco.heuristics import choose, profiles, simulator
from ficco.ops.all_gather_matmul.schedules.gated import Gated
from ficco.plan import Copy, GatedGemm, Signal, flag_index
from ficco.plan.problem import Problem, even_split

from ... import harness
from ...reference import ROW_TOL, make_inputs, max_row_rel_err

GATED = ("gated-1d", "gated-2d")


def _queue_order(plan, queue):
    return [op for op in plan.ops if op.queue == queue and op.kind not in ("record", "wait")]


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("world,m,k", [(2, 5, 7), (3, 7, 10), (4, 2, 9)])
def test_plan_covers_every_row_once_behind_the_flag_of_its_copy(name, world, m, k):
    """Every row of C is computed once, in arrival order (own shard first); each part a tile
    waits for is raised by a Signal right after the copy of exactly those rows/columns, on
    the copy's own queue; the gated GEMM is enqueued after every pull and flag (launched first,
    its waiting tiles could starve the copies that raise its flags)."""
    for rank in range(world):
        p = Problem(m=m, k=k, ns=(6, 3), dtype="float32", world=world, rank=rank)
        plan = schedules.get(name).plan(p, "dma")
        gated = [op for op in plan.ops if isinstance(op, GatedGemm)]
        assert [op.b for op in gated] == [0, 1]
        last_signal = max(i for i, op in enumerate(plan.ops) if isinstance(op, Signal))
        assert plan.ops.index(gated[0]) > last_signal
        segments = gated[0].segments
        assert segments[0] == (rank * m, m, ((0, k, -1),))
        covered = torch.zeros(p.big_m, k, dtype=torch.int32)
        for row0, rows, parts in segments:
            for k0, kc, _ in parts:
                covered[row0:row0 + rows, k0:k0 + kc] += 1
        assert torch.equal(covered, torch.ones_like(covered))
        # Each flag: exactly one Signal, right after the copy of those rows and columns.
        signals = {op.flag: op for op in plan.ops if isinstance(op, Signal)}
        for row0, rows, parts in segments[1:]:
            for k0, kc, flag in parts:
                sig = signals[flag]
                order = _queue_order(plan, sig.queue)
                copy = order[order.index(sig) - 1]
                peer = flag % world
                assert isinstance(copy, Copy) and copy.src.peer == peer
                assert (copy.dst.row0, copy.dst.rows, copy.dst.col0, copy.dst.cols) == \
                    (row0, rows, k0, kc)
                assert flag == flag_index(p, peer, flag // world)


def test_gated_needs_dma_and_the_all_gather_op():
    p = Problem(m=4, k=8, ns=(4,), dtype="float32", world=2)
    with pytest.raises(InvalidArgumentError, match="dma"):
        Gated().plan(p, "ccl")
    assert "gated-1d" not in schedules.names() and "gated-2d" not in schedules.names()
    assert schedules.optional_names() == list(GATED)


@pytest.mark.parametrize("name", GATED)
def test_simulated_tiles_start_only_after_their_chunk_lands(name):
    """The simulator prices ONE gated GEMM: its pieces run in arrival order and none starts
    before the copies it reads have ended; the first piece (own rows) waits for nothing but
    the GEMM's launch, which the host issues after the copies."""
    p = Problem(m=4096, k=8192, ns=(8192,), dtype="bfloat16", world=8, rank=3)
    plan = schedules.get(name).plan(p, "dma")
    result = simulator.simulate(plan, profiles.load("mi300x"))
    copies = {}
    for row in result.rows:
        if row["label"].startswith("peer "):
            step = int(row["label"].rsplit("c", 1)[1])
            copies.setdefault(step, []).append(row["end_s"])
    pieces = [r for r in result.rows if r["kind"] == "gated_gemm"]
    assert len(pieces) == (1 + 7 * 8 if name == "gated-1d" else 1 + 8)
    assert pieces[0]["start_s"] <= min(piece["start_s"] for piece in pieces[1:])
    landed = sorted(max(v) for v in copies.values())
    if name == "gated-2d":   # piece c+1 reads K chunk c of every peer
        for piece, chunk_end in zip(pieces[1:], landed):
            assert piece["start_s"] >= chunk_end - 1e-12
    else:                     # pieces 1 + 7c .. 7c+7 read chunk c of the seven peers
        for c, chunk_end in enumerate(landed):
            for piece in pieces[1 + 7 * c: 8 + 7 * c]:
                assert piece["start_s"] >= min(copies[c]) - 1e-12
        assert pieces[-1]["start_s"] >= landed[-1] - result.makespan_s  # ordered, sane
    assert result.makespan_s >= pieces[-1]["end_s"] - 1e-12


def test_selectors_offer_gated_only_where_it_runs(monkeypatch):
    p = Problem(m=4096, k=8192, ns=(8192,), dtype="bfloat16", world=8)
    assert set(GATED) <= set(schedules.unavailable("cpu"))          # interpreter only
    assert set(GATED) <= set(schedules.unavailable("cuda:sm_70"))   # too old
    d = choose(p, target="cpu", selector="model")
    assert not set(GATED) & set(d.scores)
    monkeypatch.setattr(kernels, "triton_reason", lambda: "Triton is not installed: pip ...")
    reasons = schedules.unavailable("rocm:gfx942")
    assert set(reasons) == set(GATED) and "not installed" in reasons["gated-1d"]
    assert not set(GATED) & set(choose(p, target="rocm:gfx942", selector="model").scores)
    monkeypatch.setattr(kernels, "triton_reason", lambda: None)
    # Never offered where the kernel was not verified on a GPU yet (forcing one still runs)
    monkeypatch.setattr(kernels, "VERIFIED_TARGETS", ())
    assert "not been verified" in schedules.unavailable("rocm:gfx942")["gated-1d"]
    assert not set(GATED) & set(choose(p, target="cuda:sm_90", selector="model").scores)
    monkeypatch.setattr(kernels, "VERIFIED_TARGETS", ("rocm:gfx942", "cuda:sm_90"))
    assert schedules.offered("rocm:gfx942")[-2:] == list(GATED)
    scores = choose(p, target="cuda:sm_90", selector="model").scores
    assert set(GATED) <= set(scores)
    assert not set(GATED) & set(choose(p, transport="ccl", target="cuda:sm_90",
                                       selector="model").scores)


# -- end to end on the CPU backend -------------------------------------------------------------
# Kept to two shapes: the interpreter runs each tile in Python. "rows<W" (m=2 at W=3, 4) has
# empty chunks and two b's (two gated launches reading the same flags).
SHAPES = [("uneven", (7, 10), (9,)), ("rows<W,2b", (2, 9), (5, 3))]


def _run_gated(rank, world, seed):
    failures = []
    for case, (label, shape, ns) in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            for name in GATED:
                shards, bs, full, refs = make_inputs(seed + case, world, shape, ns, dtype)
                gathered, outs = ficco.all_gather_matmul(shards[rank], bs, schedule=name,
                                                         return_gathered=True)
                if not torch.equal(gathered, full):
                    failures.append(f"{name}/{label}/{dtype}: gathered A differs")
                for j, (out, ref) in enumerate(zip(outs, refs)):
                    err = max_row_rel_err(out, ref)
                    if not err <= ROW_TOL[dtype]:
                        failures.append(f"{name}/{label}/{dtype}/b{j}: err {err:.3g}")
                if ficco.runtime.path.last_run() != (name, "dma"):
                    failures.append(f"{label}: ran {ficco.runtime.path.last_run()}")
    return failures


@pytest.mark.skipif(kernels.unavailable_reason("cpu") is not None,
                    reason=str(kernels.unavailable_reason("cpu")))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gated_schedules_match_float64(world):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(_run_gated, seed, timeout_s=600)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


def _forced_without_triton(rank, world):
    from ficco import kernels as k

    saved = k.triton_reason
    k.triton_reason = lambda: "Triton is not installed: pip install 'ficco[triton]'"
    # Settings are validated once per environment; an install cannot change mid-process,
    # but this test fakes one, so forget what earlier cases on this pool validated.
    ficco.shutdown()
    try:
        a, b = torch.randn(4, 8), torch.randn(8, 3)
        ficco.all_gather_matmul(a, b, schedule="gated-1d")
    except InvalidArgumentError as exc:
        return str(exc)
    finally:
        k.triton_reason = saved
    return "no error"


def test_forcing_gated_without_triton_says_why_before_any_communication():
    for message in harness.pool(2).run(_forced_without_triton):
        assert "gated-1d" in message and "Triton is not installed" in message


def _traced_gated(rank, world, seed, name):
    from ficco.bench.timeline import chunk_summary, tile_rows
    from ficco.kernels.launch import TileTrace

    shards, bs, _, refs = make_inputs(seed, world, (5, 12), (40,), torch.float32)
    with TileTrace() as tiles:
        out, plan, rows = ficco.api.traced_all_gather_matmul(shards[rank], bs[0], schedule=name)
    marks = tile_rows(plan, rows, tiles.tiles())
    bar = next(r for r in rows if r["kind"] == "gated_gemm")
    covered = torch.zeros(out.shape, dtype=torch.int32)
    for mark in marks:
        if mark["last_part"]:   # 2d: the same tile seeing its last K chunk
            assert mark["flag"] // world == world - 1 and mark["chunk"] == world - 1, mark
            continue
        covered[mark["row0"]:mark["row0"] + mark["rows"],
                mark["col0"]:mark["col0"] + mark["cols"]] += 1
        assert bar["start_s"] <= mark["start_s"] <= mark["end_s"] <= bar["end_s"] + 1e-3, mark
    return (max_row_rel_err(out, refs[0]), bool(torch.equal(covered, torch.ones_like(covered))),
            chunk_summary(plan, rows + marks))


@pytest.mark.skipif(kernels.unavailable_reason("cpu") is not None,
                    reason=str(kernels.unavailable_reason("cpu")))
@pytest.mark.parametrize("name", GATED)
def test_timeline_marks_every_tile_after_its_flag_was_raised(name):
    """bench timeline's per-tile marks of a traced CPU call (host clock in the interpreter):
    one mark per output tile, inside the measured gated GEMM bar, and no tile starts before
    the Signal op that raises its flag began on its copy queue."""
    world = 3
    results = harness.pool(world).run(_traced_gated, random.randrange(1 << 30), name)
    for err, covered, chunks in results:
        assert err <= ROW_TOL[torch.float32] and covered
        assert chunks and all(c["early"] == 0 and c["tiles"] > 0 for c in chunks), chunks


def test_even_split_is_the_chunk_rule_the_kernel_tests_use():
    assert even_split(7, 3) == [(0, 3), (3, 2), (5, 2)]


def _stuck_peer_gated(rank, world, seed):
    import time

    from ficco.errors import CommTimeoutError

    shards, bs, _, refs = make_inputs(seed, world, (6, 8), (5,), torch.float32)
    ficco.all_gather_matmul(shards[rank], bs[0], schedule="gated-1d")   # agree on the shape
    outcome = "returned"
    if rank != world - 1:   # the last rank never comes to the second call
        start = time.monotonic()
        try:
            with ficco.config.scope(timeout=2):
                ficco.all_gather_matmul(shards[rank], bs[0], schedule="gated-1d")
        except CommTimeoutError as exc:
            outcome = f"{time.monotonic() - start:.1f}s {exc}"
    ficco.shutdown()
    # The compute queue is free again (the kernel stopped waiting): a plain call still works.
    out = ficco.all_gather_matmul(shards[rank], bs[0], schedule="serial")
    return outcome, max_row_rel_err(out, refs[0])


@pytest.mark.skipif(kernels.unavailable_reason("cpu") is not None,
                    reason=str(kernels.unavailable_reason("cpu")))
def test_stuck_peer_ends_the_gated_kernel_wait_within_the_deadline():
    """A peer that never comes: the barrier before the copies times out and the call raises
    within the deadline naming the late rank, while the interpreted kernel that was spinning
    on the flags stops (halted by the abort, else by its budget), so the compute queue of the
    next call is free."""
    world = 3
    results = harness.pool(world).run(_stuck_peer_gated, random.randrange(1 << 30))
    for rank, (msg, _) in enumerate(results[:-1]):
        seconds = float(msg.split("s ", 1)[0])
        assert seconds < 15, msg
        assert f"rank {rank}" in msg and f"[{world - 1}]" in msg, msg
    assert results[-1][0] == "returned"
    assert all(err <= ROW_TOL[torch.float32] for _, err in results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("world", (2, 4))
def test_gated_on_one_gpu_shared_by_several_ranks(world, name, dtype):
    """Several ranks as processes on one GPU (IPC symmetric memory, copy engines, stream
    writes raising the flags) against float64. Correctness only."""
    from ...gpu import gpu_cases

    seed = random.randrange(1 << 30)
    failures = harness.pool(world, {"FICCO_TIMEOUT": "60"}).run(
        gpu_cases.schedule_case, name, "dma", dtype, seed, timeout_s=300)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


def test_without_triton_ficco_imports_and_gated_schedules_say_why():
    """A user without Triton: ficco imports, names() is the eleven, the gated schedules are
    not offered and each says why; they still plan and simulate (plain data)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"      # as if Triton were not installed
        "import ficco\n"
        "from ficco import schedules\n"
        "from ficco.heuristics import profiles, simulator\n"
        "from ficco.plan.problem import Problem\n"
        "assert len(schedules.names()) == 11, schedules.names()\n"
        "why = schedules.unavailable('cuda:sm_90')\n"
        "assert set(why) == {'gated-1d', 'gated-2d'} and 'not installed' in why['gated-1d']\n"
        "assert 'gated-1d' not in schedules.offered('cuda:sm_90')\n"
        "p = Problem(m=64, k=128, ns=(64,), dtype='bfloat16', world=4)\n"
        "plan = schedules.get('gated-2d').plan(p, 'dma')\n"
        "assert simulator.simulate(plan, profiles.load('h100')).makespan_s > 0\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_explain_says_which_gpu_features_are_off_until_a_lease_verified_them():
    """Gated GEMMs and device signal pads stay off by default on GPUs until a lease
    verified them there, and every Decision printed on a GPU target says so and how to turn
    them on; CPU decisions carry nothing of it."""
    from ficco.heuristics import choose
    from ficco.plan.problem import Problem

    problem = Problem(64, 64, (64,), "bfloat16", 4)
    shown = str(choose(problem, target="cuda:sm_90", selector="model"))
    assert "off       gated-1d, gated-2d: " in shown and "not been verified" in shown
    assert "off       FICCO_SIGNAL_PADS=device: " in shown
    assert "off " not in str(choose(problem, target="cpu", selector="model"))


def test_an_interpreter_too_old_for_the_gated_gemm_is_refused_naming_the_version(monkeypatch):
    """Triton 3.6's interpreter (torch 2.11's Triton) rejects the gated GEMM's
    persistent loop and the fence: the CPU backend refuses it with why, not mid-kernel."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kernels.triton_reason.cache_clear()
    try:
        reason = kernels.unavailable_reason("cpu")
    finally:
        kernels.triton_reason.cache_clear()
    assert reason is not None and "Triton 3.6.0's interpreter" in reason and ">= 3.8" in reason
    assert kernels.unavailable_reason("cuda:sm_90") != reason
