"""The docs cite what exists: every repository path named in README.md, BENCHMARKS.md and docs/*.md (tests/...,
src/..., scripts/..., examples/..., benchmarks/..., docs/...) and every relative markdown link resolves; the
README stays a newcomer's page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# docs/benchmark-log.md is history: it names files as they were when it was measured
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmark-log.md")]
PATH = re.compile(r"(?<![\w/.-])((?:tests|src|scripts|examples|benchmarks|docs)/[\w./-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def cited(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text()
    paths = [(p, ROOT / p) for p in PATH.findall(text) if "*" not in p]
    links = [(p, (doc.parent / p)) for p in LINK.findall(text) if not p.startswith(("http://", "https://"))]
    return paths + links


def test_every_cited_path_exists():
    missing = [f"{doc.relative_to(ROOT)}: {name}" for doc in DOCS for name, path in cited(doc)
               if not path.resolve().exists() and not path.with_suffix("").exists()]
    assert not missing, "cited but missing:\n" + "\n".join(missing)


def test_readme_is_a_newcomers_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "deep sections belong in docs/"
    for command in ("bash scripts/train.sh", "bash scripts/test.sh"):
        assert command in readme
