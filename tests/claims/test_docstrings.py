"""Every example in ficco's docstrings runs and prints what it shows (STYLE: a public function
has a docstring with an example; an example that no longer runs misleads more than none)."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ficco

# ficco.torchtitan's examples run in tests/faces/test_torchtitan.py's own rank pool: importing it
# imports torchtitan's model stack (which patches torch), and its modules need torchtitan.
# ficco.integrations' run in the client tests' pool (tests/faces/test_integrations_transformers.py):
# importing them imports transformers / megatron-core where installed.
MODULES = sorted(m.name for m in pkgutil.walk_packages(ficco.__path__, "ficco.")
                 if not m.name.startswith(("ficco.torchtitan", "ficco.integrations")))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run_as_shown(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             report=True, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
