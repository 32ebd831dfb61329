"""One process, one GPU: the backend's pieces against torch. Run on NVIDIA and AMD alike with
``python -m pytest tests/gpu -m gpu``."""
from __future__ import annotations

import time

import pytest
import torch

from ficco.errors import CommTimeoutError
from ficco.plan.problem import Problem
from ficco.symm_mem.barrier import plan_barrier

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(scope="module")
def backend():
    from ficco.backends import backend_class

    from .conftest import gpu_backend_name

    return backend_class(gpu_backend_name())()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,world", [(8, 64, 4), (13, 10, 3), (5, 3, 4), (1, 7, 2)])
def test_copy_2d_matches_torch_strided_copy(backend, dtype, m, k, world):
    """Every uneven column chunk of every peer's shard, copied between two M x K buffers."""
    dev = backend.device()
    src = torch.randn(world * m, k, device=dev).to(dtype)
    dst = torch.full_like(src, float("nan"))
    q = backend.queue("copy0")
    q.wait_stream(torch.cuda.current_stream(dev))
    for peer in range(world):
        for c0, nc in Problem(m=m, k=k, ns=(1,), dtype="float32", world=world, rank=0).col_chunks():
            rows = slice(peer * m, (peer + 1) * m)
            backend.copy_2d(dst[rows, c0:c0 + nc], src[rows, c0:c0 + nc], q)
    q.synchronize()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_1d_row_chunks(backend, dtype):
    dev = backend.device()
    src = torch.randn(37, 19, device=dev).to(dtype)
    dst = torch.full_like(src, float("nan"))
    q = backend.queue("copy1")
    q.wait_stream(torch.cuda.current_stream(dev))
    for r0, nr in Problem(m=37, k=19, ns=(1,), dtype="float32", world=5, rank=0).row_chunks():
        backend.copy(dst[r0:r0 + nr], src[r0:r0 + nr], q)
    q.synchronize()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_into_views_2d_and_batched(backend, dtype, accumulate):
    """out (+)= a @ b into a row block of a bigger buffer, and as one strided-batched GEMM over
    equally spaced blocks (the fused schedules' view), against float64."""
    dev = backend.device()
    tol = {torch.float32: 1e-4, torch.float16: 6e-3, torch.bfloat16: 4e-2}[dtype]
    a_full = torch.randn(24, 16, device=dev).to(dtype)
    b = torch.randn(16, 9, device=dev).to(dtype)
    start = torch.randn(24, 9, device=dev).to(dtype)
    out = start.clone() if accumulate else torch.full_like(start, float("nan"))
    compute = backend.queue("compute")
    backend.gemm(a_full[4:10], b, out[4:10], accumulate, compute)
    # blocks of 3 rows at rows 12, 18 (spacing 6): a (2, 3, 16) strided view
    a3 = a_full.as_strided((2, 3, 16), (6 * 16, 16, 1), 12 * 16)
    o3 = out.as_strided((2, 3, 9), (6 * 9, 9, 1), 12 * 9)
    backend.gemm(a3, b, o3, accumulate, compute)
    torch.cuda.synchronize(dev)
    ref = a_full.double() @ b.double() + (start.double() if accumulate else 0)
    for rows in (slice(4, 10), slice(12, 15), slice(18, 21)):
        err = (out[rows].double() - ref[rows]).norm() / ref[rows].norm()
        assert err < tol, (rows, float(err))


def test_barrier_world_1_and_symmetric_buffer(backend):
    symm = backend.symm_provider().allocate(4096, None, backend.device())
    try:
        assert symm.world == 1 and symm.signal_pad(0).shape[1] == 1
        assert int(symm.signal_pad(0).abs().sum()) == 0          # zeroed at allocation
        buf = symm.get_buffer(0, (16, 8), torch.float32, offset=512)
        buf.copy_(torch.arange(128., device=backend.device()).view(16, 8))
        plan_barrier(backend, symm, 0, backend.queue("compute"), 5.0, 0)
        plan_barrier(backend, symm, 0, backend.queue("compute"), 5.0, 1)
        symm.barrier(3, timeout_s=5.0)
        backend.synchronize()
        # Plan barriers clear their flags once passed; host barriers count generations.
        assert int(symm.signal_pad(0)[0, 0]) == 0 and int(symm.signal_pad(0)[3, 0]) == 1
        assert float(buf.sum()) == sum(range(128))
    finally:
        symm.close()


def test_compute_queue_is_callers_current_stream(backend):
    side = torch.cuda.Stream(backend.device())
    with torch.cuda.stream(side):
        assert backend.queue("compute") == side
    assert backend.queue("compute") == torch.cuda.current_stream(backend.device())
    assert backend.queue("copy0") != backend.queue("copy1")


def test_host_barrier_deadline_names_the_missing_peer(backend):
    """A handle of world 2 whose 'peer' never signals: the host barrier raises after the
    deadline naming rank 1, and the stream is released (synchronize returns)."""
    from ficco.symm_mem.device import single_gpu_group

    symm = single_gpu_group(backend, 2, 1024, pad_value=0)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 0 at step 7.*rank\(s\) \[1\]"):
        symm.barrier(2, 0.5, 7)
    assert time.monotonic() - start < 10
    torch.cuda.synchronize(backend.device())
    symm.close()


def test_plan_barrier_enqueues_fast_and_clears_its_flags(backend):
    """A world-8 plan barrier whose peers are pre-raised: passes, clears this rank's slots."""
    from ficco.symm_mem.device import single_gpu_group

    symm = single_gpu_group(backend, 8, 1024, pad_value=1)
    try:
        q = backend.queue("copy0")
        plan_barrier(backend, symm, 0, q, 5.0, 0)
        q.synchronize()
        backend.synchronize()
        assert int(symm.signal_pad(0)[0].abs().sum()) == 0
        assert int(symm.signal_pad(0)[1].sum()) == 8          # channel 1 untouched
    finally:
        symm.close()
