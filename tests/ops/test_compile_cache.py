"""torch.compile's on-disk caches and ficco's ops.

torch.compile keeps what it compiles on disk (the FX graph cache and the AOTAutograd cache, by
default one directory per user, so every process of a machine shares it) under a key made from
the traced graph and its inputs. A size that a fake kernel or a backward formula reads from the
process (this rank's number, the group's size) while tracing is in no key: a rank that loads a
graph another rank (or another job, of another world size) compiled gets that process's sizes.
Before the fix, with 5 rows over 2 ranks, rank 1 loaded rank 0's graph of
``matmul_reduce_scatter`` and failed with ``AssertionError: expected size 2==3``; a W=3 job
loaded a W=2 job's ``all_gather_matmul``.

Each case is deterministic: the ranks compile one after another into one fresh cache directory
(the first populates it, the next would load its entry), and a W=3 pool compiles after a W=2
pool into the same directory. Results are compared with float64 references.
"""
from __future__ import annotations

import random

import torch

from .. import harness

COMPILE_ENV = {"FICCO_TIMEOUT": "300"}   # a rank done compiling waits for the next one's compile
K, N = 8, 4


def _shard(seed: int, rank: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 16 + rank))


def _block(rows: int, rank: int, world: int) -> slice:
    """This rank's rows of ``rows`` (the ops' chunk rule: longer blocks first)."""
    start = sum(rows // world + (r < rows % world) for r in range(rank))
    return slice(start, start + rows // world + (rank < rows % world))


def _inputs(op: str, world: int, rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (a, b): for all_gather_matmul its (rows, K) shard and the (K, N) weight
    every rank holds; for matmul_reduce_scatter its (rows, K) activations and (K, N) weight
    rows (each rank gets its block of the sum of the products)."""
    weight = _shard(seed + 1, 0, K, N)
    return [(_shard(seed, r, rows, K),
             weight.clone() if op == "all_gather_matmul" else _shard(seed + 1, r, K, N))
            for r in range(world)]


def _outputs(op: str, pairs, world: int) -> list[torch.Tensor]:
    """Every rank's result of ``3 * op(1.0 * a, b)``, computed by one process."""
    if op == "all_gather_matmul":
        gathered = torch.cat([a for a, _ in pairs])
        return [3 * gathered @ b for _, b in pairs]
    total = sum(a @ b for a, b in pairs)
    return [3 * total[_block(total.shape[0], r, world)] for r in range(world)]


def _reference(op: str, rank: int, world: int, rows: int, seed: int):
    """(this rank's output, and its a's and b's gradients of the sum over ranks of
    ``(output * weights_r).sum()``), in float64."""
    pairs = [(a.double().requires_grad_(), b.double().requires_grad_())
             for a, b in _inputs(op, world, rows, seed)]
    outs = _outputs(op, pairs, world)
    sum((o * _loss_weights(o, seed, r)).sum() for r, o in enumerate(outs)).backward()
    return [outs[rank].detach(), pairs[rank][0].grad, pairs[rank][1].grad]


def _loss_weights(out: torch.Tensor, seed: int, rank: int) -> torch.Tensor:
    return _shard(seed + 2, rank, *out.shape).to(out.dtype)


def compile_in_turn(rank, world, cache_dir, op, rows, seed, grad):
    """Each rank compiles ``op(1.5 * a, b) * 2`` in its turn, with ``cache_dir`` as
    torch.compile's cache, while the others run it eagerly. Returns (error or None, the largest
    difference from float64 of the output and, with ``grad``, of the operands' gradients)."""
    import torch.distributed as dist
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    import ficco

    def fn(a, b):   # pointwise work around the op, as in a model: inductor compiles it
        return getattr(ficco, op)(a * 1.5, b) * 2

    a, b = (x.requires_grad_(grad) for x in _inputs(op, world, rows, seed)[rank])

    def step(f, compiled=False):
        """Forward and, with grad, backward; (error or None, results). The ranks agree on
        going on after the forward: a rank whose compiled forward failed after its op ran
        (as a wrongly cached graph does, at its size checks) skips the backward, and so
        must its peers, whose backward collectives would wait for it."""
        a.grad = b.grad = None
        error, out = None, None
        try:
            out = f(a, b)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails
            error = f"rank {rank}: {type(exc).__name__}: {str(exc)[:400]}"
        flag = torch.tensor([error is None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            return error or "a peer's compiled forward failed", None
        if grad:
            (out * _loss_weights(out, seed, rank)).sum().backward()
        return None, [out.detach(), *((a.grad, b.grad) if grad else ())]

    result = (None, 0.0)
    for turn in range(world):
        if turn != rank:
            step(fn)     # its peer's compiled step, then its eager one
            step(fn)
            dist.barrier()
            continue
        torch._dynamo.reset()
        with temporary_cache_dir(cache_dir):
            error, got = step(torch.compile(fn, fullgraph=True))
        if error is None:
            refs = _reference(op, rank, world, rows, seed)
            result = (None, max(float((g.double() - r).abs().max()) for g, r in zip(got, refs)))
        else:
            result = (error, 0.0)
        step(fn)
        dist.barrier()
    return result


def _check(results):
    for error, diff in results:
        assert error is None, error
        assert diff < 1e-4, diff


def test_uneven_reduce_scatter_rows_are_each_ranks_own_under_a_shared_cache(tmp_path):
    """5 rows over 2 ranks (3 and 2): rank 1 compiles after rank 0 into the same cache."""
    _check(harness.pool(2, COMPILE_ENV).run(
        compile_in_turn, str(tmp_path), "matmul_reduce_scatter", 5, random.randrange(1 << 20),
        False, timeout_s=900))


def test_all_gather_rows_follow_the_world_size_under_a_shared_cache(tmp_path):
    """A W=3 job compiles the same code after a W=2 job on one machine, into the same cache
    (the default group's name is "0" in both): 3 shards gathered, not 2."""
    seed = random.randrange(1 << 20)
    for world in (2, 3):
        _check(harness.pool(world, COMPILE_ENV).run(
            compile_in_turn, str(tmp_path), "all_gather_matmul", 2, seed, True, timeout_s=900))


def test_fake_kernels_read_sizes_only_from_their_arguments():
    """Under fake tensors, on a group this process does not have, the four ops' outputs take
    their sizes from world and out_rows; a traced call without them is refused, naming them."""
    import pytest
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import ficco.ops.expert.torch_op  # noqa: F401 - registers the expert ops
    from ficco.errors import InvalidArgumentError

    ops = torch.ops.ficco
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        a, w = mode.from_tensor(torch.randn(5, K)), mode.from_tensor(torch.randn(K, N))
        _, (out,) = ops.all_gather_matmul(a, [w], "elsewhere", 0, None, False, world=3)
        assert tuple(out.shape) == (15, N)
        (out,) = ops.matmul_reduce_scatter(a, [w], "elsewhere", 0, "sum", None, world=2,
                                           out_rows=2)
        assert tuple(out.shape) == (2, N)
        counts = mode.from_tensor(torch.tensor([1, 0, 2, 0, 1, 1]))   # 3 ranks x 2 experts
        ws = [mode.from_tensor(torch.randn(K, N)) for _ in range(2)]
        _, recv_counts, _, routing = ops.all_to_all_grouped_mm(a, counts, ws, "elsewhere",
                                                               None, None, False, world=3)
        assert (tuple(recv_counts.shape), tuple(routing.shape)) == ((2, 3), (3, 6))
        _, routing, row = ops.grouped_mm_all_to_all(a, recv_counts, ws, "elsewhere", None,
                                                    None, None, world=3)
        assert (tuple(routing.shape), tuple(row.shape)) == ((3, 6), (6,))
        for call, missing in (
                (lambda: ops.all_gather_matmul(a, [w], "elsewhere", 0, None, False), "world"),
                (lambda: ops.matmul_reduce_scatter(a, [w], "elsewhere", 0, "sum", None,
                                                   world=2), "out_rows"),
                (lambda: ops.all_to_all_grouped_mm(a, counts, ws, "elsewhere", None, None,
                                                   False), "world")):
            with pytest.raises(InvalidArgumentError, match=f"traced without {missing}|"
                                                           f"without its {missing} argument"):
                call()


def old_and_wrong_calls(rank, world, seed):
    """(the old positional calls' results equal the new ones', the errors of a wrong world and
    of wrong out_rows)."""
    from ficco.errors import InvalidArgumentError
    from ficco.group import name_rank_world
    from ficco.ops import library

    name, _, _ = name_rank_world(None)
    a, b = _inputs("matmul_reduce_scatter", world, 5, seed)[rank]
    ops = torch.ops.ficco
    same = [torch.equal(ops.all_gather_matmul(a, [b], name, 0, None, False)[1][0],
                        ops.all_gather_matmul(a, [b], name, 0, None, False, world=world)[1][0]),
            torch.equal(ops.matmul_reduce_scatter(a, [b], name, 0, "sum", None)[0],
                        ops.matmul_reduce_scatter(
                            a, [b], name, 0, "sum", None, world=world,
                            out_rows=library.scattered_rows(5, rank, world))[0])]
    errors = []
    for call in (lambda: ops.all_gather_matmul(a, [b], name, 0, None, False, world=world + 1),
                 lambda: ops.matmul_reduce_scatter(a, [b], name, 0, "sum", None, world=world,
                                                   out_rows=5)):
        try:
            call()
            errors.append(None)
        except InvalidArgumentError as exc:
            errors.append(str(exc))
    return same, errors


def test_old_positional_calls_run_eagerly_and_wrong_sizes_are_refused():
    """Calls written before world/out_rows existed run eagerly as before; a world or out_rows
    that is not the group's is refused on every rank before any communication."""
    for same, (world_error, rows_error) in harness.pool(2).run(old_and_wrong_calls,
                                                                random.randrange(1 << 20)):
        assert same == [True, True]
        assert world_error and "world=3 but group" in world_error and "has 2 ranks" in world_error
        assert rows_error and "out_rows=5" in rows_error and "gets" in rows_error


def graphs_carry_sizes(rank, world, seed):
    """For each form of group (None, a ProcessGroup, a group name, a 1-D DeviceMesh): the code
    of the graph torch.compile(fullgraph=True) captures of both ops (uneven rows for the
    reduce-scatter), and the largest difference of the compiled results from eager."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ficco

    sub = dist.new_group(list(range(world)))
    groups = {"None": None, "ProcessGroup": sub, "name": sub.group_name,
              "DeviceMesh": init_device_mesh("cpu", (world,))}
    a, b = _inputs("matmul_reduce_scatter", world, 2 * world + 1, seed)[rank]
    found, diff = {}, 0.0
    for form, group in groups.items():
        def fn(a, b, group=group):
            return (ficco.all_gather_matmul(a * 1, b, group),
                    ficco.matmul_reduce_scatter(a * 1, b, group))
        codes = []

        def record(gm, _inputs):
            codes.append(gm.code)
            return gm
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend=record)(a, b)
        diff = max([diff, *(float((x - y).abs().max()) for x, y in zip(compiled, fn(a, b)))])
        found[form] = codes
    return found, diff


def test_graphs_carry_the_world_and_this_ranks_rows_for_every_form_of_group():
    """The sizes are constants of the captured graph (so of every cache key), with no graph
    break, whether the group is None, a ProcessGroup, a name or a 1-D DeviceMesh: rank 0's
    graph scatters 3 of 5 rows to itself, rank 1's 2."""
    for rank, (found, diff) in enumerate(harness.pool(2).run(graphs_carry_sizes,
                                                             random.randrange(1 << 20))):
        assert diff < 1e-5, diff
        for form, codes in found.items():
            assert len(codes) == 1, (form, codes)
            assert codes[0].count("world = 2") == 2, (form, codes[0])
            assert f"out_rows = {3 - rank}" in codes[0], (form, rank, codes[0])
