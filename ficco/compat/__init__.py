"""Drop-in twins of ``torch.ops.symm_mem.fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter``, and of their fp8 forms ``fused_all_gather_scaled_matmul`` and ``fused_scaled_matmul_reduce_scatter``
(``ficco/compat/scaled.py``).

Same signature, return values, shapes and strides, so swapping one line is enough::

    A, (C,) = torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], 0, group_name)
    A, (C,) = ficco.compat.fused_all_gather_matmul(A_shard, [B], 0, group_name)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import api
from ..errors import FiccoWarning, InvalidArgumentError
from ..group import rank_world, resolve
from ..ops.all_gather_matmul.spec import all_gather_flat
from ..ops.matmul_reduce_scatter.spec import SPEC as REDUCE_SCATTER_SPEC
from ..plan.problem import REDUCE_OPS
from ..runtime import agreement
from ..runtime import path as runtime
from ..runtime.call import backend_for, check_tensor, check_weights, normalize_dim
from .scaled import fused_all_gather_scaled_matmul, fused_scaled_matmul_reduce_scatter


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int,
                            group_name: str, *, return_A: bool = True):
    """``(all_gather(A_shard, gather_dim) if return_A else None, [A @ B for B in Bs])``.

    ``gather_dim`` may be the last dimension, as in torch's op: then the shards are
    concatenated along K, which no overlapped schedule can split, and ficco runs the plain
    all-gather + matmul.
    """
    if not isinstance(Bs, (list, tuple)) or not Bs:
        raise InvalidArgumentError("Bs must be a non-empty list of (K, n) tensors")
    check_tensor(A_shard, "A_shard")
    nd = A_shard.dim()
    if normalize_dim(gather_dim, nd, "gather_dim") == nd - 1:
        return _gather_last_dim(A_shard, list(Bs), group_name, return_A)
    if return_A:
        A, outs = api.all_gather_matmul(A_shard, list(Bs), group_name, gather_dim=gather_dim,
                                        return_gathered=True)
        return A, outs
    return None, api.all_gather_matmul(A_shard, list(Bs), group_name, gather_dim=gather_dim)


def _gather_last_dim(A_shard, Bs, group_name, return_A):
    """Shards concatenated along K: validated and agreed like every other path (bounded by
    FICCO_TIMEOUT), then the plain all-gather + matmul."""
    check_tensor(A_shard, "A_shard")
    group = resolve(group_name)
    rank, world = rank_world(group)
    k = world * A_shard.shape[-1]
    check_weights(Bs, A_shard, "A_shard", k=k, list_name="Bs",
                  k_from=f"gathering A_shard along its last dim over {world} ranks gives K={k}")
    backend_for(A_shard, "A_shard")
    signature = {"op": "fused_all_gather_matmul(gather_dim=last)",
                 "shard_shape": tuple(A_shard.shape), "dtype": str(A_shard.dtype),
                 "ns": [int(B.shape[1]) for B in Bs], "return_A": bool(return_A)}
    agreement.confirm_same_call(group, rank, world, signature, "fused_all_gather_matmul")
    flat = torch.empty((world * A_shard.shape[0], *A_shard.shape[1:]), dtype=A_shard.dtype,
                       device=A_shard.device)
    if world > 1:
        all_gather_flat(flat, A_shard.contiguous(), group)
    else:
        flat.copy_(A_shard)
    A = torch.cat(flat.view(world, *A_shard.shape).unbind(0), dim=-1)
    outs = [torch.matmul(A, B) for B in Bs]
    return (A if return_A else None), outs


def fused_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str,
                                scatter_dim: int, group_name: str) -> torch.Tensor:
    """Drop-in twin of ``torch.ops.symm_mem.fused_matmul_reduce_scatter``: the same signature,
    values, shape and (contiguous) strides as ``reduce_scatter_single(A @ B, reduce_op,
    scatter_dim, group_name)``. As torch, it needs the world size to divide ``scatter_dim``.

    ``scatter_dim`` may be the last dimension (the output columns), as in torch's op: no
    overlapped schedule splits those, so ficco runs the plain matmul + reduce-scatter.
    """
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
        raise InvalidArgumentError("A and B must be tensors")
    if reduce_op not in REDUCE_OPS:
        raise InvalidArgumentError(f"reduce_op={reduce_op!r} is not supported; use one of "
                                   f"{', '.join(REDUCE_OPS)}")
    nd = A.dim()
    if nd < 2:
        raise InvalidArgumentError(f"A must have at least 2 dims; got {tuple(A.shape)}")
    scatter_dim = normalize_dim(scatter_dim, nd, "scatter_dim")
    group = resolve(group_name)
    _, world = rank_world(group)
    size = A.shape[scatter_dim] if scatter_dim < nd - 1 else (B.shape[-1] if B.dim() else 0)
    if size % world:
        raise InvalidArgumentError(
            f"fused_matmul_reduce_scatter needs the world size ({world}) to divide dim "
            f"{scatter_dim} of A @ B ({size}), as torch's op does; ficco.matmul_reduce_scatter "
            f"takes uneven sizes")
    if scatter_dim == nd - 1:
        full = (A @ B).movedim(-1, 0).contiguous()
        mine = full.new_empty((size // world, *full.shape[1:]))
        if world > 1:
            dist.reduce_scatter_tensor(mine, full, op=dist.ReduceOp.SUM, group=group)
            if reduce_op == "avg":
                mine.div_(world)
        else:
            mine.copy_(full)
        return _row_major(mine.movedim(0, -1))
    out = runtime.run(REDUCE_SCATTER_SPEC.prepare(A, B, group_name, scatter_dim, reduce_op))
    return _row_major(out)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with torch's default strides, size-1 dims included (``contiguous()`` keeps any
    stride there; torch's op returns the canonical ones)."""
    want = torch.empty(t.shape, device="meta").stride()
    return t if t.stride() == want else torch.empty_like(
        t, memory_format=torch.contiguous_format).copy_(t)


# -- torch's async TP on ficco ----------------------------------------------------------------------
class SymmMemOverride:
    """ficco's kernels registered as the CPU and CUDA (ROCm too: torch's HIP builds dispatch
    through the CUDA key) implementations of ``torch.ops.symm_mem.fused_all_gather_matmul``,
    ``fused_matmul_reduce_scatter`` and their fp8 forms ``fused_all_gather_scaled_matmul``,
    ``fused_scaled_matmul_reduce_scatter``; :meth:`remove` gives torch's kernels back."""

    def __init__(self, device_types):
        import warnings

        self.device_types = tuple(device_types)
        self._lib = torch.library.Library("symm_mem", "IMPL")
        twins = {"fused_all_gather_matmul": _symm_all_gather_matmul,
                 "fused_matmul_reduce_scatter": fused_matmul_reduce_scatter,
                 "fused_all_gather_scaled_matmul": fused_all_gather_scaled_matmul,
                 "fused_scaled_matmul_reduce_scatter": fused_scaled_matmul_reduce_scatter}
        #: calls of each op that ran ficco since the override was installed
        self.calls = dict.fromkeys(twins, 0)
        with warnings.catch_warnings():
            # torch warns once that a CUDA kernel is overridden: that is the point here
            warnings.filterwarnings("ignore", message=".*[Oo]verrid")
            for name, kernel in twins.items():
                for device_type in self.device_types:
                    # allow_override: torch 2.11 refuses to replace its CUDA kernels without it
                    self._lib.impl(name, self._counted(name, kernel), _dispatch_key(device_type),
                                   allow_override=True)
        self.ops = tuple(twins)
        # After the first optimizer step, say so if torch's pass sent nothing here.
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._step_hook = register_optimizer_step_post_hook(self._after_first_step)

    def _counted(self, name, kernel):
        def kernel_counted(*args, **kwargs):
            self.calls[name] += 1
            return kernel(*args, **kwargs)
        return kernel_counted

    def _after_first_step(self, *_) -> None:
        self._drop_step_hook()
        if not any(self.calls.values()):
            import warnings

            warnings.warn(NOTHING_FUSED, FiccoWarning, stacklevel=2)

    def _drop_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def remove(self) -> None:
        """Give torch's kernels back (what ran before :func:`install_symm_mem_override`)."""
        global _override
        self._drop_step_hook()
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
        if _override is self:
            _override = None

    def __enter__(self) -> SymmMemOverride:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


_override: SymmMemOverride | None = None

#: The warning after a training step in which no GEMM reached ficco through the override.
NOTHING_FUSED = (
    "ficco.compat.install_symm_mem_override(): a training step ran and no GEMM reached ficco "
    "(0 calls of torch.ops.symm_mem.fused_*): torch's async-TP pass fused nothing. It fuses only "
    "in graphs torch.compile compiles with torch._inductor.config._micro_pipeline_tp = True, "
    "when torch.distributed.is_nccl_available() (CUDA and ROCm builds; never a CPU build) and "
    "symmetric memory is enabled for the group (torch.distributed._symmetric_memory."
    "enable_symm_mem_for_group; torchtitan's enable_async_tensor_parallel does both), and "
    "inductor's FX graph cache may serve a graph compiled before those held "
    "(torch._inductor.config.fx_graph_cache = False, or a new TORCHINDUCTOR_CACHE_DIR). See "
    "docs/training.md, 'torch's async TP on ficco'.")


def install_symm_mem_override(device_types=None) -> SymmMemOverride:
    """Run ficco behind torch's own async tensor parallelism.

    torch's compiler pass for async TP (``torch._inductor.config._micro_pipeline_tp = True``,
    torchtitan's ``enable_async_tensor_parallel``) rewrites ``all_gather -> matmul`` and
    ``matmul -> reduce_scatter`` in a compiled graph into ``torch.ops.symm_mem.
    fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` (``_scaled_mm`` ones into their
    scaled forms). After this call those four ops run this module's twins (ficco's schedules,
    chosen per call) instead of torch's pipelines. Their fake kernels stay torch's, so compiled
    graphs keep the shapes and strides torch promised. Idempotent; returns a handle whose
    ``remove()`` (or ``with``) undoes it and whose ``calls`` count what ran ficco. When the
    first optimizer step after it ran no GEMM through ficco, it warns once
    (:class:`ficco.errors.FiccoWarning`, naming the pass's conditions). ``device_types``:
    where the twins run (default: every device type of ficco's backends, cpu and cuda).

    >>> import ficco
    >>> with ficco.compat.install_symm_mem_override() as override:   # doctest: +SKIP
    ...     torch._inductor.config._micro_pipeline_tp = True
    ...     loss = torch.compile(model)(batch)
    """
    global _override
    if _override is None:
        import torch.distributed._symmetric_memory  # noqa: F401 - defines the symm_mem ops

        _override = SymmMemOverride(device_types or _device_types())
    return _override


def _device_types() -> tuple[str, ...]:
    """The device type of every backend package (cpu, cuda: ROCm's too)."""
    from ..backends import backend_class, names

    return tuple(dict.fromkeys(backend_class(n).device_type for n in names()))


def _symm_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True):
    return fused_all_gather_matmul(A_shard, list(Bs), gather_dim, group_name, return_A=return_A)


def _dispatch_key(device_type: str) -> str:
    types = _device_types()    # torch's dispatch key of a device type is its name, upper case
    if device_type not in types:
        raise InvalidArgumentError(f"device_types holds {device_type!r}; ficco overrides torch's "
                                   f"symm_mem ops for its backends' device types: "
                                   f"{', '.join(types)}")
    return device_type.upper()
