"""Two ranks that hit an error and then exit the way a user's script would; prints each
rank's exit code (a negative one is a signal: SIGSEGV -11, SIGABRT -6).

    python -m tests.exit_after_error sigint   # Ctrl-C on rank 0 during dma calls, then exit
    python -m tests.exit_after_error skip     # rank 1 skips a call; rank 0 times out, exits
    python -m tests.exit_after_error skip 10  # ... ten times in a row
    python -m tests.exit_after_error clean 50 # no error: calls on both transports, then exit
    python -m tests.exit_after_error clean-destroy 50   # ... after destroy_process_group()
    python -m tests.exit_after_error gloo 50  # no ficco at all: gloo collectives, then exit

No rank calls ``destroy_process_group()`` (but in ``clean-destroy``): the point is that ficco
leaves nothing behind (a pending collective, a mapping a queue still uses) that crashes the
interpreter's exit.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time


def _rank(rank: int, world: int, init_file: str, mode: str) -> None:
    os.environ.update({"FICCO_TIMEOUT": "3", "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    gen = torch.Generator().manual_seed(rank)
    if mode == "gloo":     # torch alone: how often does its own exit abort?
        t = torch.randn(64, 64, generator=gen)
        for _ in range(10):
            dist.all_reduce(t)
        sys.exit(0)
    import ficco

    if mode == "sigint":
        a, b = torch.randn(256, 512, generator=gen), torch.randn(512, 256, generator=gen)
        with ficco.config.scope(transport="dma"):
            ficco.all_gather_matmul(a, b, schedule="uniform-unfused-1d")
            if rank == 0:
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                for _ in range(400):
                    ficco.all_gather_matmul(a, b, schedule="uniform-unfused-1d")
            except (KeyboardInterrupt, ficco.errors.FiccoError):
                pass
    elif mode.startswith("clean"):
        a, b = torch.randn(64, 128, generator=gen), torch.randn(128, 64, generator=gen)
        for transport in ("dma", "ccl"):
            with ficco.config.scope(transport=transport):
                for _ in range(5):
                    ficco.all_gather_matmul(a, b)
                    ficco.matmul_reduce_scatter(torch.cat([a] * world), b)
        if mode == "clean-destroy":
            ficco.shutdown()
            dist.destroy_process_group()
    else:
        a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 4, generator=gen)
        if rank == 0:
            try:
                ficco.all_gather_matmul(a, b)
            except ficco.errors.FiccoError:
                pass
        else:
            time.sleep(0.5)
    sys.exit(0)


def run(mode: str) -> list[int]:
    ctx = mp.get_context("spawn")
    fd, init_file = tempfile.mkstemp(prefix="ficco-exit-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_rank, args=(r, 2, init_file, mode)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    if os.path.exists(init_file):
        os.unlink(init_file)
    return [p.exitcode for p in procs]


if __name__ == "__main__":
    mode = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    codes = []
    for _ in range(repeats):
        codes += run(mode)
    print("exitcodes", *codes)
