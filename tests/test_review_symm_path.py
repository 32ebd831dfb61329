"""Silent wrong results found by the desk review of the symmetric-memory, barrier and kernel
path (ficco/symm_mem, ficco/kernels, ficco/backends/gpu_fence|watchdog|rescue): each test
failed on the code before its fix. The gated GEMM runs in Triton's interpreter (CPU), which
computes pointer offsets in the same integer widths the compiled kernel does."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_gated_gemm_reads_column_major_b_past_2_31_elements():
    """``b`` is the caller's weight as given, and ``w.t()`` (column-major, ``stride(1) == K``)
    is the common case. The kernel built B's column offsets as ``offs_n * stride_bn`` in int32:
    once ``(N - 1) * K`` passes 2**31 the offset wrapped and the columns past it were read from
    ``2**32`` elements before ``b`` (an LM head of 256k vocabulary x 8k hidden on one rank;
    an illegal address, or silently other memory). Here ``b`` is a 3-column view with a column
    stride of 2**30 + 8 into memory that is reserved, not touched (the pages read are the
    kernel's), so the third column starts past 2**31 elements."""
    from ficco.kernels.gated_gemm import Segment, gated_gemm

    gen = torch.Generator().manual_seed(11)
    k, n, m = 16, 3, 5
    stride = 2 ** 30 + 8
    base = 2 ** 31      # a wrapped offset lands inside the reservation: wrong data, no crash
    store = torch.empty(base + (n - 1) * stride + k, dtype=torch.float16)
    b = store.as_strided((k, n), (1, stride), base)
    values = torch.randn(k, n, generator=gen).half()
    for j in range(n):
        b[:, j] = values[:, j]
    a = torch.randn(m, k, generator=gen).half()
    c = torch.empty(m, n)
    err = gated_gemm(a, a, b, c, (Segment(0, m, ((0, k, -1),)),),
                     torch.ones(1, dtype=torch.int32), local_row0=0, device_kind="cpu")
    ref = a.double() @ values.double()
    assert int(err[0]) == 0
    assert torch.allclose(c.double(), ref, rtol=1e-3, atol=1e-3), \
        (c.double() - ref).abs().amax(dim=0)


def test_cpu_gated_launch_never_returns_nan_tiles_without_an_error():
    """On the CPU backend the launch's watch thread raises the kernel's ``halt`` word at the
    call's deadline (or when another queue of the call failed). Tiles that start after that
    are written as NaN without waiting for anything, so the kernel's error word stays 0 when
    every flag had already arrived: the launch returned normally with NaN rows in ``out``
    (a call past its deadline returning data). It must raise instead. The deadline is made
    to pass while the interpreted kernel runs (its flags are all raised)."""
    from ficco import schedules
    from ficco.backends import get_backend
    from ficco.errors import CommTimeoutError
    from ficco.kernels.launch import gated_task
    from ficco.plan import GatedGemm
    from ficco.problem import Problem

    problem = Problem(m=64, k=32, ns=(96,), dtype="float32", world=2, rank=0)
    plan = schedules.get("gated-1d").plan(problem)
    op = next(o for o in plan.ops if isinstance(o, GatedGemm))
    gen = torch.Generator().manual_seed(5)
    gathered = torch.randn(2 * problem.m, problem.k, generator=gen)
    b = torch.randn(problem.k, 96, generator=gen)
    out = torch.empty(2 * problem.m, 96)
    flags = torch.ones(op.num_flags, dtype=torch.int32)
    # The deadline is 5 ms after the launch is made; the watch thread looks every 10 ms and
    # the interpreted kernel (4 x 3 tiles of 32 rows, one at a time) runs far longer.
    task = gated_task(get_backend("cpu"), problem, op, gathered[: problem.m], gathered, b, out,
                      flags, timeout_s=0.005)
    try:
        task()
    except CommTimeoutError:
        return      # the call fails: nothing it computed is returned
    ref = gathered.double() @ b.double()
    assert not out.isnan().any(), "a gated launch returned NaN tiles and no error"
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4)
