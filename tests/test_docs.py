"""The user docs: every relative link resolves, every #anchor names a heading, README stays short, no diary.

Links are checked in README.md, docs/*.md and benchmarks/README.md: markdown links ``[text](path)``,
``[text](path#anchor)``, ``[text](#anchor)`` and reference definitions ``[label]: path``, outside code blocks and
inline code. A target is relative to the linking file and must exist; an anchor must be the GitHub slug of a heading
(or an explicit ``<a id=...>``/``<a name=...>``) of the target file. http(s) and mailto links are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
README_MAX_LINES = 300
DIARY_PHRASES = ("in our runs", "this session", "fifth session", "(today)")

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), BENCHMARKS_README]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lowercase, punctuation dropped but '-' and '_', spaces -> '-'."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: heading slugs (repeats get -1, -2, ... as on GitHub) and HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for pattern in (_LINK, _IMAGE):
            found.extend((number, target) for target in pattern.findall(line))
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
            problems.append(f"{where}: no such file {shown}")
            continue
        if anchor:
            if resolved.is_dir() or resolved.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with the anchor #{anchor} in {resolved.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_short() -> None:
    count = len(README.read_text(encoding="utf-8").splitlines())
    assert count <= README_MAX_LINES, f"README.md has {count} lines; at most {README_MAX_LINES}: move detail to docs/"


@pytest.mark.parametrize(
    "path", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_docs_describe_the_software_not_the_history_of_its_making(path: Path) -> None:
    text = path.read_text(encoding="utf-8").lower()
    found = [phrase for phrase in DIARY_PHRASES if phrase in text]
    assert not found, f"{path.relative_to(ROOT)} reads as a lab notebook: {found}"


def test_the_checker_itself() -> None:
    assert github_slug("The main job: examples/train_lm.py") == "the-main-job-examplestrain_lmpy"
    assert github_slug("fp8 (experimental)") == "fp8-experimental"
    assert github_slug("`MegatronStrategy` options") == "megatronstrategy-options"
    assert github_slug("Preemption: SIGTERM ends every rank") == "preemption-sigterm-ends-every-rank"
    text = "a [x](y.md#z) and `[no](code.md)` and ![img](i.png)\n```\n[no](fenced.md)\n```\n[ref]: r.md\n"
    assert [target for _, line in prose_lines(text) for target in _LINK.findall(line)] == ["y.md#z"]
    assert _REFERENCE.match("[ref]: r.md").group(1) == "r.md"
