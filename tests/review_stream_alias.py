"""Reproduction, on the fake GPU with 2 ranks, of a wrong-result mechanism found by the
symmetric-path review whose fix lies in the executor (``ficco/executor.py``, reviewed by
someone else at the same time): not collected by pytest (no ``test_`` prefix) until that fix
lands; then it becomes a test.

Two dma calls of one group made from two different caller streams. A call's side queues
(copy streams) wait only for the *current* stream's entry event (``executor.execute``), and
``finish`` joins them into that stream alone. Call 2 (stream s2) therefore publishes and
pulls into the session's symmetric workspace as soon as call 1's copies are done, while call
1's GEMM, on s1, may still be reading the same gathered rows: call 1 returns rows of call 2's
inputs. Call 2's plan barrier 0 (``serial`` runs it on the compute stream, s2) is not ordered
after call 1's barriers either, which the flag protocol of ``ficco/symm_mem/barrier.py``
relies on ("the next call's barrier 0 comes after this call's barrier 1 on every queue of
the rank"): a rank's call-2 flag can overwrite its call-1 flag in a peer's slot before the
peer read it, the peer sees a foreign flag and the group fails (outputs NaN). On one stream
the entry event orders everything and both calls are right. A fix: at a call's entry the
current stream also waits for an event recorded at the end of the session's previous call
when that call ran on another stream.

Run (about 10 s)::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -c \\
        "from tests import review_stream_alias as r; print(r.run(two=False), r.run())"

Each rank returns (error of call 1, error of call 2, error of a warm-up call) against float64;
seen on this code: one stream all ~2e-8; two streams call 1 ~0.1 or NaN (inf) on both
ranks, call 2 often NaN (the group failed on a foreign flag).
FICCO_POISON is off: the fake GPU runs an op's own torch ops (the poison fill) at once on the
host rather than in stream order, which would blur the picture.
"""
from __future__ import annotations

import torch

import ficco

from . import fake_gpu, harness
from . import fault_cases as cases
from .reference import make_inputs, max_row_rel_err


def two_streams(rank, world, schedule, shape, seed, two=True):
    cases._setup("cuda", 8)
    m, k, n = shape
    shards1, bs1, _, refs1 = make_inputs(seed, world, (m, k), (n,), torch.float32)
    shards2, bs2, _, refs2 = make_inputs(seed + 1, world, (m, k), (n,), torch.float32)
    with ficco.config.scope(transport="dma"):
        out = ficco.all_gather_matmul(shards1[rank], bs1[0], schedule=schedule)  # workspace
        torch.cuda.synchronize()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            out1 = ficco.all_gather_matmul(shards1[rank], bs1[0], schedule=schedule)
        with torch.cuda.stream(s2 if two else s1):
            out2 = ficco.all_gather_matmul(shards2[rank], bs2[0], schedule=schedule)
        torch.cuda.synchronize()
    fake_gpu.uninstall()
    return (max_row_rel_err(out1, refs1[0]), max_row_rel_err(out2, refs2[0]),
            max_row_rel_err(out, refs1[0]))


def run(schedule="serial", shape=(1024, 512, 1024), seed=3, two=True):
    return harness.pool(2, {"FICCO_POISON": "0"}).run(two_streams, schedule, shape, seed, two,
                                                        timeout_s=300)
