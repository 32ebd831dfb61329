"""Rank-side checks of every op's example and float64 oracle (``OpSpec.example``,
``OpSpec.reference``), importable by spawned ranks."""
from __future__ import annotations

import torch

import ficco
from ficco import ops
from ficco.ops.examples import Rounding, first

from .reference import max_row_rel_err


def every_op_against_its_oracle(rank, world, seed):
    """Every registered op, on its example in float64 (uneven rows: ``m`` does not divide),
    against its reference: the error of the op's output, and of a wrong output (another
    seed's reference, or this output with one value changed), which must be large."""
    failures = []
    for i, op in enumerate(ops.names()):
        spec = ops.get(op)
        example = spec.example(rank, world, (5, 6, 2 * world + 1), Rounding("float64"),
                               seed + i)
        ref, scale = spec.reference(example)
        if ref.dtype != torch.float64 or scale.shape != ref.shape:
            failures.append(f"{op}: reference {ref.dtype} {tuple(ref.shape)}, scale "
                            f"{tuple(scale.shape)}")
            continue
        out = first(getattr(ficco, op)(*example.args, **example.kwargs))
        err = max_row_rel_err(out, ref)
        if not err <= 1e-12:
            failures.append(f"{op}: err {err:.3g}")
        other = spec.reference(spec.example(rank, world, (5, 6, 2 * world + 1),
                                            Rounding("float64"), seed + i + 1000))[0]
        wrong = out.clone().double()
        if wrong.numel():
            wrong.view(-1)[0] += 1.0
        for what, bad in (("another seed's", other), ("one value off", wrong)):
            if bad.numel() and bad.shape == ref.shape and not max_row_rel_err(bad, ref) > 1e-6:
                failures.append(f"{op}: {what} output passes the oracle")
    return failures
