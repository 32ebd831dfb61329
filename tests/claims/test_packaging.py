"""What ``pip install`` and a first error show a new user: one version, an SPDX license, an
sdist without a half test tree, GPU-binding extras per CUDA major with a check at backend
start, and errors that say why no GPU backend runs."""
from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch

import ficco

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tarfile.TarFile:
    import os

    from setuptools import build_meta

    out = tmp_path_factory.mktemp("sdist")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        name = build_meta.build_sdist(str(out))
    finally:
        os.chdir(cwd)
    with tarfile.open(out / name) as tar:
        yield tar


def test_sdist_ships_the_library_license_and_no_half_test_tree(sdist):
    names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    assert "LICENSE" in names and "ficco/py.typed" in names
    assert "ficco/heuristics/profiles/h100.json" in names
    tests = [n for n in names if n.startswith("tests/")]
    assert tests == [], f"the sdist ships part of the test tree: {tests}"
    assert not [n for n in names if n.startswith("bench/")]


def test_one_version_and_spdx_license_in_the_metadata(sdist):
    top = sdist.getnames()[0].split("/")[0]
    info = sdist.extractfile(f"{top}/PKG-INFO").read().decode()
    assert f"\nVersion: {ficco.__version__}\n" in info
    assert "\nLicense-Expression: Apache-2.0\n" in info
    assert "Classifier: Typing :: Typed" in info
    assert 'extra == "cuda12"' in info and 'extra == "cuda13"' in info
    assert (REPO / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]


def test_cuda_python_of_another_major_is_named_with_the_extra_to_install():
    from ficco.backends.cuda import cuda_python_mismatch

    assert cuda_python_mismatch("13.0", "13.4.4") is None
    assert cuda_python_mismatch("12.8", None) is None
    message = cuda_python_mismatch("12.8", "13.4.4")
    assert "cuda-python 13.4.4 does not match torch built for CUDA 12.8" in message
    assert "pip install 'ficco[cuda12]'" in message


def test_cuda_backend_start_checks_the_binding_major(monkeypatch):
    from ficco.backends import cuda

    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(cuda, "installed_bindings_version", lambda: "13.4.4")
    reason = cuda.CudaBackend.unavailable_reason()
    assert reason is not None and "ficco[cuda12]" in reason, reason


def test_a_gpu_tensor_under_the_cpu_backend_says_why_no_gpu_backend_runs(monkeypatch):
    from ficco import backends
    from ficco.runtime import call

    monkeypatch.setenv("FICCO_BACKEND", "cpu")
    monkeypatch.setattr(backends, "gpu_reasons",
                        lambda: {"rocm": "this torch is not a ROCm build",
                                 "cuda": "cuda-python is missing (No module named 'cuda')"})
    with pytest.raises(ficco.errors.InvalidArgumentError) as info:
        call.backend_for(torch.empty(2, device="meta"), "a_shard")
    text = str(info.value)
    assert "a_shard is on meta but the active backend 'cpu' runs on cpu" in text
    assert "cuda: cuda-python is missing" in text and "rocm: this torch is not a ROCm" in text


def test_gpu_reasons_are_real_on_this_machine():
    from ficco import backends

    reasons = backends.gpu_reasons()
    if torch.cuda.is_available():
        assert len(reasons) == 1 and backends.unavailable_note() == ""
    else:
        assert set(reasons) == {"rocm", "cuda"} and all(reasons.values())
        assert backends.unavailable_note().startswith("no GPU backend can run here (rocm: ")


def test_readme_starts_with_the_two_commands_ci_runs_and_links_stay_in_the_repo():
    import re

    text = (REPO / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == \
        [["make", "demo"], ["make", "test"]]
    assert "make test" in (REPO / ".ci/run").read_text()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        body = page.read_text()
        assert "../shared" not in body and "seeds/" not in body, page
        for path in re.findall(r"`((?:docs|bench/results|examples)/[\w./-]+)`", body):
            if "<" not in path and "*" not in path and "…" not in path:
                assert (REPO / path).exists(), f"{page.name} cites {path}, which is not here"


def test_submodules_are_reachable_after_import_ficco_and_load_only_when_used():
    import subprocess
    import sys

    code = ("import sys, ficco\n"
            "lazy = ['ficco.float8', 'ficco.rng', 'ficco.bench', 'ficco.torchtitan', "
            "'ficco.parallel', 'ficco.moe']\n"
            "print(sorted(m for m in lazy if m in sys.modules))\n"
            "print(ficco.float8.all_gather_matmul.__name__, ficco.rng.ShardRNG.__name__, "
            "ficco.parallel.ColwiseParallel.__name__, ficco.moe.MoELayer.__name__)\n"
            "try:\n    ficco.no_such_module\nexcept AttributeError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "[]", out                  # import ficco loads none of them
    assert out[1] == "all_gather_matmul ShardRNG ColwiseParallel MoELayer", out
    assert out[2] == "module 'ficco' has no attribute 'no_such_module'", out


def test_version_names_ficco_torch_triton_and_the_bindings():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ficco", "--version"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == f"ficco {ficco.__version__}"
    assert out[1].startswith(f"torch {torch.__version__} (")
    assert [line.split()[0] for line in out[2:]] == ["Triton", "cuda-bindings", "hip-python",
                                                     "torchtitan", "transformers",
                                                     "megatron-core"], out
