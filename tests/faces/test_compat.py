"""ficco.compat.fused_all_gather_matmul against torch's own fallback (the oracle)."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback

import ficco

from .. import harness

CASES = [((8, 12), 0), ((3, 5, 12), 0), ((3, 5, 12), 1), ((2, 3, 4, 8), 2), ((6, 10), 1),
         ((3, 5, 12), 2), ((6, 10), -1)]


def _compare(rank, world, seed):
    group_name = dist.group.WORLD.group_name
    problems = []
    for case, (shape, gdim) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed + case)
        shards = [torch.randn(*shape, generator=gen) for _ in range(world)]
        # Gathering along the last dim concatenates K: then B has W*K rows.
        k = shape[-1] * (world if gdim % len(shape) == len(shape) - 1 else 1)
        Bs = [torch.randn(k, n, generator=gen) for n in (5, 3)]
        for return_A in (True, False):
            want_A, want = _fused_all_gather_matmul_fallback(shards[rank], Bs, gdim, group_name,
                                                             return_A=return_A)
            got_A, got = ficco.compat.fused_all_gather_matmul(shards[rank], Bs, gdim, group_name,
                                                              return_A=return_A)
            label = f"shape {shape} gather_dim {gdim} return_A {return_A}"
            if (got_A is None) != (want_A is None):
                problems.append(f"{label}: A is {type(got_A)}")
            pairs = list(zip(got, want)) + ([(got_A, want_A)] if want_A is not None else [])
            for g, w in pairs:
                if g.shape != w.shape or g.stride() != w.stride():
                    problems.append(f"{label}: shape/stride {g.shape}/{g.stride()} vs "
                                    f"{w.shape}/{w.stride()}")
                elif not torch.allclose(g, w, rtol=1e-5, atol=1e-5):
                    problems.append(f"{label}: values differ by {(g - w).abs().max()}")
    return problems


def test_compat_matches_torch_fallback():
    assert harness.pool(2).run(_compare, random.randrange(1 << 30)) == [[], []]


def _last_dim_bad_inputs(rank, world, seed):
    """gather_dim = last: every bad input raises InvalidArgumentError before communicating;
    ranks with different shards raise MismatchError on every rank."""
    from ficco.errors import InvalidArgumentError, MismatchError

    group_name = dist.group.WORLD.group_name
    a = torch.randn(4, 6)
    seen = []
    for label, A, Bs in [("1-D B", a, [torch.randn(6 * world)]),
                         ("int64", a.long(), [torch.randn(6 * world, 3).long()]),
                         ("wrong K", a, [torch.randn(6, 3)]),
                         ("fp8", a.to(torch.float8_e4m3fn),
                          [torch.randn(6 * world, 3).to(torch.float8_e4m3fn)])]:
        try:
            ficco.compat.fused_all_gather_matmul(A, Bs, -1, group_name)
            seen.append(f"{label}: no error")
        except InvalidArgumentError:
            seen.append(f"{label}: refused")
        except Exception as exc:  # noqa: BLE001
            seen.append(f"{label}: {type(exc).__name__}")
    cols = 6 if rank == 0 else 5
    try:
        with ficco.config.scope(timeout=10):
            ficco.compat.fused_all_gather_matmul(torch.randn(4, cols),
                                                 [torch.randn(world * cols, 3)], 1, group_name)
        seen.append("mismatch: no error")
    except MismatchError:
        seen.append("mismatch: MismatchError")
    except Exception as exc:  # noqa: BLE001
        seen.append(f"mismatch: {type(exc).__name__}")
    return seen


def test_compat_last_dim_path_is_validated_and_agreed():
    for seen in harness.pool(2).run(_last_dim_bad_inputs, 0):
        assert seen == ["1-D B: refused", "int64: refused", "wrong K: refused", "fp8: refused",
                        "mismatch: MismatchError"], seen
