"""Every load of a word another agent changes while a kernel runs (the group's
error word: the fence's check, the gated GEMM's halt poll) goes to memory, and the gated GEMM's
store of it is write-through, on every Triton ficco accepts (ficco/kernels/words.py). Checked
on the kernels compiled offline (Triton ships its compilers): the AMD build's IR carries the
``.cv`` cache modifier (a volatile load alone became ``s_load_dword`` on gfx942 with Triton 3.6
and 3.8), and the assembly of each target polls with a volatile / system-coherent load."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

import triton.language as tl

from ficco import kernels
from ficco.kernels.words import load_word, store_word

pytestmark = pytest.mark.skipif(kernels.triton_reason() is not None,
                                reason=str(kernels.triton_reason()))

#: what a load of the word must carry in each target's assembly
LOAD = {"cuda:sm_90": "ld.volatile.global", "rocm:gfx942": "sc0 sc1", "rocm:gfx90a": "glc"}
#: gfx90a has no write-through bit: host memory is fine-grained there, uncached by its type
STORE = {"cuda:sm_90": "st.global.wt", "rocm:gfx942": "sc0 sc1",
         "rocm:gfx90a": "global_store_dword"}


def _fence(target):
    from ficco.backends.gpu import fence as gpu_fence

    sig = {"out_ptr": "*fp32", "numel": "i32", "err_ptr": "*i32", "BLOCK": "constexpr",
           "AMD": "constexpr"}
    return _compile(gpu_fence.fence_kernel("cuda"), target, sig,
                    {"BLOCK": 1024, "AMD": target.startswith("rocm")})


def _gated(target):
    from ficco.kernels.gated_gemm import compile_offline

    return compile_offline(target, "bf16", block=(64, 64, 32), num_warps=4, num_stages=2)


def _compile(fn, target, signature, constexprs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kind, arch = target.split(":")
    gpu = GPUTarget("cuda", int(arch[3:]), 32) if kind == "cuda" else GPUTarget("hip", arch, 64)
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=gpu).asm


def _poll(word, out, AMD: tl.constexpr):
    """The shape of the gated GEMM's halt poll: a load, a loop of loads, a store."""
    seen = load_word(word, AMD)
    i = 0
    while (seen == 0) & (i < 1000):
        seen = load_word(word, AMD)
        i += 1
    store_word(word, -1)
    tl.store(out, i)


def _assembly_lines(asm: dict, target: str, pattern: str) -> list[str]:
    text = asm["ptx" if target.startswith("cuda") else "amdgcn"]
    return [ln.strip() for ln in text.splitlines() if re.search(pattern, ln)]


_LOADS = r"\bld\.(volatile\.)?global(\.\w+)*\.b32\b|\bglobal_load_dword\b|\bs_load_dword\s+s\d+, s\[\d+:\d+\], 0x0$"
_STORES = r"\bst\.global(\.\w+)*\.b32\b|\bglobal_store_dword\b"


def _ir_accesses(asm: dict, name: str, op: str) -> list[str]:
    """IR lines that load (``op`` "tt.load") or store ("tt.store") through argument ``name``
    or a vector of it (``tt.splat`` / ``tt.addptr`` / ``tt.broadcast`` of it)."""
    lines = asm["ttir"].splitlines()
    names = {name}
    derived = re.compile(r"%([\w.]+) = tt\.(splat|addptr|broadcast|expand_dims) %([\w.]+)")
    for ln in lines:
        m = derived.search(ln)
        if m and m.group(3) in names:
            names.add(m.group(1))
    return [ln.strip() for ln in lines
            if any(re.search(rf"{re.escape(op)} %{re.escape(n)}\b", ln) for n in names)]


def _memory_every_time(line: str, amd: bool) -> bool:
    return bool(re.search(r"cache(_modifier|Modifier)? = cv", line)) if amd else \
        "isVolatile = true" in line


@pytest.mark.parametrize("target", sorted(LOAD))
def test_the_word_builtins_compile_to_memory_accesses(target):
    import triton

    asm = _compile(triton.jit(_poll), target, {"word": "*i32", "out": "*i32", "AMD": "constexpr"},
                   {"AMD": target.startswith("rocm")})
    loads = _assembly_lines(asm, target, _LOADS)
    assert loads and all(LOAD[target] in line for line in loads), loads
    stores = [ln for ln in _assembly_lines(asm, target, _STORES)]
    assert any(STORE[target] in line for line in stores), stores


@pytest.mark.parametrize("target", sorted(LOAD))
def test_the_fence_reads_the_error_word_from_memory(target):
    asm = _fence(target)
    loads = _assembly_lines(asm, target, _LOADS)
    assert loads and all(LOAD[target] in line for line in loads), loads
    ir = _ir_accesses(asm, "err_ptr", "tt.load")
    assert len(ir) == 1 and _memory_every_time(ir[0], target.startswith("rocm")), ir


@pytest.mark.parametrize("target", sorted(LOAD))
def test_the_gated_gemm_polls_and_raises_the_word_through_memory(target):
    asm = _gated(target)
    amd = target.startswith("rocm")
    loads = _ir_accesses(asm, "halt", "tt.load")
    # the program's first look and the wait loop's polls
    assert len(loads) >= 2 and all(_memory_every_time(ln, amd) for ln in loads), loads
    stores = _ir_accesses(asm, "halt", "tt.store")
    assert len(stores) == 1 and re.search(r"cache(_modifier|Modifier)? = wt", stores[0]), stores


def test_triton_outside_the_checked_range_is_refused_with_the_reason(monkeypatch):
    import triton

    kernels.triton_reason.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.99.0")
        reason = kernels.triton_reason()
        assert reason is not None and "newer than the newest" in reason
        assert kernels.unavailable_reason("cuda:sm_90") == reason
        monkeypatch.setattr(triton, "__version__", "3.3.1")
        kernels.triton_reason.cache_clear()
        assert "too old" in kernels.triton_reason()
    finally:
        monkeypatch.undo()
        kernels.triton_reason.cache_clear()
