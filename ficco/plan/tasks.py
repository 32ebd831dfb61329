"""The host tasks a compiled plan launches on its queues (``Backend.launch``): the reduction of
partial products and the process-group collectives of ``ccl`` plans (all-gather, all-to-all,
reduce-scatter, all-reduce, send/recv). On GPUs they enqueue torch
kernels and NCCL/RCCL calls on the queue's stream (it is current while they run).

Each ``*_task(views, buffers, args)`` takes the call's views by slot number, the call's
:class:`~ficco.plan.buffers.Buffers` (the collectives read its ``group``) and the slot arguments the
compiler stored in the step, and returns the function to launch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .epilogue import gemm_into


def _reduce(dst, srcs, accumulate, scale):
    """``dst = ((dst if accumulate else 0) + sum(srcs)) * scale``, summed in float32 (float64
    for float64) and rounded once into ``dst``. Never writes a source."""
    wide = torch.float64 if dst.dtype == torch.float64 else torch.float32
    parts = ([dst] if accumulate else []) + list(srcs)
    total = parts[0].to(wide, copy=True)
    for part in parts[1:]:
        total.add_(part)
    if scale is not None:
        total.mul_(scale)
    dst.copy_(total)


def _bytes(t):
    """fp8 moves as the bytes it is: process groups (gloo, some NCCL builds) have no fp8 type
    and nothing here adds fp8 values. Other dtypes (and None) unchanged."""
    if t is not None and t.element_size() == 1 and t.is_floating_point():
        return t.view(torch.uint8)
    return t


def _like(views, like):
    """A tensor of the pieces' dtype and device for empty pieces: the first piece, else
    ``like`` (an empty view of the input)."""
    return next((v for v in views if v is not None), like)


def _flat(views, like):
    return [v.reshape(-1) if v is not None else like.new_empty(0) for v in views]


def _all_to_all(srcs, dsts, group, like):
    """``srcs[q]`` to rank q, ``dsts[p]`` from rank p; pieces of any size (None: nothing), in
    one all_to_all_single over packed buffers (gloo's list form needs equal sizes)."""
    srcs, dsts = [_bytes(s) for s in srcs], [_bytes(d) for d in dsts]
    like = _bytes(_like([*srcs, *dsts], like))
    sends = _flat(srcs, like)
    inp = torch.cat([s.contiguous() for s in sends]) if sends else like.new_empty(0)
    out_sizes = [0 if d is None else d.numel() for d in dsts]
    out = like.new_empty(sum(out_sizes))
    dist.all_to_all_single(out, inp, out_sizes, [s.numel() for s in sends], group=group)
    for d, piece in zip(dsts, out.split(out_sizes)):
        if d is not None:
            d.copy_(piece.view(d.shape))


def _reduce_scatter(srcs, dst, scale, group, like):
    """Rank q's ``dst`` <- sum over ranks of ``srcs[q]`` (None: an empty block)."""
    like = _like([*srcs, dst], like)
    inputs = [s.contiguous() for s in _flat(srcs, like)]
    out = like.new_empty(0 if dst is None else dst.numel())
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM, group=group)
    if dst is not None:
        if scale is not None:
            out.mul_(scale)
        dst.copy_(out.view(dst.shape))


def _all_reduce(src, dst, scale, group):
    """``dst`` <- the sum over ranks of ``src`` (then ``*= scale``): the process group's
    all-reduce, in ``src``'s dtype (fp8 never reaches here: its partials are float32), in
    place in ``dst`` when it can be."""
    in_place = dst.dtype == src.dtype and dst.is_contiguous()
    total = dst if in_place else torch.empty(src.shape, dtype=src.dtype, device=src.device)
    total.copy_(src)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if scale is not None:
        total.mul_(scale)
    if not in_place:
        dst.copy_(total)


def _global(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


def _all_gather(src, dsts, group):
    src, dsts = _bytes(src), [_bytes(d) for d in dsts]
    packed = src.contiguous()
    outs = [d if d.is_contiguous() else torch.empty_like(packed) for d in dsts]
    dist.all_gather(outs, packed, group=group)
    for d, o in zip(dsts, outs):
        if o is not d:
            d.copy_(o)


def _send_recv(send, send_to, recv, recv_from, group):
    # gloo's point-to-point takes host tensors only (its all-gather accepts device ones).
    via_host = dist.get_backend(group) == "gloo"
    send, recv = _bytes(send), _bytes(recv)
    ops, landing = [], None
    if send is not None:
        payload = send.contiguous().cpu() if via_host else send.contiguous()
        ops.append(dist.P2POp(dist.isend, payload, _global(group, send_to), group))
    if recv is not None:
        on_host = via_host and recv.device.type != "cpu"
        landing = recv if recv.is_contiguous() and not on_host else torch.empty(
            recv.shape, dtype=recv.dtype, device="cpu" if on_host else recv.device)
        ops.append(dist.P2POp(dist.irecv, landing, _global(group, recv_from), group))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    if landing is not None and landing is not recv:
        recv.copy_(landing)


# Each takes (views, buffers, slot arguments) and returns the host function to launch.
def reduce_task(v, buffers, args):
    dst, srcs, accumulate, scale = v[args[0]], [v[s] for s in args[1]], args[2], args[3]
    return local(lambda: _reduce(dst, srcs, accumulate, scale))


#: ``task.ficco_kind`` of a host task that is this rank's own work (a reduction): a backend
#: that bounds its queues by FICCO_TIMEOUT (the CPU's) never times it out. Unmarked host tasks
#: are collectives, which may wait on a peer.
LOCAL = "local"


def local(fn):
    fn.ficco_kind = LOCAL
    return fn


def _pick(v, slots):
    return [None if s is None else v[s] for s in slots]


def all_to_all_task(v, buffers, args):
    srcs, dsts, like = _pick(v, args[0]), _pick(v, args[1]), v[args[2]]
    return lambda: _all_to_all(srcs, dsts, buffers.group, like)


def reduce_scatter_task(v, buffers, args):
    srcs, dst, scale, like = _pick(v, args[0]), _pick(v, (args[1],))[0], args[2], v[args[3]]
    return lambda: _reduce_scatter(srcs, dst, scale, buffers.group, like)


def all_reduce_task(v, buffers, args):
    src, dst, scale = v[args[0]], v[args[1]], args[2]
    return lambda: _all_reduce(src, dst, scale, buffers.group)


def all_gather_task(v, buffers, args):
    src, dsts = v[args[0]], [v[d] for d in args[1]]
    return lambda: _all_gather(src, dsts, buffers.group)


def gemm_task(v, buffers, args):
    """A GEMM with fp8 scales, a bias or an activation (:func:`ficco.plan.epilogue.gemm_into`): slots
    of a, b, out, a's scale, b's scale and the bias (None: none), then accumulate and the
    activation."""
    a, b, out, a_scale, b_scale, bias = _pick(v, args[:6])
    accumulate, activation = args[6], args[7]
    return lambda: gemm_into(a, b, out, accumulate, a_scale, b_scale, bias, activation)


def send_recv_task(v, buffers, args):
    send_slot, send_to, recv_slot, recv_from = args
    send = v[send_slot] if send_slot is not None else None
    recv = v[recv_slot] if recv_slot is not None else None
    return lambda: _send_recv(send, send_to, recv, recv_from, buffers.group)
