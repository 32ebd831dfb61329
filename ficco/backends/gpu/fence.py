"""What an eager GPU call hands back when one of its barriers never completed by itself.

An eager GPU call returns as soon as its work is *enqueued*; its barriers complete later, on
the GPU. When a peer is dead, stuck or making another call, the barrier watchdog
(:mod:`ficco.backends.gpu.watchdog`) releases the stuck stream at the deadline (or at once
for a peer in another call) so the process can go on, and the error is raised at the rank's
next ficco call. The outputs of the released call cannot be recalled: they were returned
already, and the GEMMs after the released barrier computed them from data that never
arrived. So they are **poisoned** instead:

- every group keeps one *error word* per rank (:mod:`ficco.symm_mem.fault`), in host memory
  the GPU reads directly; a group's calls never see another group's word;
- the watchdog raises it with a host store **before** it releases any barrier;
- every dma call ends with a *fence* on the caller's stream, after all of its work: a tiny
  kernel that reads the word and, only when it is raised, fills the call's outputs with NaN.
  Any work the caller queues after the call sees NaN, never plausible numbers;
- the word is lowered, stream-ordered after the fences already queued, when the error is
  raised on the host.

Cost when nothing failed: one small Triton launch per output tensor (each program loads one
word and returns); without Triton (it ships with PyTorch's CUDA and ROCm wheels), or with one
outside the range whose code generation was checked, the fence is ``masked_fill_`` with a
device-side mask, one pass over the outputs; so it is on CPU tensors (the fake GPU's) when
Triton's interpreter cannot run the kernel (Triton older than 3.8). The CPU backend needs no
fence: its barriers run on host threads and a released barrier raises before the call
returns.
"""
from __future__ import annotations

import functools

import torch

#: whether this torch drives AMD GPUs (the fence's word load differs, ficco.kernels.words)
_AMD = bool(torch.version.hip)
#: programs of one fence launch at most (each loops over its share only when poisoning)
MAX_PROGRAMS = 1024
BLOCK = 1024


@functools.cache
def fence_kernel(device_kind: str):
    """The fence kernel: compiled for GPUs, interpreted on CPU (tests, the fake GPU); None
    without a Triton in the range ficco's kernels were checked against
    (:func:`ficco.kernels.triton_reason`), and on CPU when this Triton's interpreter cannot run
    it (:func:`ficco.kernels.interpreter_reason`: Triton 3.6's raises at the word's load once
    the word is raised). None means the ``masked_fill_`` fence."""
    from ...kernels import interpreter_reason, triton_reason

    if triton_reason() is not None:
        return None
    if device_kind == "cpu" and interpreter_reason() is not None:
        return None
    import triton

    from ...kernels.fence import fence_body as fence

    if device_kind == "cpu":
        from ...kernels import interpreted

        return interpreted(fence)
    return triton.jit(fence)


def poison_if_raised(outputs, word: torch.Tensor) -> None:
    """Enqueue, on the current stream, ``out.fill_(nan)`` for every tensor of ``outputs`` that
    runs only if the int32 ``word`` (a tensor the kernel can read: on GPUs a device view of
    pinned host memory) is nonzero when the stream gets there.

    >>> word = torch.zeros(1, dtype=torch.int32)   # on GPUs a device view of host memory
    >>> out = torch.ones(3, 5)
    >>> poison_if_raised([out], word); bool(out.isnan().any())
    False
    >>> word[0] = 1; poison_if_raised([out], word); bool(out.isnan().all())
    True
    """
    kernel = fence_kernel(word.device.type)
    for out in outputs:
        if out is None or out.numel() == 0:
            continue
        if kernel is None or not out.is_contiguous() or not out.is_floating_point():
            out.masked_fill_(word.view(()) != 0, float("nan"))
            continue
        numel = out.numel()
        programs = min(MAX_PROGRAMS, -(-numel // BLOCK))
        kernel[(programs,)](out, numel, word, BLOCK=BLOCK, AMD=_AMD)
