"""A campaign of bad calls to every public surface, run on rank 0 of a pool
while rank 1 makes none: each must end in a clean ``ficco.errors`` error before any
communication. Every way ficco reaches other ranks (the group's store, torch.distributed's
collectives, functional collectives) is replaced meanwhile by a tripwire that records the
attempt and raises, so a call that would communicate is caught instead of hanging.

Outcomes: ``"ficco: <class>"`` (the wanted one), ``"communicated"``, ``"non-ficco: <type>"``
(raised something else first), ``"accepted"`` (returned). (A keyword a function does not
take is Python's TypeError, raised before any of ficco runs: not a case here.)
"""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import ficco
import ficco.moe
import ficco.nn as fnn
from ficco import compat
from ficco.errors import FiccoError
from ficco.runtime import agreement, session

E4M3 = torch.float8_e4m3fn
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
                "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
                "broadcast_object_list", "gather", "irecv", "isend", "monitored_barrier", "recv",
                "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "send")
_FUNCOL = ("all_gather_tensor", "all_reduce", "all_to_all_single", "reduce_scatter_tensor",
           "broadcast")


class _Communicated(BaseException):
    """Raised by a tripwire: past every except clause that catches Exception."""


@contextlib.contextmanager
def tripwires(seen: list):
    import torch.distributed._functional_collectives as funcol

    def wire(name):
        def tripped(*args, **kwargs):
            seen.append(name)
            raise _Communicated(name)
        return tripped

    saved = [(agreement, "store_of", agreement.store_of)]
    saved += [(dist, n, getattr(dist, n)) for n in _COLLECTIVES if hasattr(dist, n)]
    saved += [(funcol, n, getattr(funcol, n)) for n in _FUNCOL if hasattr(funcol, n)]
    for module, name, _ in saved:
        setattr(module, name, wire(f"{module.__name__}.{name}"))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def outcome(fn) -> str:
    """How ``fn()`` ended (see the module docstring)."""
    seen: list = []
    channel = session.channel_of(dist.group.WORLD) if dist.is_initialized() else None
    generation = None if channel is None else channel.generation
    try:
        with tripwires(seen):
            fn()
        result = "accepted"
    except _Communicated:
        result = "communicated"
    except FiccoError as exc:
        result = f"ficco: {type(exc).__name__}" if str(exc) else "ficco: empty message"
    except Exception as exc:  # noqa: BLE001 - the report names it
        result = f"non-ficco: {type(exc).__name__}: {str(exc)[:100]}"
    if seen and result != "communicated":
        result = f"communicated ({seen[0]}), then {result}"
    if seen or result == "accepted":
        # What a call that went further left (a poisoned group, agreed state): dropped, with
        # the channel's reset count kept where the peer's is (no exchange happened: the store
        # was a tripwire), so the peer does not take this for a rank that reset alone.
        ficco.shutdown()
        if channel is not None:
            channel.generation = generation
    return result


def _layer_call(make, *args):
    return lambda: make()(*args)


def cases(world: int) -> dict:
    """label -> a bad call (callables: nothing is made until it runs)."""
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    x, w = torch.randn(5, 4), torch.randn(2, 4, 3)
    good = [5] + [0] * (2 * world - 1)
    y, recv = torch.randn(5, 3), [[5] + [0] * (world - 1), [0] * world]
    a8, b8 = torch.randn(4, 32).to(E4M3), torch.randn(32, 16).to(E4M3)
    one = torch.tensor(1.0)
    huge = torch.randn(1, 6).expand(2 ** 40, 6)        # stride-0 rows: no memory of its own
    name = dist.group.WORLD.group_name if dist.is_initialized() else "0"   # (labels only)
    agm, mrs = ficco.all_gather_matmul, ficco.matmul_reduce_scatter
    disp, comb = ficco.all_to_all_grouped_mm, ficco.grouped_mm_all_to_all
    out = {
        # -- all_gather_matmul
        "agm a not a tensor": lambda: agm([[1.0]], b),
        "agm 1-D a": lambda: agm(torch.randn(6), b),
        "agm K mismatch": lambda: agm(a, torch.randn(5, 4)),
        "agm b 3-D": lambda: agm(a, torch.randn(2, 6, 4)),
        "agm dtype mix": lambda: agm(a, b.double()),
        "agm int dtype": lambda: agm(a.int(), b.int()),
        "agm gather_dim K": lambda: agm(a, b, gather_dim=1),
        "agm gather_dim range": lambda: agm(a, b, gather_dim=5),
        "agm gather_dim float": lambda: agm(a, b, gather_dim=0.0),
        "agm empty b list": lambda: agm(a, []),
        "agm b list of non-tensors": lambda: agm(a, [b, 3]),
        "agm schedule unknown": lambda: agm(a, b, schedule="uniform-fused-3d"),
        "agm schedule not str": lambda: agm(a, b, schedule=3),
        "agm return_gathered str": lambda: agm(a, b, return_gathered="yes"),
        "agm group wrong type": lambda: agm(a, b, group=3.5),
        "agm group unknown name": lambda: agm(a, b, group="no-such-group"),
        "agm device meta b": lambda: agm(a, b.to("meta")),
        "agm K=0": lambda: agm(torch.randn(8, 0), torch.randn(0, 4)),
        "agm huge rows": lambda: agm(huge, b),
        "agm activation unknown": lambda: agm(a, b, activation="tanh"),
        "agm bias shape": lambda: agm(a, b, bias=torch.randn(3)),
        "agm bias list length": lambda: agm(a, [b, b], bias=[torch.randn(4)]),
        "agm out_dtype int": lambda: agm(a, b, out_dtype=torch.int32),
        # -- matmul_reduce_scatter
        "mrs K mismatch": lambda: mrs(a, torch.randn(5, 4)),
        "mrs scatter K": lambda: mrs(a, b, scatter_dim=1),
        "mrs scatter range": lambda: mrs(a, b, scatter_dim=3),
        "mrs reduce_op": lambda: mrs(a, b, reduce_op="max"),
        "mrs reduce_op not str": lambda: mrs(a, b, reduce_op=None),
        "mrs dtype": lambda: mrs(a, b.double()),
        "mrs 1-D a": lambda: mrs(torch.randn(6), b),
        "mrs empty b": lambda: mrs(a, []),
        "mrs schedule": lambda: mrs(a, b, schedule="gated-1d"),
        "mrs huge rows": lambda: mrs(huge, b),
        "mrs bias shape": lambda: mrs(a, b, bias=torch.randn(5)),
        "mrs activation": lambda: mrs(a, b, activation="gelu"),
        # -- fp8 scales / bias / activation
        "fp8 missing scales": lambda: agm(a8, b8),
        "fp8 a_scale shape": lambda: agm(a8, b8, a_scale=torch.ones(3, 1), b_scale=one),
        "fp8 a_scale dtype": lambda: agm(a8, b8, a_scale=one.double(), b_scale=one),
        "fp8 b_scale recipe": lambda: agm(a8, b8, a_scale=torch.ones(4, 1), b_scale=one),
        "fp8 b_scale dtype": lambda: mrs(a8, b8, a_scale=one, b_scale=one.bfloat16()),
        "fp8 scales on bf16": lambda: agm(a.bfloat16(), b.bfloat16(), a_scale=one,
                                          b_scale=one),
        "fp8 bias device": lambda: agm(a8, b8, a_scale=one, b_scale=one,
                                       bias=torch.ones(16, device="meta")),
        "fp8 out_dtype": lambda: mrs(a8, b8, a_scale=one, b_scale=one, out_dtype=torch.int8),
        "fp8 activation rs": lambda: mrs(a8, b8, a_scale=one, b_scale=one, activation="relu"),
        "fp8 a requires grad": lambda: agm(torch.randn(4, 32).to(E4M3).requires_grad_(), b8,
                                           a_scale=one, b_scale=one),
        # -- expert ops
        "dispatch counts sum": lambda: disp(x, [1] * (2 * world), w),
        "dispatch counts length": lambda: disp(x, [5], w),
        "dispatch counts negative": lambda: disp(x, [6, -1] + [0] * (2 * world - 2), w),
        "dispatch counts float": lambda: disp(x, torch.tensor(good) * 1.0, w),
        "dispatch counts not ints": lambda: disp(x, ["5"] + [0] * (2 * world - 1), w),
        "dispatch dtype": lambda: disp(x, good, w.double()),
        "dispatch K mismatch": lambda: disp(x, good, torch.randn(2, 5, 3)),
        "dispatch w 2-D": lambda: disp(x, good, torch.randn(4, 3)),
        "dispatch ragged experts": lambda: disp(x, good, [torch.randn(4, 3), torch.randn(4, 2)]),
        "dispatch no experts": lambda: disp(x, [5], []),
        "dispatch schedule ring-bidir": lambda: disp(x, good, w, schedule="ring-bidir"),
        "dispatch x 3-D": lambda: disp(torch.randn(1, 5, 4), good, w),
        "dispatch huge counts": lambda: disp(huge[:, :4], [2 ** 40] + [0] * (2 * world - 1),
                                             torch.randn(2, 4, 3)),
        "combine recv_counts sum": lambda: comb(y, [[1] * world] * 2, torch.randn(2, 3, 4)),
        "combine recv_counts shape": lambda: comb(y, [5], torch.randn(2, 3, 4)),
        "combine recv_counts negative": lambda: comb(y, [[6, -1] + [0] * (world - 2),
                                                         [0] * world], torch.randn(2, 3, 4)),
        "combine dtype": lambda: comb(y.double(), recv, torch.randn(2, 3, 4)),
        "combine K mismatch": lambda: comb(y, recv, torch.randn(2, 5, 4)),
        "combine unknown send_counts": lambda: comb(y, recv, torch.randn(2, 3, 4),
                                                    send_counts=[9] * (2 * world)),
        # -- ficco.nn
        "nn column in_features": _layer_call(lambda: fnn.ColumnParallelLinear(6, 8),
                                             torch.randn(4, 5)),
        "nn column seq_dim K": _layer_call(lambda: fnn.ColumnParallelLinear(6, 8, seq_dim=2),
                                           torch.randn(2, 4, 6)),
        "nn column out_features negative": lambda: fnn.ColumnParallelLinear(6, -3),
        "nn column in_features 0": lambda: fnn.ColumnParallelLinear(0, 4),
        "nn row in_features bool": lambda: fnn.RowParallelLinear(True, 4),
        "nn column out_features list bad": lambda: fnn.ColumnParallelLinear(4, [6, -1]),
        "nn row in_features": _layer_call(lambda: fnn.RowParallelLinear(8, 6),
                                          torch.randn(4, 7)),
        "nn from_linear not linear": lambda: fnn.ColumnParallelLinear.from_linear(nn.ReLU()),
        "nn from_linear mixed in": lambda: fnn.ColumnParallelLinear.from_linear(
            [nn.Linear(4, 6), nn.Linear(5, 6)]),
        "nn row from_linear list": lambda: fnn.RowParallelLinear.from_linear(
            [nn.Linear(4, 6)]),
        "nn unset seq_dim 3-D": _layer_call(lambda: fnn.ColumnParallelLinear(6, 8),
                                            torch.randn(2, 4, 6)),
        # -- ficco.moe
        "moe k=0": _layer_call(lambda: ficco.moe.MoELayer(8, 16, 2 * world, k=0),
                               torch.randn(5, 8)),
        "moe k > experts": _layer_call(lambda: ficco.moe.MoELayer(8, 16, 2 * world,
                                                                  k=2 * world + 1),
                                       torch.randn(5, 8)),
        "moe k float": _layer_call(lambda: ficco.moe.MoELayer(8, 16, 2 * world, k=1.5),
                                   torch.randn(5, 8)),
        "moe experts not multiple of W": lambda: ficco.moe.MoELayer(8, 16, 2 * world + 1),
        "moe hidden mismatch": _layer_call(lambda: ficco.moe.MoELayer(8, 16, 2 * world),
                                           torch.randn(5, 7)),
        "moe schedule unknown": _layer_call(
            lambda: ficco.moe.MoELayer(8, 16, 2 * world, schedule="ring-bidir"),
            torch.randn(5, 8)),
        "moe ffn experts 0": lambda: ficco.moe.ExpertParallelFFN(8, 16, 0),
        "moe ffn rows/counts": _layer_call(lambda: ficco.moe.ExpertParallelFFN(8, 16, 2 * world),
                                           torch.randn(5, 8), torch.tensor([9] * (2 * world))),
        # -- ficco.parallel: its styles on a module they do not fit
        "parallel colwise 2-D mesh": lambda: _style_on_2d_mesh(world),
        # -- compat twins
        "compat agm gather K": lambda: compat.fused_all_gather_matmul(a, [b], 1, name),
        "compat agm Bs not list": lambda: compat.fused_all_gather_matmul(a, b, 0, name),
        "compat agm group name": lambda: compat.fused_all_gather_matmul(a, [b], 0, "nope"),
        "compat mrs divisibility": lambda: compat.fused_matmul_reduce_scatter(
            torch.randn(world * 2 + 1, 6), b, "sum", 0, name),
        "compat mrs reduce_op": lambda: compat.fused_matmul_reduce_scatter(
            torch.randn(world * 2, 6), b, "max", 0, name),
        "compat mrs K mismatch": lambda: compat.fused_matmul_reduce_scatter(
            torch.randn(world * 2, 6), torch.randn(5, 4), "sum", 0, name),
        "compat scaled agm lists": lambda: compat.fused_all_gather_scaled_matmul(
            a8, [b8], one, [one, one], 0, name, [None], [None], [torch.bfloat16], [False]),
        "compat scaled agm result_scales": lambda: compat.fused_all_gather_scaled_matmul(
            a8, [b8], one, [one], 0, name, [None], [one], [torch.bfloat16], [False]),
        "compat scaled mrs output_shape": lambda: compat.fused_scaled_matmul_reduce_scatter(
            a8, b8, one, one, "sum", 0, 0, name, [5, 16], out_dtype=torch.bfloat16),
        "compat scaled mrs bias shape": lambda: compat.fused_scaled_matmul_reduce_scatter(
            torch.randn(2 * world, 32).to(E4M3), b8, one, one, "sum", 0, 0, name,
            [2 * world, 16], bias=torch.ones(15), out_dtype=torch.bfloat16),
        "compat scaled mrs bias list": lambda: compat.fused_scaled_matmul_reduce_scatter(
            torch.randn(2 * world, 32).to(E4M3), b8, one, one, "sum", 0, 0, name,
            [2 * world, 16], bias=[1.0] * 16, out_dtype=torch.bfloat16),
        "compat scaled mrs bias dtype": lambda: compat.fused_scaled_matmul_reduce_scatter(
            torch.randn(2 * world, 32).to(E4M3), b8, one, one, "sum", 0, 0, name,
            [2 * world, 16], bias=torch.ones(16, dtype=torch.int32), out_dtype=torch.bfloat16),
        # -- per-rank widths: this rank's share of the features, checked locally
        "widths b n differs from bias": lambda: agm(a, torch.randn(6, 3), bias=torch.randn(4)),
        "widths mrs b rows vs a": lambda: mrs(a, torch.randn(7, 4)),
        # -- tensors and flags torch accepts but the op cannot run
        "agm sparse a": lambda: agm(a.to_sparse(), b),
        "mrs sparse b": lambda: mrs(a, b.to_sparse()),
        "agm activation empty": lambda: agm(a, b, activation=""),
        "dispatch counts on meta": lambda: disp(x, torch.tensor(good, device="meta"), w),
        "dispatch no local experts": lambda: disp(x, good, torch.randn(0, 4, 3)),
        "nn row sequence_parallel str": lambda: fnn.RowParallelLinear(8, 6,
                                                                      sequence_parallel="no"),
        # -- settings read by the call
        "env FICCO_TIMEOUT above TIMEOUT_MAX": _with_env("FICCO_TIMEOUT", "1e10",
                                                         lambda: agm(a, b)),
        "env FICCO_TUNE_CANDIDATES bogus": _with_env(
            "FICCO_TUNE_CANDIDATES", "bogus", lambda: agm(a, b), FICCO_SELECTOR="tune"),
        "env FICCO_CACHE_DIR a file": _with_env("FICCO_CACHE_DIR", __file__,
                                                lambda: agm(a, b), FICCO_SELECTOR="auto"),
        "env FICCO_PROFILE a directory": _with_env("FICCO_PROFILE", os.path.dirname(__file__),
                                                   lambda: agm(a, b)),
        "env FICCO_PROFILE binary": _with_env("FICCO_PROFILE", _binary_file(),
                                              lambda: agm(a, b)),
        "env FICCO_PROFILE not an object": _with_env("FICCO_PROFILE", _json_file("[1, 2]"),
                                                     lambda: agm(a, b)),
        # -- explain and names
        "explain bad op": lambda: ficco.explain(a, b, op="nope"),
        "names bad op": lambda: ficco.schedules.names(op="nope"),
    }
    return out


def _with_env(name: str, value: str, fn, **more):
    """``fn`` run with environment variable ``name`` (and ``more``) set, then restored."""
    def run():
        settings = {name: value, **more}
        saved = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return run


def _binary_file() -> str:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, bytes(range(128, 256)))
    os.close(fd)
    return path


def _json_file(text: str) -> str:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, text.encode())
    os.close(fd)
    return path


def _style_on_2d_mesh(world):
    """A style applied with a 2-D mesh (a stand-in: making a real one is collective)."""
    import types

    from ficco.parallel import ColwiseParallel

    mesh = types.SimpleNamespace(ndim=2, shape=(1, world))
    return ColwiseParallel()._apply(nn.Linear(4, 2 * world), mesh)


def campaign(rank, world):
    """Every case's outcome on rank 0 (rank 1 makes no call); then both ranks run one good
    call, which must be right: the pool is in step."""
    results = {}
    session.channel_of(dist.group.WORLD)   # on every rank: its shutdown() counts alike
    if rank == 0:
        for label, fn in cases(world).items():
            results[label] = outcome(fn)
    ficco.shutdown()
    a = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    b = torch.randn(6, 3, generator=torch.Generator().manual_seed(9))
    out = ficco.all_gather_matmul(a, b)
    shards = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    right = torch.allclose(out, torch.cat(shards) @ b, atol=1e-5)
    return results, right


def schedule_env_per_family(rank, world, seed):
    """FICCO_SCHEDULE (here its scope) naming a dense schedule forces the dense ops and leaves
    the expert ops to their selector (they have no ring-bidir); a name of no op fails every
    op with a ConfigError before any communication. Returns what ran and what raised."""
    from ficco import config
    from ficco.errors import ConfigError
    from ficco.runtime import path as runtime

    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(4, 6, generator=gen), torch.randn(6, 3, generator=gen)
    x, w = torch.randn(5, 6, generator=gen), torch.randn(2, 6, 3, generator=gen)
    counts = [5] + [0] * (2 * world - 1)
    ran = {}
    with config.scope(schedule="ring-bidir"):
        ficco.all_gather_matmul(a, b)
        ran["all_gather_matmul"] = runtime.last_run()[0]
        ficco.matmul_reduce_scatter(a, b[:, :3].T.contiguous().T)
        ran["matmul_reduce_scatter"] = runtime.last_run()[0]
        y, recv = ficco.all_to_all_grouped_mm(x, counts, w)
        ran["all_to_all_grouped_mm"] = runtime.last_run()[0]
        ficco.grouped_mm_all_to_all(y, recv, torch.randn(2, 3, 4, generator=gen))
        ran["grouped_mm_all_to_all"] = runtime.last_run()[0]
    refused = []
    with config.scope(schedule="no-such-schedule"):
        for call in (lambda: ficco.all_gather_matmul(a, b),
                     lambda: ficco.all_to_all_grouped_mm(x, counts, w)):
            try:
                with tripwires([]):
                    call()
                refused.append("accepted")
            except ConfigError as exc:
                refused.append("no-such-schedule" in str(exc))
    return ran, refused
