"""Randomized programs on CPU ranks: every rank runs the same random program of
ficco calls, except that each rank, at random, skips a call, repeats one, swaps two, has one
refused on its own rank (bad input) or failing inside its plan (an injected GEMM failure);
every few calls every rank calls ``ficco.shutdown()`` (the recovery every program makes).

The rule the runs check (docs/design.md §7, "How calls pair"): within a session (between two
resets), the n-th call that enters ficco on a rank runs with the n-th call of every peer.
So every result a rank gets must equal, against float64, the call those n-th calls make
together, and those calls must be the same call on every rank; anything else must be a ficco
error, within a bound of time. Every rank knows every rank's program (one seed), so each
checks its own results. Each session runs on a group of its own (made at the reset, by every
rank): a plan that failed over ``ccl`` leaves its group poisoned for good, as it should.

``run_program(rank, world, seed, ...)`` runs on a rank (tests/harness.py) and returns
``(outcomes, seconds)``: per entered call its position in its session, the call and what
came back; :func:`judge` turns the ranks' returns into counts and the failures.
"""
from __future__ import annotations

import random
import time

import torch

import ficco

# The calls a program draws from: (op, rows per rank, K, n); a dense op's shapes.
CALLS = [("ag", 4, 16, 8), ("ag", 6, 16, 8), ("rs", 8, 12, 6), ("rs", 6, 12, 6)]
SCHEDULES = [None, "ring", "serial", "uniform-fused-1d", "hetero-unfused-1d"]
TRANSPORTS = ["dma", "ccl"]
PERTURBATIONS = ["skip", "repeat", "swap", "refuse", "fail"]


def program(seed: int, world: int, calls: int = 24, reset_every: int = 6,
            rate: float = 0.06) -> list[list[tuple]]:
    """Every rank's sequence of steps: ``("call", index, spec, kind)`` (kind "ok", "refuse"
    or "fail") or ``("reset",)``. ``spec`` is ``(op, rows, K, n, schedule, transport)``.
    Index: the call's place in the common program (a repeat gets index + 0.5)."""
    rng = random.Random(seed)
    common = []
    for i in range(calls):
        op, rows, k, n = rng.choice(CALLS)
        common.append((i, (op, rows, k, n, rng.choice(SCHEDULES), rng.choice(TRANSPORTS))))
    per_rank = []
    for r in range(world):
        prng = random.Random(seed * 1009 + r)
        steps: list[tuple] = []
        i = 0
        while i < len(common):
            if i and i % reset_every == 0 and (not steps or steps[-1] != ("reset",)):
                steps.append(("reset",))
            index, spec = common[i]
            what = prng.choice(PERTURBATIONS) if prng.random() < rate else None
            if what == "skip":
                i += 1
                continue
            if what == "swap" and i + 1 < len(common) and (i + 1) % reset_every:
                nxt = common[i + 1]
                steps += [("call", nxt[0], nxt[1], "ok"), ("call", index, spec, "ok")]
                i += 2
                continue
            kind = what if what in ("refuse", "fail") else "ok"
            steps.append(("call", index, spec, kind))
            if what == "repeat":
                steps.append(("call", index + 0.5, spec, "ok"))
            i += 1
        steps.append(("reset",))
        per_rank.append(steps)
    return per_rank


def inputs(seed: int, index: float, rank: int, spec: tuple, world: int):
    """This rank's tensors for call ``index`` (float64 masters, the call uses float32)."""
    op, rows, k, n, _, _ = spec
    gen = torch.Generator().manual_seed(hash((seed, index, rank)) % (1 << 62))
    if op == "ag":
        return (torch.randn(rows, k, generator=gen, dtype=torch.float64),
                torch.randn(k, n, generator=gen, dtype=torch.float64))
    return (torch.randn(rows * world, k, generator=gen, dtype=torch.float64),
            torch.randn(k, n, generator=gen, dtype=torch.float64))


def _call(spec: tuple, a: torch.Tensor, b: torch.Tensor, refuse: bool, group):
    op, _, _, _, schedule, transport = spec
    a32 = a.to(torch.int64) if refuse else a.float()    # refused on this rank: a bad dtype
    with ficco.config.scope(transport=transport):
        if op == "ag":
            return ficco.all_gather_matmul(a32, b.float(), group, schedule=schedule)
        return ficco.matmul_reduce_scatter(a32, b.float(), group, schedule=schedule)


def run_program(rank: int, world: int, seed: int, calls: int = 24, timeout: float = 2.0):
    """Run this rank's part of program ``seed``: ``(outcomes, seconds)``, outcomes
    ``(session, position, index, spec, kind, result, seconds)`` per call that entered ficco,
    result ``("data", tensor)``, ``("error", "Type: message")`` or ``("crash", ...)`` (not a
    ficco error)."""
    import torch.distributed as dist

    from ficco.backends import get_backend

    from .cases import fail_next_gemm

    steps = program(seed, world, calls)[rank]
    outcomes = []
    session = position = 0
    ficco.shutdown()                       # start in step: every rank reset alike
    group = dist.new_group(list(range(world)))
    for spec in [(op, rows, k, n, None, t) for op, rows, k, n in CALLS for t in TRANSPORTS]:
        _call(spec, *inputs(seed, -1, rank, spec, world), False, group)    # first uses, untimed
    ficco.shutdown()
    group = dist.new_group(list(range(world)))
    start = time.monotonic()
    with ficco.config.scope(timeout=timeout):
        for step in steps:
            if step[0] == "reset":
                ficco.shutdown()
                group = dist.new_group(list(range(world)))
                session, position = session + 1, 0
                continue
            _, index, spec, kind = step
            a, b = inputs(seed, index, rank, spec, world)
            restore = fail_next_gemm(get_backend()) if kind == "fail" else None
            began = time.monotonic()
            try:
                result = ("data", _call(spec, a, b, kind == "refuse", group).double())
            except ficco.errors.FiccoError as exc:
                result = ("error", f"{type(exc).__name__}: {str(exc)[:300]}")
            except Exception as exc:  # noqa: BLE001 - not a ficco error: the judge says so
                result = ("crash", f"{type(exc).__name__}: {str(exc)[:300]}")
            finally:
                if restore is not None:
                    restore()
            outcomes.append((session, position, index, spec, kind, result,
                             time.monotonic() - began))
            position += 1
    ficco.shutdown()
    return outcomes, time.monotonic() - start


def _reference(seed: int, world: int, rank: int, partners: list) -> torch.Tensor:
    """What the n-th calls of every rank (``partners``: (index, spec) per rank) compute
    together, for ``rank``."""
    spec = partners[rank][1]
    tensors = [inputs(seed, index, r, spec, world) for r, (index, _) in enumerate(partners)]
    if spec[0] == "ag":
        gathered = torch.cat([a for a, _ in tensors])
        return gathered @ tensors[rank][1]
    total = sum(a @ b for a, b in tensors)
    rows = spec[1]
    return total[rank * rows:(rank + 1) * rows]


def judge(seed: int, world: int, results: list, timeout: float = 2.0) -> dict:
    """Counts over the ranks' returns of :func:`run_program`: ``calls``, ``data`` (right
    results), ``errors``, ``wrong`` (data that is not what the paired calls compute, or came
    from calls that differ), ``crashed`` (a non-ficco exception), ``hung`` (a call that took
    longer than three deadlines and a grace: every wait it makes is bounded by one), the
    slowest rank's seconds, and the first few ``failures`` described."""
    counts = {"calls": 0, "data": 0, "errors": 0, "wrong": 0, "crashed": 0, "hung": 0,
              "failures": []}
    by_rank = [{(s, p): (index, spec, kind) for s, p, index, spec, kind, *_ in outcomes}
               for outcomes, _ in results]
    for rank, (outcomes, _) in enumerate(results):
        for session, position, index, spec, _, result, seconds in outcomes:
            counts["calls"] += 1
            if seconds > 3 * timeout + 5:
                counts["hung"] += 1
                counts["failures"].append((rank, session, position, index, f"{seconds:.1f}s"))
            if result[0] == "error":
                counts["errors"] += 1
                continue
            if result[0] == "crash":
                counts["crashed"] += 1
                counts["failures"].append((rank, session, position, index, result[1]))
                continue
            partners = [by_rank[r].get((session, position)) for r in range(world)]
            # (a partner whose own GEMM failed still sent its part: the data may be right;
            # one refused on its rank never sent anything)
            same = all(p is not None and p[1] == spec and p[2] != "refuse" for p in partners)
            if not same:
                counts["wrong"] += 1
                counts["failures"].append((rank, session, position, index,
                                           f"data from unlike calls {partners}"))
                continue
            ref = _reference(seed, world, rank, [(p[0], p[1]) for p in partners])
            err = float((result[1] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            if err > 1e-4:
                counts["wrong"] += 1
                counts["failures"].append((rank, session, position, index, f"error {err:.3g}"))
            else:
                counts["data"] += 1
    counts["seconds"] = max(seconds for _, seconds in results)
    counts["failures"] = counts["failures"][:5]
    return counts
