"""Every relative link in README.md and docs/*.md resolves: the file exists, and a ``#anchor`` names a heading of
that file under GitHub's slug rules (what a reader clicking it on GitHub lands on). Links inside code (fenced
blocks, inline code) are not links and are not checked; web links (http, https, mailto) are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The text with fenced blocks and inline code blanked (their length kept, so offsets stay meaningful)."""
    text = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code spans keep their content, links their text, emphasis
    markers go), lower-cased, every character that is not a letter, digit, space, hyphen or underscore dropped,
    spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*|(?<!\w)_(?!\w))", "", text)
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in ``path``'s prose."""
    text = prose(path.read_text(encoding="utf-8"))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(text)]


def broken(path: Path) -> list[str]:
    out = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            out.append(f"{where}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    assert broken(page) == []


def test_the_slug_rules_match_githubs_on_the_headings_this_repository_has():
    assert slug("What FedSight guarantees") == "what-fedsight-guarantees"
    assert slug("Secure aggregation (SecAgg+)") == "secure-aggregation-secagg"
    assert slug("`fedsight bench`: vectorised training, Flower, and 100,000 clients") == \
        "fedsight-bench-vectorised-training-flower-and-100000-clients"
    assert slug("Reproducibility: what is bit-identical and what is not") == \
        "reproducibility-what-is-bit-identical-and-what-is-not"
    assert slug("Node data (`data-dir`)") == "node-data-data-dir"
    assert slug("Fed3R, personalised FL and OLL") == "fed3r-personalised-fl-and-oll"


def test_the_checker_finds_a_missing_file_a_missing_anchor_and_ignores_code(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path, raising=False)
    (tmp_path / "b.md").write_text("# Title\n\n## Two words\n\n## Two words\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#two-words-1) [x](c.md) [y](b.md#three) [self](#top)\n\n# Top\n"
                    "`[not](a/link.md)`\n```\n[nor](this.md)\n```\n[web](https://example.org/x#y)\n")
    got = broken(page)
    assert [g.split(": ", 1)[1].split(":")[0] for g in got] == ["c.md", "b.md#three"], got


def test_every_registered_dataset_partitioner_and_model_is_on_the_data_page():
    """docs/data_and_models.md names every registered dataset, partitioner and model (the README's old lists
    missed ten of them), and the README's task table every dataset and model: the names a reader looks for."""
    from fedsight.plugins import load_builtin
    from fedsight.registry import DATASETS, MODELS, PARTITIONERS

    load_builtin()
    page = (ROOT / "docs" / "data_and_models.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")

    def names(reg):  # FedSight's own entries (other tests in this process register toy ones)
        return [e.name for e in reg.entries() if getattr(e.factory, "__module__", "").startswith("fedsight.")]

    missing = [f"{reg.kind} {n}" for reg in (DATASETS, MODELS, PARTITIONERS) for n in names(reg) if f"`{n}`" not in page]
    assert missing == [], f"docs/data_and_models.md does not name: {missing}"
    missing = [f"{reg.kind} {n}" for reg in (DATASETS, MODELS) for n in names(reg) if f"`{n}`" not in readme]
    assert missing == [], f"README.md's task table does not name: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_benchmark_and_test_file_named_in_code_exists(page):
    """A path in inline code (`examples/raf.toml`, `benchmarks/drift.py`, `tests/test_kill.py`) names a file of
    the repository; wildcards and placeholders (`examples/*_table.py`, `<name>`) are patterns, not paths."""
    text = page.read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:examples|benchmarks|tests)/[\w./-]+\.(?:toml|py|sh))", text))
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert missing == [], f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    """The README is the way in: a page under docs/ it does not link is a page no reader finds."""
    targets = {(ROOT / t.partition("#")[0]).resolve() for _, t in links(ROOT / "README.md")}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in targets]
    assert orphans == [], f"docs pages the README does not link: {orphans}"
