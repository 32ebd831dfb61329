"""Ficco behind torch's own async tensor parallelism:
``ficco.compat.install_symm_mem_override()`` makes ``torch.ops.symm_mem.fused_all_gather_matmul``
and ``fused_matmul_reduce_scatter`` (and their fp8 forms) run ficco, so the graphs torch's
compiler pass
(``torch._inductor.config._micro_pipeline_tp``, torchtitan's async TP) rewrites run ficco's
schedules.

On CPU the pass needs two checks lifted, both torch's and unrelated to what it rewrites: it
returns early unless torch was built with NCCL (``torch.distributed.is_nccl_available()`` in
``torch/_inductor/fx_passes/micro_pipeline_tp.py``; CUDA builds have NCCL, ROCm builds RCCL
under that name) and unless symmetric memory is enabled for the group (torch's own
``_symmetric_memory._test_mode()`` says it is).
"""
from __future__ import annotations

import contextlib
import random

import torch

from .. import harness
from .test_parallel import COMPILE_ENV, F32_TOL, _batch, _loss, _models, _rel


def _runs(fn):
    """``fn()``'s result and {name: count} of the symm_mem ops and ficco calls it ran."""
    from torch.profiler import profile

    with profile() as prof:
        result = fn()
    counts = {}
    for event in prof.events():
        name = event.name.split(" ")[0]
        if name.startswith(("symm_mem::fused", "ficco.all_gather", "ficco.matmul_reduce")):
            counts[name] = counts.get(name, 0) + 1
    return result, counts


def _ops_directly(rank, world, seed):
    """torch's symm_mem ops before, with and after the override, against torch's fallbacks."""
    import torch.distributed as dist
    from torch.distributed._symmetric_memory import (
        _fused_all_gather_matmul_fallback,
        _fused_matmul_reduce_scatter_fallback,
    )

    import ficco

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)
    a_shard, a = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4 * world, 8, generator=gen)
    bs = [torch.randn(8, n, generator=gen) for n in (6, 5)]
    ag = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, bs, 1, name)
    rs = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, bs[0], "sum", 1,
                                                                 name)
    outcome = {}

    def refused(call):
        try:
            call()
        except NotImplementedError:
            return True
        return False
    # the fp8 forms (ficco/compat/scaled.py holds its twins to torch's fallbacks)
    fp8 = torch.float8_e4m3fn
    a8, a8_full = a_shard.div(4).to(fp8), a.div(4).to(fp8)
    b8 = torch.randn(16, 8, generator=gen).div(4).to(fp8).T             # column-major (8, 16)
    scale = torch.tensor(0.5)
    ag8_args = (a8, [b8], scale, [scale], 1, name, [None], [None], [torch.bfloat16], [False])
    rs8_args = (a8_full, b8, scale, scale, "sum", 1, 1, name, [*a.shape[:-1], 16])
    ag8 = lambda: torch.ops.symm_mem.fused_all_gather_scaled_matmul(*ag8_args)
    rs8 = lambda: torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
        *rs8_args, out_dtype=torch.bfloat16)
    outcome["torch's ops run on CPU before"] = not refused(ag)
    with ficco.compat.install_symm_mem_override() as override:
        assert ficco.compat.install_symm_mem_override() is override      # idempotent
        (got_a, got), ag_runs = _runs(ag)
        got_rs, rs_runs = _runs(rs)
        (_, got8), ag8_runs = _runs(ag8)
        got_rs8, rs8_runs = _runs(rs8)
    outcome["torch's ops run on CPU after remove()"] = not refused(ag)
    _, want8 = ficco.compat.fused_all_gather_scaled_matmul(*ag8_args)
    want_rs8 = ficco.compat.fused_scaled_matmul_reduce_scatter(*rs8_args,
                                                               out_dtype=torch.bfloat16)
    outcome["fp8"] = [torch.equal(got8[0], want8[0]), torch.equal(got_rs8, want_rs8)]
    outcome["fp8 runs"] = {**ag8_runs, **rs8_runs}
    want_a, want = _fused_all_gather_matmul_fallback(a_shard, bs, 1, name)
    want_rs = _fused_matmul_reduce_scatter_fallback(a, bs[0], "sum", 1, name)
    pairs = [(got_a, want_a), *zip(got, want), (got_rs, want_rs)]
    outcome["layouts"] = [(tuple(g.shape), g.stride()) == (tuple(w.shape), w.stride())
                          for g, w in pairs]
    outcome["errors"] = [_rel(g, w) for g, w in pairs]
    outcome["runs"] = {**ag_runs, **rs_runs}
    return outcome


def test_override_makes_torchs_symm_mem_ops_run_ficco():
    for outcome in harness.pool(2).run(_ops_directly, random.randrange(1 << 30)):
        assert not outcome["torch's ops run on CPU before"]         # torch: CUDA kernels only
        assert not outcome["torch's ops run on CPU after remove()"]
        assert all(outcome["layouts"]), outcome
        assert max(outcome["errors"]) <= 1e-5, outcome
        assert outcome["runs"] == {
            "symm_mem::fused_all_gather_matmul": 1, "ficco.all_gather_matmul": 1,
            "symm_mem::fused_matmul_reduce_scatter": 1, "ficco.matmul_reduce_scatter": 1}, \
            outcome
        assert all(outcome["fp8"]), outcome
        assert outcome["fp8 runs"] == {
            "symm_mem::fused_all_gather_scaled_matmul": 1, "ficco.all_gather_matmul": 1,
            "symm_mem::fused_scaled_matmul_reduce_scatter": 1, "ficco.matmul_reduce_scatter": 1
        }, outcome


@contextlib.contextmanager
def _async_tp_on_cpu():
    """torch's async-TP pass on, with its NCCL and symmetric-memory checks lifted (see the
    module docstring), and ficco's override installed."""
    from unittest import mock

    from torch._inductor import config
    from torch.distributed._symmetric_memory import _test_mode

    import ficco

    with ficco.compat.install_symm_mem_override(), _test_mode(), \
            mock.patch.object(torch.distributed, "is_nccl_available", lambda: True), \
            config.patch(_micro_pipeline_tp=True):
        yield


def _compiled_by_torchs_pass(rank, world, seed):
    """(1) all_gather -> two matmuls and matmul -> reduce_scatter written with torch's
    functional collectives; (2) torch's test Transformer under torch's own styles and plan:
    both compiled with the async-TP pass. Errors against eager, and what ran."""

    group = torch.distributed.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)
    x, w1, w2 = (torch.randn(4, 3, 8, generator=gen), torch.randn(8, 6, generator=gen),
                 torch.randn(8, 5, generator=gen))

    def block(x, w1, w2):
        gathered = _all_gather(x, 1, group)
        y, z = gathered @ w1, gathered @ w2
        return y, z, _reduce_scatter(torch.relu(y) @ w1.T, "sum", 0, group)
    torch._dynamo.reset()
    with _async_tp_on_cpu():
        compiled = torch.compile(block, fullgraph=True)
        compiled(x, w1, w2)
        outs, block_runs = _runs(lambda: compiled(x, w1, w2))
    block_errors = [_rel(o, r) for o, r in zip(outs, block(x, w1, w2))]

    model, reference, _ = _models(world, seed, "torch", n_layers=1)
    tokens, target = _batch(seed)
    torch._dynamo.reset()
    with _async_tp_on_cpu():
        compiled = torch.compile(model, fullgraph=True)
        _loss(compiled, tokens, target, None).backward()
        model.zero_grad()
        loss, model_runs = _runs(lambda: _train_step(compiled, tokens, target))
    ref_loss = _loss(reference, tokens, target, None)
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    grad_error = max(_rel(p.grad.full_tensor(), ref_grads[n].grad)
                     for n, p in model.named_parameters())
    return block_errors, block_runs, abs(loss - ref_loss.item()) / ref_loss.item(), \
        grad_error, model_runs


def _all_gather(x, dim, group):
    from torch.distributed import _functional_collectives as funcol

    if hasattr(funcol, "all_gather_single"):
        return funcol.all_gather_single(x, dim, group)
    # torch 2.11: its dynamo will not trace all_gather_tensor's own chunk-cat for dim != 0
    # (_maybe_view_chunk_cat is marked skipped), so the cat is written out here, as torch's
    # pass expects it (all_gather_into_tensor -> wait -> split -> cat)
    gathered = funcol.all_gather_tensor(x, 0, group)
    world = torch.distributed.get_world_size()
    return torch.cat(torch.chunk(gathered, world, dim=0), dim=dim) if dim else gathered


def _reduce_scatter(x, op, dim, group):
    from torch.distributed import _functional_collectives as funcol

    if hasattr(funcol, "reduce_scatter_single"):
        return funcol.reduce_scatter_single(x, op, dim, group)
    return funcol.reduce_scatter_tensor(x, op, dim, group)   # torch 2.11


def _train_step(model, tokens, target):
    loss = _loss(model, tokens, target, None)
    loss.backward()
    return loss.item()


def test_torchs_async_tp_pass_runs_ficcos_schedules():
    """torchtitan's path: torch's styles and plan, compiled with _micro_pipeline_tp. The pass
    fuses one gather into Q/K/V's three GEMMs (one fused_all_gather_matmul with three B's)."""
    seed = random.randrange(1 << 30)
    results = harness.pool(2, COMPILE_ENV).run(_compiled_by_torchs_pass, seed, timeout_s=900)
    for block_errors, block_runs, loss_error, grad_error, model_runs in results:
        assert max(block_errors) <= 1e-5, block_errors
        assert block_runs == {
            "symm_mem::fused_all_gather_matmul": 1, "ficco.all_gather_matmul": 1,
            "symm_mem::fused_matmul_reduce_scatter": 1, "ficco.matmul_reduce_scatter": 1}, \
            block_runs
        assert loss_error <= F32_TOL["loss"] and grad_error <= F32_TOL["grad"], \
            (seed, loss_error, grad_error)
        gathers = model_runs.get("symm_mem::fused_all_gather_matmul", 0)
        scatters = model_runs.get("symm_mem::fused_matmul_reduce_scatter", 0)
        assert gathers >= 3 and scatters >= 2, model_runs       # forward: qkv, w1, head; wo, w2
        assert model_runs.get("ficco.all_gather_matmul") == gathers, model_runs
        assert model_runs.get("ficco.matmul_reduce_scatter") == scatters, model_runs


def _nothing_fused_warning(rank, world):
    """The override's warning after the first optimizer step: once when no GEMM ran ficco
    (here an eager gather + matmul: no pass ran), never when one did."""
    import warnings

    from torch.distributed import _functional_collectives as funcol

    import ficco
    from ficco.errors import FiccoWarning

    group = torch.distributed.group.WORLD.group_name
    w = torch.nn.Parameter(torch.randn(8, 3))
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(4, 8)

    def steps(n, fused):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(n):
                opt.zero_grad()
                if fused:
                    torch.ops.symm_mem.fused_all_gather_matmul(x, [w.detach()], 0, group)
                loss = (funcol.all_gather_tensor(x, 0, group) @ w).sum()
                loss.backward()
                opt.step()
        return [str(c.message) for c in caught if c.category is FiccoWarning]

    with ficco.compat.install_symm_mem_override():
        unfused = steps(3, fused=False)
    with ficco.compat.install_symm_mem_override() as override:
        fused = steps(2, fused=True)
        calls = dict(override.calls)
    after_remove = steps(1, fused=False)
    return unfused, fused, calls, after_remove


def test_override_warns_once_when_a_step_ran_no_gemm_through_ficco():
    for unfused, fused, calls, after_remove in harness.pool(2).run(_nothing_fused_warning):
        assert len(unfused) == 1, unfused
        assert "fused nothing" in unfused[0] and "is_nccl_available" in unfused[0], unfused
        assert "enable_symm_mem_for_group" in unfused[0] and "cache" in unfused[0], unfused
        assert fused == [], fused
        assert calls["fused_all_gather_matmul"] == 2, calls
        assert after_remove == [], after_remove
