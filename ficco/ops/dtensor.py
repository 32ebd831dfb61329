"""DTensor operands of ficco's ops: each is used through its local tensor, its mesh is the group.

A DTensor is accepted where its placement says what the op needs this rank to hold:

================================  ===================================  ==========================
op                                ``a``                                ``b`` (each weight)
================================  ===================================  ==========================
``all_gather_matmul``             ``Shard(gather_dim)``: the shard     ``Replicate()`` or
                                  to gather                            ``Shard(1)``: its columns
``matmul_reduce_scatter``         ``Shard(-1)``: this rank's K slice   ``Shard(0)``: its K rows
``matmul_all_reduce``             ``Shard(-1)``: this rank's K slice   ``Shard(0)``: its K rows
================================  ===================================  ==========================

Each op's spec declares its row (:class:`~ficco.ops.base.Placements`, ``OpSpec.placements``). The output is
this rank's plain local result (what ``to_local()`` of torch's DTensor result
would hold). Anything else is refused, naming the placement to use. Plain Python on
placements: ``torch.compile`` runs it at trace time.

>>> operands("all_gather_matmul", "a_shard", 0, None, None)   # no DTensor: nothing to do
(None, None)
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from .base import Placements


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def operands(op: str, name: str, t, dim, mesh):
    """``(local tensor, mesh)`` of ``t`` when it is a DTensor placed as ``op`` needs its
    operand ``name`` (``a``/``a_shard`` or ``b``/``b[j]``); ``(None, mesh)`` when it is not a
    DTensor. ``dim`` is ``a``'s gather dimension; ``mesh`` the mesh of an earlier operand (all
    must share one)."""
    if not is_dtensor(t):
        return None, mesh
    from . import get

    placements = get(op).placements
    if placements is None:
        raise InvalidArgumentError(f"{op} takes no DTensor operands: pass {name}.to_local() "
                                   f"and group=<the 1-D mesh>")
    role = "a" if name.startswith("a") else "b"
    ok, fix = _placed_as_needed(placements, role, t, dim)
    if not ok:
        raise InvalidArgumentError(
            f"{name} is a DTensor with placements {tuple(t.placements)} on a "
            f"{t.device_mesh.ndim}-D mesh; {op} takes a DTensor {name} on a 1-D mesh placed as "
            f"{fix}, or a plain tensor: pass {name}.to_local() and group=<the 1-D mesh>")
    if mesh is not None and t.device_mesh != mesh:
        raise InvalidArgumentError(
            f"{name} is a DTensor on mesh {t.device_mesh} but an earlier operand is on mesh "
            f"{mesh}; put every DTensor operand on the one mesh the op runs over")
    return t.to_local(), t.device_mesh


def _placed_as_needed(placements: Placements, role: str, t, dim) -> tuple[bool, str]:
    from torch.distributed.tensor import Replicate, Shard

    dims, fix = ((placements.a, placements.a_words) if role == "a" else
                 (placements.b, placements.b_words))
    nd = t.dim()
    gather = dim % nd if isinstance(dim, int) and -nd <= dim < nd else dim
    fix = fix.format(dim=gather)
    if t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return False, fix
    (p,) = t.placements
    shard = p.dim % nd if isinstance(p, Shard) else None
    wanted = {gather if d is None else d % nd for d in dims}
    good = shard in wanted or (role == "b" and placements.b_replicate and
                               isinstance(p, Replicate))
    return good, fix
