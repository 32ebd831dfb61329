"""The rank pools the client integration tests share (tests/test_integrations_*.py): one spawn
of ranks per W for transformers and megatron-core alike (FICCO_TEST_POOL only keys them apart
from the other tests' pools: importing the clients patches torch and takes seconds)."""
from __future__ import annotations

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
