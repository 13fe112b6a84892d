"""Every fenced ```python block of README.md, docs/index.md and docs/guides/*.md runs as printed.

Each block is executed in a fresh namespace (``exec``) in a temporary working directory, so files
it writes do not land in the checkout. A block is skipped or marked slow by an HTML comment on
the line right before its fence (invisible in the rendered docs)::

    <!-- snippet: skip (needs a CUDA device) -->
    <!-- snippet: slow (trains DeepAR, ~1 min) -->
    <!-- snippet: long (a Lightning run of several minutes) -->

Skipped blocks must say why; slow blocks run with ``-m slow``; long blocks are slow and also
marked ``long`` (left out of ``.ci/run``'s budget; ``-m long`` runs them). Blocks in one file do not share
names: each must be complete on its own (imports included).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "docs" / "index.md",
             *sorted((ROOT / "docs" / "guides").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
_MARK = re.compile(r"<!--\s*snippet:\s*(?P<kind>skip|slow|long)\s*(?:\((?P<reason>[^)]*)\))?\s*-->")


def extract_snippets(path: Path) -> list[dict]:
    """The ```python blocks of ``path``: code (dedented), first line number, skip/slow mark."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m.group("indent"), i + 1
        j = start
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[start:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = _MARK.search(lines[k]) if k >= 0 else None
        out.append({"file": path.relative_to(ROOT).as_posix(), "line": start + 1,
                    "code": "\n".join(body) + "\n",
                    "kind": mark.group("kind") if mark else None,
                    "reason": (mark.group("reason") or "").strip() if mark else ""})
        i = j + 1
    return out


SNIPPETS = [s for path in DOC_FILES for s in extract_snippets(path)]


def _param(snippet: dict):
    marks = []
    if snippet["kind"] == "skip":
        marks.append(pytest.mark.skip(reason=snippet["reason"] or "marked skip without reason"))
    elif snippet["kind"] == "slow":
        marks.append(pytest.mark.slow)
    elif snippet["kind"] == "long":  # slow, and left out of .ci/run's budget (run: -m long)
        marks += [pytest.mark.slow, pytest.mark.long]
    return pytest.param(snippet, marks=marks, id=f"{snippet['file']}:{snippet['line']}")


def test_snippets_were_found():
    assert len(SNIPPETS) >= 20
    for s in SNIPPETS:  # a skip needs a reason the reader can see
        assert s["kind"] != "skip" or s["reason"], f"{s['file']}:{s['line']} skip without reason"


@pytest.mark.parametrize("snippet", [_param(s) for s in SNIPPETS])
def test_snippet_runs(snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    code = compile(snippet["code"], f"{snippet['file']}:{snippet['line']}", "exec")
    namespace = {"__name__": "__snippet__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(code, namespace)  # noqa: S102 - documentation snippets from this repository
    try:
        import matplotlib.pyplot as plt

        plt.close("all")
    except ImportError:  # pragma: no cover
        pass
