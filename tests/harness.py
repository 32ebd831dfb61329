"""A pool of spawned rank processes kept alive across test cases.

Spawning W ranks costs seconds (importing torch, joining the process group), so each pool is
started once per (world, env) and reused: ``pool.run(fn, *args)`` sends ``fn`` (a top-level,
importable function ``fn(rank, world, *args)``) to every rank and returns their results in
rank order. A failing rank raises :class:`RankError` carrying every rank's traceback; since the
group may then be out of step, that pool is discarded and restarted on next use.
"""
from __future__ import annotations

import atexit
import datetime
import importlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback

#: FICCO_SELECTOR=model: the ranks' decisions are the model's, deterministic (tests assert
#: what ran) and free (the default, auto, times a shortlist at each key's first sight: timing
#: noise would pick, and every multi-rank test would pay it). tests/engine/test_auto.py runs auto;
#: the demo, ``bench default`` and the docs run the real default.
DEFAULT_ENV = {"FICCO_TIMEOUT": "20", "FICCO_POISON": "1", "OMP_NUM_THREADS": "1",
               "FICCO_SELECTOR": "model"}


class RankError(AssertionError):
    pass


def bind_device(rank: int) -> None:
    """One GPU per rank where several are visible (``cuda:rank % count``), as torchrun users
    do with ``torch.cuda.set_device(local_rank)``; with one GPU every rank shares it.
    ``FICCO_TEST_ONE_DEVICE=1`` keeps every rank on the current device."""
    import torch

    if os.environ.get("FICCO_TEST_ONE_DEVICE") == "1" or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if count > 1:
        torch.cuda.set_device(rank % count)


def _rank_main(rank, world, init_method, env, pg_backend, conn):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        bind_device(rank)
        dist.init_process_group(pg_backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        module, name, args = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("err", traceback.format_exc()))
    try:
        import ficco

        ficco.shutdown()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001, S110 - the pool is going away anyway
        pass


class RankPool:
    """``store``: "file" (a FileStore: outlives every rank) or "tcp" (a TCPStore that rank 0
    hosts, as torchrun's env:// rendezvous makes it: it dies with rank 0)."""

    def __init__(self, world: int, env: dict | None = None, pg_backend: str = "gloo",
                 start_timeout_s: float = 120, store: str = "file"):
        self.world = world
        self.env = {**DEFAULT_ENV, **(env or {})}
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="ficco-pg-")
        os.close(fd)
        os.unlink(self._init_file)
        init_method = f"file://{self._init_file}" if store == "file" else \
            f"tcp://127.0.0.1:{_free_port()}"
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, daemon=True,
                               args=(rank, world, init_method, self.env, pg_backend, child))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        states = self._collect(start_timeout_s)
        bad = [s for s in states if s[0] != "ready"]
        if bad:
            self.close()
            raise RankError("rank start failed:\n" + "\n".join(str(s[1]) for s in bad))

    def _collect(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        out = [None] * self.world
        while any(o is None for o in out):
            for r, conn in enumerate(self.conns):
                if out[r] is None and conn.poll(0.01):
                    try:
                        out[r] = conn.recv()
                    except EOFError:
                        out[r] = ("err", f"rank {r} died (exit code {self.procs[r].exitcode})")
                elif out[r] is None and not self.procs[r].is_alive() and not conn.poll(0):
                    out[r] = ("err", f"rank {r} died (exit code {self.procs[r].exitcode})")
            if time.monotonic() > deadline:
                for r in range(self.world):
                    if out[r] is None:
                        out[r] = ("err", f"rank {r} did not answer within {timeout_s}s")
        return out

    def send(self, fn, *args) -> None:
        """Start ``fn(rank, world, *args)`` on every rank (collect with :meth:`_collect`)."""
        for conn in self.conns:
            conn.send((fn.__module__, fn.__name__, args))

    def run(self, fn, *args, timeout_s: float = 120):
        self.send(fn, *args)
        results = self._collect(timeout_s)
        errors = [(r, res[1]) for r, res in enumerate(results) if res[0] != "ok"]
        if errors:
            self.broken = True
            raise RankError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors))
        return [res[1] for res in results]

    def kill(self, rank: int):
        self.procs[rank].kill()
        self.broken = True

    def alive(self):
        return [p.is_alive() for p in self.procs]

    broken = False

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
            try:
                if proc.is_alive():
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


_pools: dict = {}


def pool(world: int, env: dict | None = None, pg_backend: str = "gloo") -> RankPool:
    """A live pool of ``world`` ranks with ``env``; restarted if a previous case broke it."""
    key = (world, tuple(sorted((env or {}).items())), pg_backend)
    current = _pools.pop(key, None)
    if current is not None and (current.broken or not all(current.alive())):
        current.close()
        current = None
    if current is None:
        _make_room(world)
        current = RankPool(world, env, pg_backend)
    _pools[key] = current       # the most recently used last
    return current


#: the most rank processes this test process keeps alive between cases (~0.4 GB each; two
#: workers, ~13 GB at most): a new
#: pool first closes the least recently used ones past it, so a long run (and each of
#: pytest-xdist's workers) holds a bounded share of the machine's memory
MAX_LIVE_RANKS = int(os.environ.get("FICCO_TEST_MAX_RANKS", "16"))


def _make_room(world: int) -> None:
    while _pools and sum(p.world for p in _pools.values()) + world > MAX_LIVE_RANKS:
        _pools.pop(next(iter(_pools))).close()


def run_alone(world: int, fn, *args, timeout_s: float = 120, raw: bool = False,
              store: str = "file"):
    """``fn`` on a pool of its own, closed afterwards: for cases that kill or stall a rank,
    leave threads or files behind, or time how long ranks take. ``raw``: every rank's
    ``("ok" | "err", value)``, a dead rank included, instead of raising on a failed rank.
    ``store``: see :class:`RankPool`."""
    own = RankPool(world, store=store)
    try:
        if raw:
            own.send(fn, *args)
            return own._collect(timeout_s)
        return own.run(fn, *args, timeout_s=timeout_s)
    finally:
        own.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def close_all():
    for p in _pools.values():
        p.close()
    _pools.clear()


atexit.register(close_all)


def shm_files(rank=0, world=1) -> list[str]:
    """This process's ficco files in /dev/shm (ficco names them ficco-<pid>-... and
    ficco-pad-<pid>-...): other test runs on the machine may hold theirs meanwhile."""
    mine = (f"ficco-{os.getpid()}-", f"ficco-pad-{os.getpid()}-")
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(mine))


def shm_files_left(pool: RankPool, fn, *args) -> list[list[str]]:
    """Per rank, the ficco files of its own that ``fn`` (run on ``pool``) left in /dev/shm."""
    pool.run(fn, *args)
    return pool.run(shm_files)


def dead_peer_error(fn, *args) -> str:
    """The error of ``fn(rank, world, 1, *args)`` on 3 fresh ranks with FICCO_TIMEOUT=5, where
    ``fn`` makes rank 1 exit mid-call: it must raise on the others (a RankError), never hang;
    returns its text."""
    own = RankPool(3, {**DEFAULT_ENV, "FICCO_TIMEOUT": "5"})
    try:
        own.run(fn, 1, *args, timeout_s=90)
    except RankError as exc:
        return str(exc)
    finally:
        own.close()
    raise AssertionError("no rank raised although rank 1 exited")


def check_skipped_backward(results) -> None:
    """The outcome of a 2-rank run where rank 1 skips step 1's backward and both ranks catch
    what is raised and go on (each rank's list of (step, outcome) for four steps, then
    ("after", outcome) of one more step after ``ficco.shutdown()`` on every rank): step 0 right
    on both; rank 0's backward of step 1 and rank 1's forward of step 2 each raise
    MismatchError naming both roles; every later step before the shutdown is refused
    (PoisonedGroupError), never a wrong number (the ranks are a step apart in
    their programs, so a forward that ficco could still pair would train on another step's
    batch); after the shutdown right on both."""
    rank0, rank1 = results
    assert rank0[0] == rank1[0] == (0, "ok"), results
    assert rank0[1][0] == 1 and rank0[1][1].startswith("MismatchError"), results
    assert rank1[1] == (1, "skipped backward"), results
    assert rank1[2][0] == 2 and rank1[2][1].startswith("MismatchError"), results
    for message in (rank0[1][1], rank1[2][1]):
        assert "backward" in message and "forward" in message, results   # the roles
    for _, outcome in rank0[2:-1] + rank1[3:-1]:
        assert outcome.startswith("PoisonedGroupError"), results
    assert rank0[-1] == rank1[-1] == ("after", "ok"), results
