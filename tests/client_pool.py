"""The rank pools the client integration tests share (tests/test_integrations_*.py): one spawn
of ranks per W for transformers and megatron-core alike (FICCO_TEST_POOL only keys them apart
from the other tests' pools: importing the clients patches torch and takes seconds)."""
from __future__ import annotations

import importlib
import importlib.util
import sys

from . import doc_snippets, harness

ENV = {"FICCO_TEST_POOL": "clients", "FICCO_TIMEOUT": "120"}


def pool(world: int) -> harness.RankPool:
    return harness.pool(world, ENV)


def client_block(page: str, marker: str) -> str:
    """The ```` ```python client ```` block of ``page`` that contains ``marker``, as written."""
    found = [b.code for b in doc_snippets.client_blocks() if b.page == page and marker in b.code]
    assert len(found) == 1, (page, marker, len(found))
    return found[0]


def readme_block(marker: str) -> str:
    return client_block("README.md", marker)


def fresh_import(monkeypatch, name, hide=None, version=None):
    """``name`` imported anew, with ``hide`` (a top-level module) hidden from ``find_spec``
    and/or ``importlib.metadata.version`` answering ``version``."""
    from importlib import metadata

    real_spec, real_version = importlib.util.find_spec, metadata.version
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None
                        if hide and mod.split(".")[0] == hide else real_spec(mod, *a))
    if version is not None:
        monkeypatch.setattr(metadata, "version", lambda dist: version
                            if dist in ("transformers", "megatron-core") else real_version(dist))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)
