"""The Ulysses pair's eager path (the op's real kernel)."""
from __future__ import annotations

from ... import group as groups
from ...runtime import path as runtime
from ...runtime.call import FORWARD
from .all_to_all_matmul import SPEC as ALL_TO_ALL_MATMUL_SPEC
from .matmul_all_to_all import SPEC as MATMUL_ALL_TO_ALL_SPEC

SPECS = {s.name: s for s in (MATMUL_ALL_TO_ALL_SPEC, ALL_TO_ALL_MATMUL_SPEC)}


def run_eager(op: str, a, b, group, scatter_dim, gather_dim, schedule=None, role=FORWARD):
    """``op`` on this rank's tensors, validated before any communication (a refused call
    still takes its place in the group's sequence of calls)."""
    group = groups.resolve(group)
    try:
        call = SPECS[op].prepare(a, b, group, scatter_dim=scatter_dim, gather_dim=gather_dim,
                                 role=role)
    except BaseException:
        runtime.abandoned(group)
        raise
    return runtime.run(call, schedule=schedule)
