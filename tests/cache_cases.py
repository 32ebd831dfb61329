"""Rank-side functions for the cache tests (importable by the spawned ranks): calls under the
``auto`` selector, which measures at a key's first sight and keeps the winner on disk, with the
cache directory in each state a user meets: missing, unwritable, corrupt, a directory or a FIFO
where an entry belongs, huge, shared with others."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist

import ficco
from ficco import config
from ficco.errors import FiccoWarning
from ficco.heuristics import auto

from .reference import ROW_TOL, max_row_rel_err

STATES = ("missing", "unwritable", "corrupt", "directory", "fifo", "huge", "shared")


def spoil(root: str, state: str) -> None:
    """Put the cache directory ``root`` (the old single file's place included) in ``state``."""
    entries = os.path.join(root, "auto")
    files = [os.path.join(root, "auto.json")] + (
        [os.path.join(entries, n) for n in os.listdir(entries)] if os.path.isdir(entries)
        else [])
    for path in files:
        if state in ("corrupt", "directory", "fifo") and os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        if state == "corrupt":
            with open(path, "wb") as f:
                f.write(bytes(range(128, 256)))
        elif state == "directory":
            os.mkdir(path)
        elif state == "fifo":
            os.mkfifo(path)
        elif state == "shared" and os.path.isfile(path):
            os.chmod(path, 0o666)                 # writable by anyone
    if state == "huge":
        os.makedirs(entries, exist_ok=True)
        for i in range(3000):
            with open(os.path.join(entries, f"{i:032x}.json"), "w") as f:
                f.write(json.dumps({"key": f"junk {i}", "entry": {}, "made_by": {}}) + "\n")


def calls_with_cache(rank, world, seed, root, state) -> dict:
    """Two first-sight calls of one new shape under ``auto`` (the cache spoiled in between,
    memory and sessions forgotten: a new process), each on fresh data against float64; what
    was warned; how many entry files are left."""
    failures, warned = [], []
    cache_dir = "/proc/ficco-cache-unwritable" if state == "unwritable" else root
    for call in range(2):
        # (huge: before the first call, whose write then trims it)
        if rank == 0 and call == (0 if state == "huge" else 1) and state != "unwritable":
            spoil(root, state)
        dist.barrier()
        ficco.shutdown()          # a new process: only the files remember the first call
        auto.CACHE.forget()
        gen = torch.Generator().manual_seed(seed + call)
        m, k, n = 3, 8 + seed % 500, 5     # (a shape new to the pool: measured)
        shards = [torch.randn(m, k, generator=gen, dtype=torch.float64) for _ in range(world)]
        b = torch.randn(k, n, generator=gen, dtype=torch.float64)
        with warnings.catch_warnings(record=True) as seen, \
                config.scope(cache_dir=cache_dir, selector="auto", auto="upfront"):
            warnings.simplefilter("always")
            try:
                out = ficco.all_gather_matmul(shards[rank].float(), b.float())
            except Exception as exc:  # noqa: BLE001 - the report names it
                failures.append(f"call {call}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
        warned += [str(w.message) for w in seen if issubclass(w.category, FiccoWarning)]
        ref = torch.cat(shards) @ b
        ref.scale = torch.cat(shards).abs() @ b.abs()
        err = max_row_rel_err(out, ref)
        if not err <= ROW_TOL[torch.float32]:
            failures.append(f"call {call}: error {err:.3g}")
    entries = os.path.join(root, "auto")
    count = len(os.listdir(entries)) if os.path.isdir(entries) else 0
    return {"failures": failures, "warned": warned, "entries": count}
