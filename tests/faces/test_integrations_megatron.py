"""Megatron-core's GPT ``TransformerLayer`` (local spec, no Transformer Engine) with its linears
on ficco through ``ficco.integrations.megatron.use_ficco(spec)``: W = 2 and 4 CPU ranks,
sequence parallelism on and off, float64, output, input gradient and every parameter gradient
(after Megatron's own gradient finalization) against the unsharded layer, ficco's ops counted;
the README's line as written; the release check.

Needs the megatron-core release pyproject's ``megatron`` extra pins (``make test`` installs
it). What the CPU ranks change in Megatron (tests/megatron_cases.py): its attention's score
buffer and dropout RNG fork, both CUDA-only, are held on the CPU.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from .. import client_pool, megatron_cases

pytest.importorskip("megatron.core", reason="megatron-core is a test extra (pip install -e "
                                            "'.[megatron]'; make test installs it)")

TOL = 1e-12
ROOT = Path(__file__).parents[2]


def _check(res, sp):
    assert max(res["worst"].values()) < TOL, res
    assert res["classes"] == ["FiccoColumnParallelLinear", "FiccoRowParallelLinear"], res
    if sp:
        # one layer: linear_qkv and fc1 gather, linear_proj and fc2 scatter; each op's
        # backward is the other
        assert res["calls"] == {"all_gather_matmul": 4, "matmul_reduce_scatter": 4}, res
        assert res["sp_marked"] == ["input_layernorm.bias", "input_layernorm.weight",
                                    "mlp.linear_fc2.bias", "pre_mlp_layernorm.bias",
                                    "pre_mlp_layernorm.weight", "self_attention.linear_proj.bias"]
    else:
        # linear_proj and fc2 all-reduce forward; linear_qkv's and fc1's input gradients
        assert res["calls"] == {"matmul_all_reduce": 4}, res
        assert res["sp_marked"] == [], res


# "readme": the README's line as written (use_ficco on the local spec)
@pytest.mark.parametrize("world,sp,spec", [(2, True, "readme"), (2, False, "by_hand"),
                                           (4, True, "by_hand"), (4, False, "use_ficco")])
def test_gpt_layer_matches_unsharded_with_every_tp_gemm_on_ficco(world, sp, spec):
    code = client_pool.readme_block("ficco.integrations.megatron.use_ficco(") \
        if spec == "readme" else None
    results = client_pool.pool(world).run(megatron_cases.layer_case, sp, 30 + world, spec, code,
                                          timeout_s=600)
    print(f"W={world} sequence_parallel={sp} ({spec}): {results[0]['worst']}, ficco calls "
          f"{results[0]['calls']}")
    for res in results:
        _check(res, sp)


def test_the_tested_release_is_the_one_installed_and_pinned():
    from importlib import metadata

    import ficco.integrations

    dist, tested, _ = ficco.integrations.CLIENTS["megatron"]
    assert dist == "megatron-core"
    assert f'"{dist}=={tested}' in (ROOT / "pyproject.toml").read_text()
    assert f"{dist}=={tested}" in (ROOT / "Makefile").read_text()
    assert metadata.version(dist) == tested


def test_imports_without_megatron_and_refuses_clearly(monkeypatch):
    import sys

    from ficco.errors import BackendUnavailableError

    before = {m for m in sys.modules if m.split(".")[0] == "megatron"}
    module = client_pool.fresh_import(monkeypatch, "ficco.integrations.megatron",
                                      hide="megatron")
    assert {m for m in sys.modules if m.split(".")[0] == "megatron"} <= before
    assert module.megatron_core_version() is None
    with pytest.raises(BackendUnavailableError, match=re.escape(
            "tested with megatron-core 0.16.1 (supported: >=0.16,<0.17")):
        module.use_ficco(object())
    with pytest.raises(BackendUnavailableError, match="megatron-core is not installed"):
        module.FiccoColumnParallelLinear       # noqa: B018 - the lazy class refuses too


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0"])
def test_refuses_another_release_naming_the_tested_range(monkeypatch, version):
    from ficco.errors import BackendUnavailableError

    module = client_pool.fresh_import(monkeypatch, "ficco.integrations.megatron",
                                      version=version)
    with pytest.raises(BackendUnavailableError) as info:
        module.use_ficco(object())
    assert f"megatron-core {version} is installed" in str(info.value)
    assert ">=0.16,<0.17" in str(info.value) and "0.16.1" in str(info.value)
