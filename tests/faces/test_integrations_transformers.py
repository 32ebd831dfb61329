"""Hugging Face transformers' tensor and expert parallelism on ficco (ficco/integrations/):
a tiny Llama (TP) and a tiny Mixtral-like MoE (TP attention, EP experts) built from a config
with random weights, loaded by transformers' ``from_pretrained(distributed_config=...)`` on W = 2
and 4 CPU ranks, float64: loss, logits, every gradient and greedy ``generate`` tokens (KV cache)
against the same model unsharded, with ficco's ops counted; the README's line as written; the
release check.

Needs the transformers release pyproject's ``transformers`` extra pins (``make test``
installs it).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from .. import client_pool, transformers_cases

pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e "
                                           "'.[transformers]'; make test installs it)")

TOL = {"loss": 1e-12, "logits": 1e-12, "grad": 1e-12}
SP_NAMES = ["ficco_colwise_gathered", "ficco_colwise_sp", "ficco_rowwise_sp",
            "ficco_sequence_gather", "ficco_sequence_norm", "ficco_sequence_norm_gather",
            "ficco_sequence_shard", "ficco_sequence_start"]
LAYERS = 2
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    return {kind: str(base / kind) for kind in ("llama", "mixtral")}


def _check(res, kind, world=2, sp=False):
    assert res["worst"]["loss"] < TOL["loss"], res
    assert res["worst"]["logits"] < TOL["logits"], res
    assert res["worst"]["grad"] < TOL["grad"], res
    assert res["same_params"] and res["tokens_equal"] and res["new_tokens"] == \
        transformers_cases.NEW, res
    new = transformers_cases.NEW
    if sp:
        # generate: the prompt (6 tokens) splits over W = 2, not over W = 4; a decode step's
        # one token never does, so those forwards run the replicated (all-reduce) path
        split = 1 if world == 2 else 0
        if kind == "llama":
            # per layer: gate and up gather (all_gather_matmul), o_proj and down scatter
            # (matmul_reduce_scatter), each op's backward the other; Q/K/V behind the
            # attention's gather run local GEMMs
            assert res["calls"] == {"all_gather_matmul": LAYERS * 4,
                                    "matmul_reduce_scatter": LAYERS * 4}, res
            want = {"matmul_all_reduce": LAYERS * 2 * (new - split)}
            if split:
                want.update(all_gather_matmul=LAYERS * 2, matmul_reduce_scatter=LAYERS * 2)
        else:
            # per layer: o_proj scatters (its backward gathers); each rank's own tokens go to
            # the experts (dispatch and combine, each one's backward the other)
            assert res["calls"] == {"all_gather_matmul": LAYERS, "matmul_reduce_scatter": LAYERS,
                                    "all_to_all_grouped_mm": LAYERS * 2,
                                    "grouped_mm_all_to_all": LAYERS * 2}, res
            want = {"matmul_all_reduce": LAYERS * (new - split),
                    "all_to_all_grouped_mm": LAYERS * new, "grouped_mm_all_to_all": LAYERS * new}
            if split:
                want.update(matmul_reduce_scatter=LAYERS)
        assert res["generate_calls"] == want, res
        assert res["sharded"][:2] == ["(Shard(dim=0),)", "(Shard(dim=1),)"], res
    elif kind == "llama":
        # forward: o_proj and down_proj all-reduce; backward: the input gradients of q, k, v,
        # gate and up (the rowwise layers' backward is local)
        assert res["calls"] == {"matmul_all_reduce": LAYERS * 7}, res
        assert res["generate_calls"] == {"matmul_all_reduce": LAYERS * 2 * new}, res
        assert res["sharded"] == ["(Shard(dim=0),)", "(Shard(dim=1),)"], res
    else:
        # o_proj forward, q/k/v backward; dispatch and combine forward, each one's backward
        # the other
        assert res["calls"] == {"matmul_all_reduce": LAYERS * 4,
                                "all_to_all_grouped_mm": LAYERS * 2,
                                "grouped_mm_all_to_all": LAYERS * 2}, res
        assert res["generate_calls"] == {"matmul_all_reduce": LAYERS * new,
                                         "all_to_all_grouped_mm": LAYERS * new,
                                         "grouped_mm_all_to_all": LAYERS * new}, res
        assert res["sharded"] == ["(Shard(dim=0),)", "(Shard(dim=1),)", "(Shard(dim=0),)"], res


# W = 2 runs the README's two blocks as written (use_ficco(), the one line); W = 4 the block of
# docs/integrations.md whose plan names ficco's styles (the Llama) and a plan naming them with
# ep_implementation="ficco" (the MoE)
CASES = [(2, "llama", "README.md", "DistributedConfig(tp_size=2))"),
         (2, "mixtral", "README.md", "DistributedConfig(tp_size=2, ep_size=2))"),
         (4, "llama", "docs/integrations.md", "tp_plan=plan"),
         (4, "mixtral", None, "names")]


@pytest.mark.parametrize("world,kind,page,marker", CASES)
def test_tiny_model_trains_and_generates_like_unsharded_on_ficco(world, kind, page, marker,
                                                                 model_dirs):
    how, code = marker, None
    if page is not None:
        how, code = "block", client_pool.client_block(page, marker)
        if page == "README.md":
            assert "ficco.integrations.transformers.use_ficco()" in code
    results = client_pool.pool(world).run(transformers_cases.compare, kind, model_dirs[kind],
                                          how, code, timeout_s=600)
    print(f"W={world} {kind} ({page or how}): {results[0]['worst']}, ficco calls "
          f"{results[0]['calls']}, generate {results[0]['generate_calls']}")
    for res in results:
        _check(res, kind)


# the Llama at W = 4: the block of docs/integrations.md, as written
@pytest.mark.parametrize("world,kind", [(2, "llama"), (4, "llama"), (2, "mixtral"),
                                        (4, "mixtral")])
def test_under_sequence_parallelism_trains_and_generates_like_unsharded(world, kind,
                                                                       model_dirs):
    how, code = ("block", client_pool.client_block("docs/integrations.md",
                                                   "SEQUENCE_PARALLEL_PLAN")) \
        if (world, kind) == (4, "llama") else ("sp", None)
    results = client_pool.pool(world).run(transformers_cases.compare, kind, model_dirs[kind],
                                          how, code, timeout_s=600)
    print(f"W={world} {kind} (sequence parallel): {results[0]['worst']}, ficco calls "
          f"{results[0]['calls']}, generate {results[0]['generate_calls']}")
    for res in results:
        _check(res, kind, world, sp=True)


def test_use_ficco_swaps_the_stock_names_and_restores_them_and_bad_modules_are_refused():
    for out in client_pool.pool(2).run(transformers_cases.registry_case):
        assert out["registered"] == sorted(["ficco_colwise", "ficco_rowwise", *SP_NAMES]) \
            and out["ep"], out
        stock = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel",
                 "ep:auto": "AutoEP", "ep:all_to_all": "AllToAllEP"}
        assert out["before"] == out["off"] == stock, out
        assert out["on"] == {"colwise": "FiccoColwiseParallel", "rowwise": "FiccoRowwiseParallel",
                             "ep:auto": "FiccoEP", "ep:all_to_all": "FiccoEP"}, out
        for name in ("ficco_colwise", "ficco_rowwise"):
            assert f"{name} shards an nn.Linear; Embedding is not one" in out["refusals"][name]
        for name in ("ficco_colwise_sp", "ficco_rowwise_sp", "ficco_colwise_gathered"):
            assert "OwnForward is not one or overrides its forward" in out["refusals"][name], out
        for name, messages in out["kept_own_forward"].items():
            assert len(messages) == 1 and "OwnForward overrides nn.Linear.forward" in \
                messages[0] and "transformers' style" in messages[0], out
        assert "gate_up_proj" in out["refusals"]["ep"] and "'all_to_all'" in \
            out["refusals"]["ep"], out


def test_docstring_examples_run_in_the_client_pool():
    for results in client_pool.pool(2).run(transformers_cases.run_doctests):
        assert all(failed == 0 for _, failed in results), results
        assert sum(attempted for attempted, _ in results) >= 5, results


def test_the_tested_release_is_the_one_installed_and_pinned():
    from importlib import metadata

    import ficco.integrations

    dist, tested, _ = ficco.integrations.CLIENTS["transformers"]
    assert dist == "transformers"
    assert f'"{dist}=={tested}' in (ROOT / "pyproject.toml").read_text()
    assert f"{dist}=={tested}" in (ROOT / "Makefile").read_text()
    assert metadata.version(dist) == tested


def test_imports_without_transformers_and_refuses_clearly(monkeypatch):
    from ficco.errors import BackendUnavailableError

    before = {m for m in sys.modules if m.split(".")[0] == "transformers"}
    module = client_pool.fresh_import(monkeypatch, "ficco.integrations.transformers",
                                      hide="transformers")
    assert {m for m in sys.modules if m.split(".")[0] == "transformers"} <= before
    assert module.transformers_version() is None
    for call in (module.use_ficco, module.register):
        with pytest.raises(BackendUnavailableError, match=re.escape(
                "tested with transformers 5.24.0 (supported: >=5.24,<5.25")):
            call()


@pytest.mark.parametrize("version", ["5.23.1", "5.25.0", "4.57.6"])
def test_refuses_another_release_naming_the_tested_range(monkeypatch, version):
    from ficco.errors import BackendUnavailableError

    module = client_pool.fresh_import(monkeypatch, "ficco.integrations.transformers",
                                      version=version)
    with pytest.raises(BackendUnavailableError) as info:
        module.use_ficco()
    assert f"transformers {version} is installed" in str(info.value)
    assert ">=5.24,<5.25" in str(info.value) and "5.24.0" in str(info.value)
