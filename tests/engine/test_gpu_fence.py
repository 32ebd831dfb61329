"""The fence ending every eager GPU dma call: the call's outputs become NaN
when the watchdog released one of its barriers, and stay untouched otherwise. The kernel runs
here in Triton's interpreter on CPU tensors; tests/gpu runs it compiled."""
from __future__ import annotations

import random

import pytest
import torch

from ficco.backends.gpu import fence as gpu_fence
from ficco.backends.gpu.fence import poison_if_raised

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _outputs(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(random.randrange(1, 40), random.randrange(1, 70)) for _ in range(3)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowered_word_leaves_outputs_exactly_as_they_were(dtype, monkeypatch):
    monkeypatch.setattr(gpu_fence, "MAX_PROGRAMS", 2)     # programs loop over several blocks
    monkeypatch.setattr(gpu_fence, "BLOCK", 64)
    word = torch.zeros(1, dtype=torch.int32)
    outs = _outputs(dtype, random.randrange(1 << 30))
    before = [o.clone() for o in outs]
    poison_if_raised(outs, word)
    assert all(torch.equal(o, b) for o, b in zip(outs, before))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("triton_kernel", [True, False])
def test_raised_word_turns_every_output_element_into_nan(dtype, triton_kernel, monkeypatch):
    from ficco.kernels import interpreter_reason

    if triton_kernel and interpreter_reason() is not None:     # Triton 3.6
        pytest.skip(interpreter_reason())
    monkeypatch.setattr(gpu_fence, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(gpu_fence, "BLOCK", 64)
    if not triton_kernel:                       # no Triton: the torch fallback
        monkeypatch.setattr(gpu_fence, "fence_kernel", lambda kind: None)
    word = torch.zeros(1, dtype=torch.int32)
    outs = _outputs(dtype, random.randrange(1 << 30))
    strided = torch.randn(30, 20, dtype=torch.float64).to(dtype)[:, ::3]   # not contiguous
    word[0] = 1
    poison_if_raised([*outs, strided, None], word)
    for out in [*outs, strided]:
        assert out.isnan().all(), out
    word[0] = 0
    fresh = _outputs(dtype, random.randrange(1 << 30))
    before = [o.clone() for o in fresh]
    poison_if_raised(fresh, word)
    assert all(torch.equal(o, b) for o, b in zip(fresh, before))


def test_an_interpreter_that_cannot_run_the_fence_gets_the_torch_fence(monkeypatch):
    """The fake GPU's fence runs on CPU tensors, in Triton's interpreter. Triton 3.6's
    interpreter cannot run the fence (its word load raised ``TypeError: only 0-dimensional
    arrays can be converted to Python scalars`` the first time a word was raised), and the
    CPU kernel was built whatever :func:`ficco.kernels.interpreter_reason` said: with such a
    Triton the CPU fence must be the torch one, and still turn every element into NaN."""
    import triton

    from ficco import kernels

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    gpu_fence.fence_kernel.cache_clear()
    try:
        assert kernels.interpreter_reason() is not None
        assert gpu_fence.fence_kernel("cpu") is None
        assert gpu_fence.fence_kernel("cuda") is not None     # compiled kernels are fine
        word = torch.ones(1, dtype=torch.int32)
        outs = _outputs(torch.float32, random.randrange(1 << 30))
        poison_if_raised(outs, word)
        assert all(bool(o.isnan().all()) for o in outs)
    finally:
        monkeypatch.undo()
        gpu_fence.fence_kernel.cache_clear()


@pytest.mark.parametrize("target", ["cuda:sm_90", "rocm:gfx942"])
def test_the_fence_counts_its_elements_in_int64_when_numel_fits_int32(target):
    """Triton passes ``numel`` < 2**31 as an int32, and the fence's loop counter and element
    offsets were int32 with it: near 2**31 ``start + step`` (and ``start + arange``) wrapped
    negative, passed ``offsets < numel`` and stored NaN before the output (out of bounds). The
    interpreter computes these in Python integers, so this reads the compiled loop (Triton
    ships its compilers: no GPU needed): its counter and the store's offsets must be int64."""
    import re

    from ficco import kernels

    if kernels.triton_reason() is not None:
        pytest.skip(kernels.triton_reason())
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kind, arch = target.split(":")
    gpu = GPUTarget("cuda", int(arch[3:]), 32) if kind == "cuda" else GPUTarget("hip", arch, 64)
    sig = {"out_ptr": "*fp32", "numel": "i32", "err_ptr": "*i32", "BLOCK": "constexpr",
           "AMD": "constexpr"}
    ttir = triton.compile(ASTSource(fn=gpu_fence.fence_kernel("cuda"), signature=sig,
                                    constexprs={"BLOCK": 1024, "AMD": kind == "rocm"}),
                          target=gpu).asm["ttir"]
    loops = re.findall(r"scf\.for .* : (i\d+)", ttir)
    assert loops == ["i64"], loops
    stores = re.findall(r"tt\.addptr %\w+, %\w+ : tensor<\d+x!tt\.ptr<f32>>, tensor<\d+x(i\d+)>",
                        ttir)
    assert stores and all(width == "i64" for width in stores), stores
