"""Every code block of README.md and docs/*.md that can run on CPU runs, and is right.

```python``` blocks run on 2 CPU ranks of the shared pool (tests/doc_snippets.py says in what
namespace); ```python fragment``` blocks (few: signatures, plans shown with ``...``, the CUDA
graph) have their ``ficco.…`` names and keywords checked; every ``python -m ficco[.bench] VERB
--flag`` the pages name is checked against that verb's parser.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import re

import pytest

import ficco
from tests import doc_snippets
from tests.harness import pool

RUNNABLE = doc_snippets.runnable()


def test_the_pages_have_runnable_blocks_and_few_fragments():
    infos = {b.info for b in doc_snippets.blocks()}
    assert infos <= {"python", "python fragment", "python client", "bash", "text", "diff", ""}, \
        infos
    frags = doc_snippets.fragments()
    assert len(RUNNABLE) >= 12 and len(frags) <= len(RUNNABLE), (len(RUNNABLE), len(frags))
    for marker, _ in doc_snippets.CHECKS:           # a check whose block is gone fails here
        assert any(marker in b.code for b in RUNNABLE), marker


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_block_runs_on_two_cpu_ranks_and_is_right(block):
    results = pool(doc_snippets.W).run(doc_snippets.run_block, block.code, block.where,
                                       timeout_s=60)
    for rank, res in enumerate(results):
        assert all(v is None for v in res["checks"]), (rank, res["checks"])
        if "dist.destroy_process_group()" in block.code:
            assert res["destroyed"], rank


def _resolve(dotted: str):
    obj = ficco
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("block", doc_snippets.fragments(),
                         ids=[b.where for b in doc_snippets.fragments()])
def test_fragment_names_resolve_after_import_ficco_and_take_its_keywords(block):
    names, calls = doc_snippets.fragment_calls(block.code)
    assert names, f"{block.where}: a fragment that names nothing of ficco's"
    for dotted in names:
        _resolve(dotted)                         # AttributeError names what the doc got wrong
    for dotted, keywords in calls:
        params = inspect.signature(_resolve(dotted)).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        unknown = [k for k in keywords if k not in params]
        assert not unknown, f"{block.where}: {dotted} takes no {unknown}"


def _command_lines():
    """(page, verb module, tokens) of every ``-m ficco…`` command the pages show, inline code
    included; backslash continuations joined."""
    out = []
    for page in doc_snippets.PAGES:
        text = page.read_text().replace("\\\n", " ")
        for match in re.finditer(r"-m (ficco(?:\.bench)?)\s+([^`|\n]*)", text):
            tokens = match.group(2).split("#")[0].split()
            out.append((page.name, match.group(1), tokens))
    return out


def _help(module: str, verb: str | None) -> str:
    """What ``python -m MODULE [VERB] --help`` prints (every option string it takes)."""
    if module == "ficco" and verb == "selftest":
        from ficco.selftest import parser

        return parser().format_help()
    if module == "ficco.bench":
        from ficco.bench.__main__ import build_parser

        parser = build_parser(verb)
    else:
        from ficco.__main__ import build_parser

        parser = build_parser()
    if verb is None:
        return parser.format_help()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args([verb, "--help"])
    return out.getvalue()


def test_every_command_the_pages_name_has_its_verb_and_flags():
    lines = _command_lines()
    assert len(lines) >= 20, len(lines)
    for page, module, tokens in lines:
        verb = next((t for t in tokens if not t.startswith("-")), None)
        if verb is not None and not re.fullmatch(r"[a-z][a-z-]*", verb):
            verb = None
        if module == "ficco" and verb not in (None, "demo", "selftest"):
            raise AssertionError(f"{page}: python -m ficco {verb}: no such verb")
        if module == "ficco.bench" and verb is not None:
            from ficco.bench.__main__ import VERBS

            assert verb in VERBS, f"{page}: python -m ficco.bench {verb}: no such verb"
        text = _help(module, verb)
        for flag in (t.split("=")[0] for t in tokens if t.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
                f"{page}: python -m {module} {verb} has no {flag}"


def test_python_m_ficco_version_runs():
    from ficco.__main__ import version

    assert version().splitlines()[0] == f"ficco {ficco.__version__}"
