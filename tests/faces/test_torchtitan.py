"""torchtitan 0.3 on ficco through ``--override.imports ficco.torchtitan.tensor_parallel``
(ficco/torchtitan/): torchtitan's llama3 debug model trains exactly like the unsharded model on
W = 2 and 4 CPU ranks, eager and compiled per block as torchtitan compiles it, with every
tensor-parallel GEMM on ficco (counted); what reaches no GEMM is said; the module imports
without torchtitan and refuses a torchtitan without the override mechanism.

Needs the torchtitan release pyproject's ``torchtitan`` extra pins (``make test`` installs it);
the ranks run in pools of their own, since importing torchtitan's model stack patches torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from .. import harness, torchtitan_cases

torchtitan = pytest.importorskip(
    "torchtitan", reason="torchtitan is a test extra (pip install -e '.[torchtitan]'; make test "
                         "installs it)")

# FICCO_TEST_POOL only keys pools of their own; FICCO_TIMEOUT: the ranks compile unevenly
ENV = {"FICCO_TEST_POOL": "torchtitan", "FICCO_TIMEOUT": "300"}
TOL = {"loss": 1e-5, "grad": 1e-4}
LAYERS = 6      # the debug model's own depth; the other cases keep fewer for CI's two cores


def _pool(world):
    return harness.pool(world, ENV)


def test_the_tested_torchtitan_is_the_one_installed_and_pinned():
    from importlib import metadata

    from ficco.torchtitan import TESTED_TORCHTITAN

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"torchtitan=={TESTED_TORCHTITAN}' in pyproject
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert f"torchtitan=={TESTED_TORCHTITAN}" in makefile
    assert metadata.version("torchtitan") == TESTED_TORCHTITAN


@pytest.mark.parametrize("world,compiled,layers", [(2, False, LAYERS), (4, False, 2),
                                                    (2, True, 2), (4, True, 1)])
def test_llama3_debug_model_trains_like_unsharded_with_every_tp_gemm_on_ficco(world, compiled,
                                                                             layers):
    results = _pool(world).run(torchtitan_cases.train, compiled, layers, 2, 11 + world,
                               timeout_s=600)
    print(f"W={world} {'per-block compiled' if compiled else 'eager'}, {layers} layers: loss "
          f"{max(r[0] for r in results):.1e}, worst gradient {max(r[1] for r in results):.1e}, "
          f"ficco calls per step {results[0][2]}")
    for loss_diff, grad_diff, calls, report, replaced in results:
        assert loss_diff < TOL["loss"], results
        assert grad_diff < TOL["grad"], results
        # per layer forward: Q/K/V and w1+w3 gather, wo and w2 reduce-scatter; the backward
        # of each op is the other
        per_op = 4 * layers
        assert calls == {"ficco::all_gather_matmul": per_op,
                         "ficco::matmul_reduce_scatter": per_op}, calls
        # fused wqkv, wo, w1, w2, w3 in every layer
        assert any(f"{5 * layers} of {5 * layers} TP GEMMs in {layers} transformer blocks run "
                   f"on ficco" in line for line in report), report
        assert replaced == ["FiccoFeedForward", "FiccoFusedQKVLinear",
                            "FiccoRowParallelLinear"], replaced


def test_what_reaches_no_tp_gemm_is_said():
    for out in _pool(2).run(torchtitan_cases.nothing_reaches):
        assert len(out["no_sp_warnings"]) == 1, out      # once, not once per block
        assert "0 TP GEMMs" in out["no_sp_warnings"][0], out
        assert "sequence parallelism is off" in out["no_sp_warnings"][0], out
        assert out["no_sp_types"] == ["FeedForward.Config", "Linear.Config"], out   # torchtitan's own
        assert out["tp1_warnings"] and all("tensor_parallel_degree is 1" in w
                                           for w in out["tp1_warnings"]), out
        assert out["tp1_shape"] == (1, 16, 2048), out
        assert "spmd_backend='spmd_types'" in out["dtensor"], out


def test_docstring_examples_run_in_the_torchtitan_pool():
    for results in _pool(2).run(torchtitan_cases.run_doctests):
        assert all(failed == 0 for _, failed in results), results


def _fresh_import(monkeypatch, hide: bool, overrides: bool = True):
    """ficco.torchtitan imported anew, with torchtitan hidden from ``find_spec`` or with its
    override module hidden (torchtitan 0.2.x)."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        top = name.split(".")[0]
        if top == "torchtitan" and (hide or (not overrides and name.endswith(".override"))):
            return None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delitem(sys.modules, "ficco.torchtitan", raising=False)
    return importlib.import_module("ficco.torchtitan")


def test_imports_without_torchtitan_and_refuses_clearly(monkeypatch):
    from ficco.errors import BackendUnavailableError

    loaded = [m for m in sys.modules if m.split(".")[0] == "torchtitan"]
    module = _fresh_import(monkeypatch, hide=True)
    assert [m for m in sys.modules if m.split(".")[0] == "torchtitan"] == loaded  # none new
    assert module.torchtitan_version() is None
    with pytest.raises(BackendUnavailableError, match=re.escape("torchtitan 0.3.0")):
        module.tensor_parallel(object())


def test_refuses_torchtitan_without_overrides_naming_the_0_2_way(monkeypatch):
    from ficco.errors import BackendUnavailableError

    module = _fresh_import(monkeypatch, hide=False, overrides=False)
    with pytest.raises(BackendUnavailableError, match="ficco.parallel") as info:
        module.tensor_parallel(object())
    assert "PrepareModuleInput" in str(info.value)
