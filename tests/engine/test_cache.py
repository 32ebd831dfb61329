"""The cache ficco keeps for itself (ficco/heuristics/cache.py): optional (a cache that is
unwritable, corrupt, a directory, a FIFO or shared never fails a call: it warns), bounded with
one file per key, safe for concurrent writers, per user, expiring stale entries."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import tempfile
import warnings

import pytest

from ficco.errors import FiccoWarning
from ficco.heuristics import cache

from .. import harness
from ..cache_cases import STATES, calls_with_cache

WARNS = {"unwritable": "cannot be made", "corrupt": "corrupt", "directory": "not a regular file",
         "fifo": "not a regular file", "shared": "writable by others"}


@pytest.mark.parametrize("state", STATES)
def test_a_call_under_auto_is_right_whatever_state_the_cache_is_in(state):
    root = tempfile.mkdtemp(prefix=f"ficco-cache-{state}-")
    for result in harness.pool(2).run(calls_with_cache, random.randrange(1 << 30), root, state):
        assert result["failures"] == [], result
        if state in WARNS:
            assert any(WARNS[state] in w for w in result["warned"]), result["warned"]
        else:
            assert result["warned"] == [], result["warned"]
        assert 0 < result["entries"] <= cache.MAX_ENTRIES or state == "unwritable", result


def _files(tmp_path):
    return cache.EntryFiles("auto", lambda: tmp_path)


def test_entries_measured_under_another_version_expire(tmp_path):
    files = _files(tmp_path)
    assert files.put("k", {"schedule": "ring"}) and files.get("k") == {"schedule": "ring"}
    path = files.file_of("k")
    data = json.loads(path.read_text())
    data["made_by"]["torch"] = "0.0.1"
    path.write_text(json.dumps(data))
    assert files.get("k") is None and not path.exists()      # stale: ignored and removed


def test_files_of_another_user_or_writable_by_others_are_never_read(tmp_path):
    files = _files(tmp_path)
    files.put("k", {"schedule": "ring"})
    path = files.file_of("k")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(files.directory().stat().st_mode & 0o777) == "0o700"
    os.chmod(path, 0o666)
    with pytest.warns(FiccoWarning, match="writable by others"):
        assert files.get("k") is None
    os.chmod(path, 0o600)
    assert files.get("k") == {"schedule": "ring"}
    if os.getuid() == 0:      # (root can hand the file to another user)
        os.chown(path, 4242, -1)
        with pytest.warns(FiccoWarning, match="owned by uid 4242"):
            assert files.get("k") is None


def test_the_cache_is_bounded_and_keeps_the_recently_used(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "MAX_ENTRIES", 40)
    files = _files(tmp_path)
    for i in range(40):
        files.put(f"key {i}", {"i": i})
        os.utime(files.file_of(f"key {i}"), ns=(i * 10**9, i * 10**9))
    assert files.get("key 0") == {"i": 0}          # used now: the most recent
    for i in range(40, 60):
        files.put(f"key {i}", {"i": i})
    left = files.keys()          # (40 // 64: every write trims)
    assert len(left) <= 40 and "key 0" in left and "key 1" not in left
    assert left["key 59"] == {"i": 59}


def test_a_lookup_reads_one_file_whatever_the_cache_holds(tmp_path, monkeypatch):
    files = _files(tmp_path)
    for i in range(300):
        files.put(f"key {i}", {"i": i})
    read = []
    real = cache.read_json
    monkeypatch.setattr(cache, "read_json", lambda path: read.append(path) or real(path))
    assert files.get("key 7") == {"i": 7} and read == [files.file_of("key 7")]


def _writer(root: str, worker: int, count: int) -> None:
    files = cache.EntryFiles("auto", lambda: root)
    for i in range(count):
        files.put(f"key {i % 25}", {"writer": worker, "i": i})
        files.get(f"key {(i + 7) % 25}")


def test_concurrent_writers_of_several_processes_leave_whole_entries(tmp_path):
    procs = [mp.get_context("fork").Process(target=_writer, args=(str(tmp_path), w, 60))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no entry is torn or corrupt
        left = _files(tmp_path).keys()
    assert sorted(left) == sorted(f"key {i}" for i in range(25))
    assert all(set(e) == {"writer", "i"} for e in left.values())
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_a_corrupt_calibrated_profile_warns_and_the_built_in_prices(tmp_path):
    from ficco import config
    from ficco.heuristics import profiles, sku

    with config.scope(cache_dir=str(tmp_path)):
        path = profiles.calibrated_path(sku.sku_of(sku.local_props("cpu")).id)
        path.parent.mkdir(parents=True)
        path.write_bytes(bytes(range(128, 256)))
        with pytest.warns(FiccoWarning, match="not a usable profile"):
            profile, origin = profiles.in_force("cpu")
        assert origin.startswith("built-in") and profile == profiles.load("cpu")
