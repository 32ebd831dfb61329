"""Every bad input gets a clear error (naming the argument, the values and the fix) before
any communication."""
from __future__ import annotations

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
    with pytest.raises(ConfigError, match="unknown ficco setting"):
        with ficco.config.scope(tiemout=2):
            pass


def test_cpu_tensors_with_a_forced_gpu_backend_fail_clearly(monkeypatch):
    monkeypatch.setenv("FICCO_BACKEND", "cuda")
    with pytest.raises(ficco.errors.BackendUnavailableError, match="cuda"):
        ficco.all_gather_matmul(_a(4, 8), _a(8, 3))
