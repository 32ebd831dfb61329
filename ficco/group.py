"""Process groups as every module of ficco names them: one order, ``(rank, world)``; one name for
"no process group", :data:`NO_GROUP`.

The public functions accept a group as None (the default group, or no group at all when
torch.distributed is not initialised), a group name, a ProcessGroup or a 1-D DeviceMesh;
:func:`resolve` turns that into a ProcessGroup or None. The torch custom ops take a group
*name* (a traced graph carries no ProcessGroup object): :func:`name_of` makes it,
:func:`by_name` turns it back. Caches and cross-rank agreement key a group by :func:`key`.

>>> resolve(None) is None, name_of(None) == NO_GROUP     # no process group: a world of one
(True, True)
>>> rank_world(None), rank_world_of(NO_GROUP)
((0, 1), (0, 1))
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError

#: The name of "no process group" (torch.distributed not initialised): a world of one.
NO_GROUP = ""


def resolve(group):
    """The ProcessGroup for ``group`` (None, a name, a ProcessGroup or a 1-D DeviceMesh), or
    None when there is no group: None without torch.distributed initialised, or
    :data:`NO_GROUP`."""
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        _alone_or_refuse()
        return None
    if isinstance(group, str):
        return by_name(group)
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    if type(group).__name__ == "DeviceMesh":
        if group.ndim != 1:
            raise InvalidArgumentError(
                f"group is a {group.ndim}-D DeviceMesh {tuple(group.shape)}; pass the 1-D mesh "
                f"of the dimension to gather over, e.g. mesh['tp']")
        return group.get_group()
    if (dist.is_available() and type(group) is int
            and group == dist.GroupMember.NON_GROUP_MEMBER):
        raise InvalidArgumentError(
            f"this rank (global rank {dist.get_rank()}) is not a member of the group: "
            f"dist.new_group returns GroupMember.NON_GROUP_MEMBER on ranks it leaves out; call "
            f"ficco only on the group's ranks (if group != dist.GroupMember.NON_GROUP_MEMBER)")
    raise InvalidArgumentError(
        f"group must be a torch.distributed ProcessGroup, a group name, a 1-D DeviceMesh or "
        f"None; got {type(group).__name__}")


def _alone_or_refuse() -> None:
    """No process group: a world of one, unless the environment says this process is one of
    several (torchrun, SLURM, mpirun set WORLD_SIZE): then every rank would silently compute a
    plain matmul of its own shard."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit() and int(world) > 1:
        raise InvalidArgumentError(
            f"WORLD_SIZE={world} says this process is one of {world} ranks, but no default "
            f"process group is initialised, so ficco would compute each rank's shard alone: "
            f"call torch.distributed.init_process_group() first (or pass group=...), or unset "
            f"WORLD_SIZE for a single-process run")


def by_name(name: str):
    """The ProcessGroup called ``name``; None for :data:`NO_GROUP`. Not cached: a name is
    reused when a process group is destroyed and created again."""
    if name == NO_GROUP:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)  # type: ignore[arg-type]  # a GroupName is a str
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds here
        raise InvalidArgumentError(f"group name {name!r} names no process group: {exc}") from None


def name_of(group) -> str:
    """The name the torch ops take for ``group`` (anything :func:`resolve` accepts). Plain
    Python, cheap: runs at trace time under ``torch.compile``."""
    if isinstance(group, str):
        return group
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)) \
            and _is_1d_mesh(group):
        # As torch's functional collectives do: under torch.compile a mesh and its ProcessGroup
        # are FakeScriptObjects, its recorded group name a plain str.
        return group._dim_group_names[0]
    return key(resolve(group))


def name_rank_world(group) -> tuple[str, int, int]:
    """``(name, rank, world)`` of ``group`` (anything :func:`resolve` accepts): the group
    arguments of the torch ops. Called by the public functions, where torch.compile traces:
    dynamo folds ``ProcessGroup`` and ``DeviceMesh`` lookups (and a name's, through
    :func:`_rank_world_by_name`) into constants of the graph, so the graph, and so the key
    under which torch.compile caches what it compiles on disk (shared by every process of a
    machine), carries them. The ops' fake kernels and backward formulas read only these
    arguments, never the process (a cached graph would give one rank another's sizes).

    >>> name_rank_world(None)
    ('', 0, 1)
    """
    if isinstance(group, str):
        return (group, *_rank_world_by_name(group))
    if _is_1d_mesh(group):
        return group._dim_group_names[0], group.get_local_rank(), group.size()
    pg = resolve(group)
    if pg is None:
        return NO_GROUP, 0, 1
    # rank_world's numbers (a member's group rank), as two C++ calls: on every op call
    return key(pg), pg.rank(), pg.size()


@torch.compiler.assume_constant_result
def _rank_world_by_name(name: str) -> tuple[int, int]:
    # dynamo cannot trace a name's lookup (torch's resolver is a C++ function it skips):
    # called while tracing, its result becomes a constant, as ProcessGroup.rank() does
    return rank_world_of(name)


def world_arg(op: str, name: str, world: int | None) -> int:
    """The group size a fake kernel or backward formula of ``torch.ops.ficco.<op>`` uses: its
    ``world`` argument. None (a call written before the argument existed) is a world of one for
    :data:`NO_GROUP`; for any other group it is refused, with why and the fix."""
    if world is not None:
        return world
    if name == NO_GROUP:
        return 1
    raise InvalidArgumentError(
        f"torch.ops.ficco.{op} on group {name!r} was traced without its world argument: its "
        f"fake kernel and backward read sizes only from their arguments (torch.compile caches "
        f"a compiled graph on disk under a key made of them, shared by every rank and job of "
        f"a machine, so a size read from this process would reach others); call "
        f"ficco.{op}, which passes them, or pass world= (the group's size, "
        f"ficco.group.name_rank_world(group)[2])")


def wrong_world(op: str, group, world: int, actual: int) -> InvalidArgumentError:
    """The error of a real kernel of ``torch.ops.ficco.<op>`` given a ``world`` that is not its
    group's size ``actual`` (raised before any communication)."""
    return InvalidArgumentError(
        f"torch.ops.ficco.{op}: world={world} but group {name_of(group)!r} has {actual} ranks; "
        f"pass the group's size (ficco.group.name_rank_world(group)[2]) or call ficco.{op}")


def _is_1d_mesh(group) -> bool:
    # isinstance, not the type's name: under torch.compile the type is FakeScriptObject
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:          # torch built without distributed
        return False
    return isinstance(group, DeviceMesh) and group.ndim == 1


def key(group) -> str:
    """The name of a *resolved* group (a ProcessGroup, or None for no group) that every rank
    computes alike: the group part of cache and agreement keys."""
    if group is None:
        return NO_GROUP
    return getattr(group, "group_name", None) or str(id(group))


def rank_world(group) -> tuple[int, int]:
    """``(rank, world)`` of this process in a resolved group (None: ``(0, 1)``)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def rank_world_of(name: str) -> tuple[int, int]:
    """``(rank, world)`` in the group called ``name`` (:data:`NO_GROUP`: ``(0, 1)``)."""
    return rank_world(by_name(name))
