"""Every bad input gets a clear error (naming the argument, the values and the fix) before
any communication."""
from __future__ import annotations

import itertools

import pytest
import torch

import ficco
from ficco.errors import ConfigError, InvalidArgumentError


def _a(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("args, kwargs, match", [
    ((_a(8), _a(8, 3)), {}, r"at least 2 dims.*\(8,\)"),
    ((_a(4, 8), _a(7, 3)), {}, r"b has 7 rows but a_shard has K=8"),
    ((_a(4, 8), [_a(8, 3), _a(6, 2)]), {}, r"b\[1\] has 6 rows but a_shard has K=8"),
    ((_a(4, 8), _a(8, 3, dtype=torch.float64).to(torch.float16)), {}, r"float16 but a_shard is"),
    ((_a(4, 8), []), {}, r"empty list"),
    ((_a(4, 8), _a(8)), {}, r"2-D \(K, n\) tensor"),
    ((_a(4, 8), "w"), {}, r"2-D \(K, n\) tensor"),
    (("a", _a(8, 3)), {}, r"a_shard must be a torch.Tensor"),
    ((_a(4, 8), _a(8, 3)), {"gather_dim": 1}, r"last \(K\) dimension"),
    ((_a(2, 4, 8), _a(8, 3)), {"gather_dim": 5}, r"out of range.*use 0 … 1"),
    ((_a(4, 8), _a(8, 3)), {"schedule": "fastest"}, r"unknown (all_gather_matmul )?schedule 'fastest'.*serial"),
    ((_a(4, 8), _a(8, 3)), {"group": 3}, r"group must be a torch.distributed ProcessGroup"),
    ((_a(4, 8).to(torch.int32), _a(8, 3).to(torch.int32)), {}, r"dtype torch.int32 is not supported"),
    ((_a(4, 0), _a(0, 3)), {}, r"K=0"),
])
def test_bad_arguments_raise_clear_errors(args, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ficco.all_gather_matmul(*args, **kwargs)


def test_unknown_group_name():
    with pytest.raises(InvalidArgumentError, match="names no process group"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3), "no-such-group")


def test_bad_env_values_list_the_valid_ones(monkeypatch):
    monkeypatch.setenv("FICCO_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match="auto, dma, ccl"):
        ficco.config.transport()
    monkeypatch.setenv("FICCO_TRANSPORT", "auto")
    monkeypatch.setenv("FICCO_SCHEDULE", "nope")   # schedule names depend on the op: at call
    with pytest.raises(ConfigError, match="FICCO_SCHEDULE='nope'.*valid schedules: serial"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3))
    monkeypatch.setenv("FICCO_TIMEOUT", "-3")
    with pytest.raises(ConfigError, match="FICCO_TIMEOUT"):
        ficco.config.timeout_s()
    monkeypatch.setenv("FICCO_BACKEND", "tpu")
    with pytest.raises(ConfigError, match="cpu, cuda, rocm"):
        ficco.config.backend()


def test_env_is_read_when_used_and_scope_overrides(monkeypatch):
    monkeypatch.setenv("FICCO_TIMEOUT", "7.5")
    assert ficco.config.timeout_s() == 7.5
    with ficco.config.scope(timeout=2):
        assert ficco.config.timeout_s() == 2
    assert ficco.config.timeout_s() == 7.5
    with pytest.raises(ConfigError, match="unknown ficco setting"), ficco.config.scope(tiemout=2):
        pass


def test_cpu_tensors_with_a_forced_gpu_backend_fail_clearly(monkeypatch):
    monkeypatch.setenv("FICCO_BACKEND", "cuda")
    with pytest.raises(ficco.errors.BackendUnavailableError, match="cuda"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3))


# -- Small validation gaps ------------------------------------------------------------
def test_gather_dim_must_be_an_integer_not_a_bool():
    with pytest.raises(InvalidArgumentError, match="bool"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3), gather_dim=True)


def test_numpy_integers_are_dimensions():
    import numpy as np

    a, b = _a(2, 3, 8), _a(8, 5)
    out = ficco.all_gather_matmul(a, b, gather_dim=np.int64(1))
    assert torch.allclose(out.double(), a.double() @ b.double(), atol=1e-4)


def test_b_without_columns_gives_an_empty_result_like_torch():
    a = _a(4, 8)
    out = ficco.all_gather_matmul(a, torch.empty(8, 0))
    assert out.shape == (4, 0)


def test_plan_cache_is_bounded():
    from ficco import ops
    from ficco.plan.problem import Problem
    from ficco.runtime import path as runtime
    from ficco.runtime import session

    spec = ops.get("all_gather_matmul")
    ficco.shutdown()
    kept = ficco.session_of()          # (no group here: a world of one's session)
    for m in range(session.PLANS_KEPT + 40):
        runtime.plan_for(spec, "ring", "dma", Problem(m + 1, 8, (4,), "float32", 2),
                         session=kept)
    assert len(kept.plans) == session.PLANS_KEPT


def test_every_env_value_is_checked_before_any_communication(monkeypatch):
    for name, bad in [("FICCO_TIMEOUT", "soon"), ("FICCO_COPY_ENGINES", "0"),
                      ("FICCO_PROFILE", "no-such-gpu"), ("FICCO_SELECTOR", "fastest"),
                      ("FICCO_TOPOLOGY", "ring"), ("FICCO_LOG", "loud"),
                      ("FICCO_POISON", "maybe"), ("FICCO_PAPER_LOW", "-1"),
                      ("FICCO_AUTO", "sometimes")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=name if name != "FICCO_PROFILE" else "no-such-gpu"):
            ficco.all_gather_matmul(_a(4, 8), _a(8, 3))
        monkeypatch.delenv(name)


_fresh = itertools.count()


def test_an_unknown_ficco_variable_is_warned_about_once(monkeypatch):
    from ficco.errors import FiccoWarning

    # a name this process has not warned about yet (the warning is once per process)
    misspelt = f"FICCO_SCHEDUEL{next(_fresh)}"
    monkeypatch.setenv(misspelt, "ring")
    with pytest.warns(FiccoWarning, match=rf"{misspelt} .*did you mean FICCO_SCHEDULE"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3))   # once
        monkeypatch.setenv("FICCO_TEST_ANYTHING", "1")   # the harness's own: no warning
        ficco.all_gather_matmul(_a(4, 8), _a(8, 4))


@pytest.mark.parametrize("name, raw, read", [
    ("FICCO_SCHEDULE", "Ring", "ring"), ("FICCO_SELECTOR", "MODEL", "model"),
    ("FICCO_BACKEND", "CPU", "cpu"), ("FICCO_TRANSPORT", "CCL", "ccl"),
    ("FICCO_TUNE_CANDIDATES", "Serial,RING", ("serial", "ring")),
    ("FICCO_LOG", "INFO", "info"), ("FICCO_AUTO", "UpFront", "upfront")])
def test_every_named_setting_is_read_in_any_case(monkeypatch, name, raw, read):
    from ficco import config

    monkeypatch.setenv(name, raw)
    assert config.get(name) == read


def test_a_timeout_beyond_what_threading_waits_is_a_config_error(monkeypatch):
    monkeypatch.setenv("FICCO_TIMEOUT", "1e10")
    with pytest.raises(ConfigError, match=r"FICCO_TIMEOUT.*TIMEOUT_MAX"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3))


def test_log_level_accepts_upper_case(monkeypatch):
    monkeypatch.setenv("FICCO_LOG", "INFO")
    assert ficco.config.log_level() == "info"


def _zero_rows_between_ordinary_calls(rank, world, seed):
    """Both ops, zero-row shards (M = 0 on every rank) between ordinary calls, default
    settings (auto transport, default selector): torch gives an empty (0, n) result."""
    import random

    from ..reference import max_row_rel_err

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for call in range(12):
        rows = 0 if call % 3 else rng.randrange(1, 6)
        k, n = 16, rng.choice((3, 5))
        shards = [torch.randn(rows, k, generator=gen) for _ in range(world)]
        b = torch.randn(k, n, generator=gen)
        full = torch.cat(shards).double()
        try:
            gathered, got = ficco.all_gather_matmul(shards[rank], b, return_gathered=True)
            ag = (tuple(got.shape), tuple(gathered.shape), got.dtype,
                  max_row_rel_err(got, full @ b.double()) if rows else 0.0)
        except Exception as exc:  # noqa: BLE001 - the test reports every kind
            ag = f"{type(exc).__name__}: {exc}"
        # matmul_reduce_scatter: every rank's (world*rows, k) @ b_r summed, row block r.
        parts = [torch.randn(world * rows, k, generator=gen) for _ in range(world)]
        bs = [torch.randn(k, n, generator=gen) for _ in range(world)]
        total = sum(p.double() @ q.double() for p, q in zip(parts, bs))
        try:
            got = ficco.matmul_reduce_scatter(parts[rank], bs[rank])
            rs = (tuple(got.shape), got.dtype, max_row_rel_err(
                got, total[rank * rows:(rank + 1) * rows]) if rows else 0.0)
        except Exception as exc:  # noqa: BLE001
            rs = f"{type(exc).__name__}: {exc}"
        out.append((rows, n, ag, rs))
    ficco.shutdown()
    return out


def test_zero_row_shards_on_every_rank_give_an_empty_result_like_torch():
    import random

    from .. import harness

    world = 2
    results = harness.pool(world).run(_zero_rows_between_ordinary_calls,
                                      random.randrange(1 << 30))
    for rank_rows in results:
        for rows, n, ag, rs in rank_rows:
            assert not isinstance(ag, str) and not isinstance(rs, str), rank_rows
            assert ag[:3] == ((world * rows, n), (world * rows, 16), torch.float32), rank_rows
            assert rs[:2] == ((rows, n), torch.float32), rank_rows
            assert ag[3] <= 1e-4 and rs[2] <= 1e-4, rank_rows
