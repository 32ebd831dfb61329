"""Float64 references and tolerances shared by the tests."""
from __future__ import annotations

import torch

# Largest per-row error accepted, by dtype, as ||out_i - ref_i|| / || |A_i| @ |B| ||: the scale
# of a GEMM's rounding error (|C - C^| <= gamma |A||B|). Relative to ||ref_i|| instead, a row
# whose terms cancel would fail on rounding alone: bf16/fp16 outputs are rounded once per
# partial sum, and the 2d schedules accumulate W partial sums. A missing or misplaced chunk
# still errs by a large fraction of the scale, and an unwritten (NaN) row counts as infinite.
ROW_TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 6e-3}


def invalid_argument_report(cases: dict) -> dict:
    """Run every ``label -> fn`` and say how it failed: ``"ok"`` for an InvalidArgumentError
    with a message, else what happened instead (bad-input tests expect every value "ok")."""
    from ficco.errors import InvalidArgumentError

    out = {}
    for label, fn in cases.items():
        try:
            fn()
            out[label] = "no error"
        except InvalidArgumentError as exc:
            out[label] = "ok" if str(exc) else "empty message"
        except Exception as exc:  # noqa: BLE001 - report the wrong kind
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def max_row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row's error over its rounding scale (``ref.scale`` when :func:`make_inputs` set
    it, else ``ref`` itself), NaN counted as infinite."""
    if out.shape != ref.shape:
        return float("inf")
    rows = ref.shape[:-1].numel()      # (not -1: a matrix with no columns has any number)
    out64 = out.detach().to(torch.float64).reshape(rows, out.shape[-1]).cpu()
    ref64 = ref.to(torch.float64).reshape(rows, ref.shape[-1]).cpu()
    scale = getattr(ref, "scale", ref).to(torch.float64).reshape(rows, ref.shape[-1]).cpu()
    if torch.isnan(out64).any():
        return float("inf")
    num = (out64 - ref64).norm(dim=1)
    den = scale.norm(dim=1).clamp_min(1e-30)
    return float((num / den).max()) if num.numel() else 0.0


def make_inputs(seed, world, shard_shape, ns, dtype, gather_dim=0):
    """Every rank's shard (same generator on all ranks) and the b's, all fresh random."""
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.randn(*shard_shape, generator=gen).to(dtype) for _ in range(world)]
    bs = [torch.randn(shard_shape[-1], n, generator=gen).to(dtype) for n in ns]
    full = torch.cat(shards, dim=gather_dim)
    refs = []
    for b in bs:
        ref = full.to(torch.float64) @ b.to(torch.float64)
        ref.scale = full.to(torch.float64).abs() @ b.to(torch.float64).abs()
        refs.append(ref)
    return shards, bs, full, refs


def ficco_calls(fn):
    """``fn()`` under the profiler: its result and {op name: calls} of torch.ops.ficco.*
    (forward and backward) it dispatched."""
    from torch.profiler import profile

    with profile() as prof:
        result = fn()
    counts: dict = {}
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and parent.name != event.name:
            parent = parent.cpu_parent
        # one call is one top-level event (the autocast kernel re-dispatches the same op)
        if event.name.startswith("ficco::") and parent is None:
            counts[event.name] = counts.get(event.name, 0) + 1
    return result, counts


def ficco_call_ranges(fn):
    """``fn()`` under the profiler: its result and {op name: calls} of every multi-rank ficco
    call it made (each is a ``ficco.<op> ...`` range, ficco/profiling.py), eager calls and the
    ones inside an autograd backward included (:func:`ficco_calls` sees only those dispatched
    as ``torch.ops.ficco.*``)."""
    from torch.profiler import profile

    with profile() as prof:
        result = fn()
    counts: dict = {}
    for event in prof.events():
        name = event.name.split(" ")[0]
        if name.startswith("ficco.") and name != "ficco.execute":
            op = name[len("ficco."):]
            counts[op] = counts.get(op, 0) + 1
    return result, counts
