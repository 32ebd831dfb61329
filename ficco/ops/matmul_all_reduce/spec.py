"""``all_reduce(a @ b)``: the op spec.

Canonical form: ``a`` with its leading dims flattened, ``M x K`` (every rank holds all M rows
and its own K columns: the row-parallel half of tensor parallelism without sequence
parallelism); each ``b_j`` is this rank's ``(K, n_j)`` shard of the weight. Every rank receives
all M rows of ``sum over ranks of a_q @ b_j``, the same values on every rank.

Most of it is the reduce-scatter's spec (:mod:`.matmul_reduce_scatter`: the checks, the
widest-K agreement, the fp8 epilogue, K = 0 on a rank): only the output (every row), the
buffers (``reduced``, the sums a rank made for its peers, symmetric with ``dma``) and the
plain path (one all-reduce) differ. ``bias`` is added once, to the sum, on every rank alike.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...plan.buffers import Buffers
from ...plan.epilogue import Operands, wide_dtype
from ...plan.problem import ALL_REDUCE
from ...symm_mem import aligned
from ..examples import Example
from ..matmul_reduce_scatter.spec import MatmulReduceScatter, MatmulReduceScatterCall
from ..matmul_reduce_scatter.spec import check_arguments as check_reduce_scatter
from ..matmul_reduce_scatter.spec import check_epilogue as check_reduce_scatter_epilogue
from .schedules import OPTIONAL, SCHEDULES

MATMUL_ALL_REDUCE = "matmul_all_reduce"


@dataclass(kw_only=True)
class MatmulAllReduceCall(MatmulReduceScatterCall):
    """A reduce-scatter call's fields, with ``scatter_dim`` 0 (the rows are all of ``a``'s
    leading dims: ``moved_shape`` is ``a.shape``)."""


def check_arguments(a, b, reduce_op) -> tuple[list, bool]:
    """The one check of the op's tensors and ``reduce_op``, for the eager path and the fake
    kernel alike: ``(the weights as a list, whether b was a list)``.

    >>> import torch
    >>> len(check_arguments(torch.randn(2, 3, 8), [torch.randn(8, 5)], "avg")[0])
    1
    """
    _, bs, b_is_list = check_reduce_scatter(a, b, 0, reduce_op)
    return bs, b_is_list


def check_epilogue(a, bs, b_is_list, **epilogue) -> Operands:
    """The one check of the fp8 scales, out_dtype and bias (a row-wise ``a_scale`` is shaped
    like ``a``'s rows with a last dim of 1)."""
    return check_reduce_scatter_epilogue(a, bs, b_is_list, 0, **epilogue)


class MatmulAllReduce(MatmulReduceScatter):
    name = MATMUL_ALL_REDUCE
    collective = ALL_REDUCE
    schedules = SCHEDULES
    optional_schedules = OPTIONAL
    call_class = MatmulAllReduceCall

    def explained(self, a, b, group, *, gather_dim, scatter_dim, reduce_op, counts, epilogue):
        return self.prepare(a, b, group, reduce_op, **epilogue)

    def prepare(self, a, b, group=None, reduce_op="sum", *, a_scale=None, b_scale=None,  # type: ignore[override]
                out_dtype=None, bias=None, activation=None) -> MatmulAllReduceCall:
        # (an activation is refused by the epilogue's check: the output is a sum over ranks)
        call = self._prepare(a, b, group, 0, reduce_op, a_scale=a_scale, b_scale=b_scale,
                             out_dtype=out_dtype, bias=bias, activation=activation)
        assert isinstance(call, MatmulAllReduceCall)
        return call

    def unit(self, moved_shape) -> int:
        return 1     # every row goes to every rank: no block needs whole units

    values_what = "bias"

    def values_word(self, call: MatmulReduceScatterCall) -> int:
        """The biases' digest: each rank adds the bias to its copy of the sum, so a bias that
        differs across ranks (a replicated parameter that drifted, or one initialised per
        rank) would break "the same bits on every rank"; checked with the call instead."""
        if not call.problem.bias:
            return 0
        word = 0
        for j, bias in enumerate(call.ops.biases):
            if bias is not None:
                word ^= values_digest(bias) * (j + 1)
        return word & 0x7FFFFFFFFFFFFFFF

    def signature(self, call: MatmulReduceScatterCall) -> dict:
        sig = super().signature(call)
        del sig["scatter_dim"]
        return sig

    # -- running ------------------------------------------------------------------------------
    def plain_collective(self, call: MatmulReduceScatterCall, full):
        """One all-reduce of the whole product, in the partials' dtype (FICCO_DISABLE, a call
        with nothing to overlap): the plain path is the reduce-scatter's with this collective."""
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=call.group)
        return full

    def offsets(self, call: MatmulReduceScatterCall) -> tuple[int, ...]:
        """Byte offsets of each ``partial`` buffer, then of each ``reduced`` buffer (sized for
        float32: a plan with wide outputs keeps its sums there in float32), then the total:
        once per call key."""
        offsets = call.reuse.offsets
        if offsets is None:
            p, out, at = call.problem, [], 0
            reduced_itemsize = max(p.out_itemsize, 4)
            for itemsize in (p.partial_itemsize, reduced_itemsize):
                for n in p.ns:
                    out.append(at)
                    at += aligned(p.m * n * itemsize)
            offsets = call.reuse.offsets = (*out, at)
        return offsets

    def buffers(self, call: MatmulReduceScatterCall, transport: str, symm, *,
                wide: bool = False, plan=None) -> Buffers:
        p, ops = call.problem, call.ops
        dev, count = call.a.device, len(p.ns)
        out_dtype = wide_dtype(ops.out_dtype) if wide else ops.out_dtype
        outs = [torch.empty(p.m, n, dtype=out_dtype, device=dev) for n in p.ns]
        # The landing rows are the plan's (a one-shot lands every peer's partial)
        recvs = [torch.empty(plan.rows_of("recv", j) if plan is not None else p.world * p.m, n,
                             dtype=call.partial_dtype, device=dev) for j, n in enumerate(p.ns)]
        offsets = self.offsets(call)[:-1]
        if symm is not None:
            partials = [symm.get_buffer(p.rank, (p.m, n), call.partial_dtype, off)
                        for n, off in zip(p.ns, offsets[:count])]
            reduced = [symm.get_buffer(p.rank, (p.m, n), out_dtype, off)
                       for n, off in zip(p.ns, offsets[count:])]
        else:
            partials = [torch.empty(p.m, n, dtype=call.partial_dtype, device=dev) for n in p.ns]
            reduced = [torch.empty(p.m, n, dtype=out_dtype, device=dev) for n in p.ns]
        return Buffers(call.a, call.bs, outs, None, symm, call.group, partials=partials,
                       recvs=recvs, partial_offsets=tuple(offsets[:count]), reduced=reduced,
                       reduced_offsets=tuple(offsets[count:]), a_scale=ops.a_scale,
                       b_scales=ops.b_scales, biases=ops.biases, wide=wide)

    def annotate(self, decision, problem):
        """The decision with the kernel its pick runs and the published time it is priced
        against (:func:`~ficco.heuristics.reductions.priced_against`)."""
        import dataclasses

        from ...heuristics.reductions import priced_against

        return dataclasses.replace(decision, priced=priced_against(problem, decision))

    def poison(self, buffers: Buffers) -> None:
        for t in (*buffers.outs, *buffers.recvs, *buffers.partials, *buffers.reduced):
            t.fill_(float("nan"))

    def reference(self, example: Example):
        """``sum over ranks of a_r @ b_r``, all of it (its inputs are the reduce-scatter's)."""
        out = sum(a @ b for a, b in example.inputs)
        scale = sum(a.abs() @ b.abs() for a, b in example.inputs)
        return out, scale

    def _finish(self, call: MatmulReduceScatterCall, outs):
        results = [canon[:, :n].reshape(*call.moved_shape[:-1], n)
                   for canon, n in zip(outs, call.ns)]
        return results if call.b_is_list else results[0]


SPEC = MatmulAllReduce()


#: id of a tensor (a view's base) -> (a weak reference, its version, data pointer, digest)
_DIGESTS: dict[int, tuple] = {}
_DIGESTS_KEPT = 256


def values_digest(t: torch.Tensor) -> int:
    """A 63-bit digest of ``t``'s bytes, made again only when ``t`` (or the tensor it views)
    was written since (its version counter) or is another tensor: a warm call with an
    unchanged bias costs a lookup, a changed one (an optimizer step) one device-to-host copy.

    >>> b = torch.ones(3); d = values_digest(b); b[0] = 2; d != values_digest(b)
    True
    """
    base = t._base if t._base is not None else t
    try:
        version = base._version
    except RuntimeError:      # an inference tensor keeps no version: digested every call
        version = None
    key = id(base)
    seen = _DIGESTS.get(key)
    if version is not None and seen is not None and seen[0]() is base and \
            seen[1] == version and seen[2] == (t.data_ptr(), t.shape, t.dtype):
        return seen[3]
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
    if version is not None:
        if len(_DIGESTS) >= _DIGESTS_KEPT:
            _DIGESTS.clear()
        _DIGESTS[key] = (weakref.ref(base), version, (t.data_ptr(), t.shape, t.dtype), digest)
    return digest
