"""The user docs: every relative link resolves, every #anchor names a heading, README stays short, no diary.

Links are checked in README.md, docs/*.md and benchmarks/README.md: markdown links ``[text](path)``,
``[text](path#anchor)``, ``[text](#anchor)`` and reference definitions ``[label]: path``, outside code blocks and
inline code, read across line breaks as markdown does (a link's text may run over two lines, and its target may start
on the line after the ``(``). A target is relative to the linking file and must exist; an anchor must be the GitHub
slug of a heading (or an explicit ``<a id=...>``/``<a name=...>``) of the target file. http(s) and mailto links are
not checked. A link broken so that it renders as text -- ``[text]`` at a line's end and ``(target)`` at the next
line's start, or a target cut by a line break -- fails.

The same files' prose (outside code blocks, inline code and the table rows of the blocks ``benchmarks/tables.py``
generates) describes the software as it is, not the history of its making: dates, commit hashes, machine letters
("machine C", "H100 B") and diary phrases ("this session", "earlier versions", ...) fail, named by file, line and
phrase. Dates, commits and devices belong in the generated tables' columns, and a measured number that prose quotes
beside a link to those tables must stand in them as quoted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)  # a code span stays within its paragraph
# [text](target "title"): the text may run over line breaks (not over a blank line), the target may start on the
# next line after "(" (markdown allows both).
_LINK_TEXT = r"\[((?:[^\[\]\n]|\n(?![ \t]*\n)|\[[^\]\n]*\])*)\]"
_LINK = re.compile(r"(?<!!)" + _LINK_TEXT + r"\([ \t]*\n?[ \t]*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\([ \t]*\n?[ \t]*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
# Links that render as text: "[text]" ending a line and "(target)" starting the next, or a target cut by a line break.
_SPLIT_LINKS = (
    re.compile(r"(?<!!)" + _LINK_TEXT + r"[ \t]*\n[ \t]*\(([^()\s]+)\)"),
    re.compile(r"(?<!!)" + _LINK_TEXT + r"\(([^()\s]+)[ \t]*\n[ \t]*([^()\s]*)\)"),
)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)  # http:, https:, mailto:, ...
_GENERATED = re.compile(r"<!-- ([a-z]+):start -->(.*?)<!-- \1:end -->", re.DOTALL)  # benchmarks/tables.py's blocks

_MONTHS = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?"
    r"|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
)
_YEAR = r"(?:19|20)\d{2}"
DIARY = {
    "a date": re.compile(
        rf"\b{_YEAR}-[01]\d-[0-3]\d\b|\b{_MONTHS} {_YEAR}\b|\b\d{{1,2}} {_MONTHS} {_YEAR}\b", re.IGNORECASE
    ),
    # 7-40 hex digits with a letter and a digit among them: a commit, not a word ("defaced") or a number (1234567)
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a machine letter": re.compile(r"\b[Mm]achines? [A-Z]\b|\b(?:[ABH]100|[BH]200|GH200|A10G?) [A-Z]\b"),
    "a diary phrase": re.compile(
        r"\bthis (?:session|stop)\b|\b(?:fifth|sixth|fourth|third|second|first|another|a new|next|last) session\b"
        r"|\bearlier versions?\b|\bdid not help\b|\bso far\b|\bin our runs\b|\(today\)"
        r"|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )(?<!\bget )(?<!\bgets )\bused to\b",
        re.IGNORECASE,
    ),
}


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), BENCHMARKS_README]


def _blank(match: re.Match[str]) -> str:
    """A match replaced by spaces of its length, its line breaks kept (line numbers stay right)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose_text(text: str, generated_tables: bool = True) -> str:
    """The text with fenced code blocks and inline code spans blanked (line breaks kept); without
    ``generated_tables``, also the table rows inside the blocks that benchmarks/tables.py generates."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    prose = "\n".join(lines)
    if not generated_tables:
        prose = _GENERATED.sub(
            lambda m: re.sub(r"(?m)^[ \t]*\|.*$", lambda row: " " * len(row.group(0)), m.group(0)), prose
        )
    return _INLINE_CODE.sub(_blank, prose)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    return [(number, line) for number, line in enumerate(prose_text(text).split("\n"), start=1) if line.strip()]


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lowercase, punctuation dropped but '-' and '_', spaces -> '-'."""
    text = re.sub(r"(`+)(.+?)\1", lambda m: m.group(2), heading)
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


def text_links(text: str) -> list[tuple[int, str]]:
    """(line of the link's start, target) of every link, image and reference definition of a markdown text."""
    prose = prose_text(text)
    found = [(line_of(prose, m.start()), m.group(2)) for m in _LINK.finditer(prose)]
    found += [(line_of(prose, m.start()), m.group(1)) for m in _IMAGE.finditer(prose)]
    for number, line in enumerate(prose.split("\n"), start=1):
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return sorted(found)


def split_links(text: str) -> list[tuple[int, str]]:
    """(line, the link as written) of links broken over two lines so that they render as text."""
    prose = prose_text(text)
    found = []
    for pattern in _SPLIT_LINKS:
        for m in pattern.finditer(prose):
            found.append((line_of(prose, m.start()), " ".join(m.group(0).split())))
    return sorted(found)


def links(path: Path) -> list[tuple[int, str]]:
    return text_links(path.read_text(encoding="utf-8"))


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    text = path.read_text(encoding="utf-8")
    for number, written in split_links(text):
        problems.append(f"{path.relative_to(root)}:{number}: {written}: a link split over two lines renders as text")
    for number, target in text_links(text):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not resolved.exists():
            shown = resolved.relative_to(root) if resolved.is_relative_to(root) else resolved
            problems.append(f"{where}: no such file {shown}")
            continue
        if anchor:
            if resolved.is_dir() or resolved.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with the anchor #{anchor} in {resolved.relative_to(root)}")
    return problems


def diary(text: str) -> list[tuple[int, str, str]]:
    """(line, what, phrase) of every dated or diary wording in a markdown text's prose: outside code blocks, inline
    code and the table rows of generated blocks."""
    found = []
    for number, line in enumerate(prose_text(text, generated_tables=False).split("\n"), start=1):
        line = re.sub(r"\]\([^)\s]*\)", "]()", line)  # link targets are paths, not prose (result files are dated)
        for what, pattern in DIARY.items():
            found.extend((number, what, m.group(0)) for m in pattern.finditer(line))
    return found


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_short() -> None:
    count = len(README.read_text(encoding="utf-8").splitlines())
    assert count <= README_MAX_LINES, f"README.md has {count} lines; at most {README_MAX_LINES}: move detail to docs/"


# A measured figure as the tables print it: 87,016 / 19.7% / 2.43 (not integers such as 300 steps or 16 layers).
_FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+\.\d+%?|\d+%)(?![\w.,]*\d)")
_TABLE_LINK = re.compile(r"\]\(\s*(?:\.\./)?(?:benchmarks/)?README\.md#")


def generated_text(paths: list[Path]) -> str:
    """The text of every block benchmarks/tables.py generates in these files."""
    return "".join(m.group(2) for path in paths for m in _GENERATED.finditer(path.read_text(encoding="utf-8")))


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, list item and table row of a markdown text's prose."""
    found: list[tuple[int, str]] = []
    block: list[str] = []
    start = 1
    for number, line in enumerate([*prose_text(text, generated_tables=False).split("\n"), ""], start=1):
        item = re.match(r"^\s*(?:[-*]|\d+\.)\s", line) or line.lstrip().startswith("|")
        if block and (not line.strip() or item):
            found.append((start, "\n".join(block)))
            block = []
        if line.strip():
            if not block:
                start = number
            block.append(line)
    return found


def unquoted_figures(text: str, generated: str) -> list[tuple[int, str]]:
    """(line, figure) of the measured figures in paragraphs that link to the benchmark tables but that the generated
    tables do not hold."""
    found = []
    for start, paragraph in paragraphs(text):
        if not _TABLE_LINK.search(paragraph):
            continue
        prose = re.sub(r"\]\([^)]*\)", "]", paragraph)  # not the link targets
        found += [(start, m.group(1)) for m in _FIGURE.finditer(prose) if m.group(1) not in generated]
    return found


def diary_problems(path: Path, root: Path = ROOT) -> list[str]:
    found = diary(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{number}: {what}: {phrase!r}" for number, what, phrase in found]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_describe_the_software_not_the_history_of_its_making(path: Path) -> None:
    problems = diary_problems(path)
    assert not problems, (
        "dated or diary wording (dates, commits and devices belong in the tables benchmarks/tables.py generates; "
        "say what the software does, in the present tense):\n" + "\n".join(problems)
    )


@pytest.mark.parametrize(
    "path", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_figures_quoted_beside_a_table_link_stand_in_the_tables(path: Path) -> None:
    """Prose that quotes a measured figure and points to the generated tables quotes it as they print it (a table
    regenerated from new rows makes the quote fail until the prose follows)."""
    found = unquoted_figures(path.read_text(encoding="utf-8"), generated_text([README, BENCHMARKS_README]))
    problems = [f"{path.relative_to(ROOT)}:{number}: {figure}" for number, figure in found]
    assert not problems, "figures not in the generated tables (python benchmarks/tables.py --write):\n" + "\n".join(
        problems
    )


def test_the_checker_itself() -> None:
    assert github_slug("The main job: examples/train_lm.py") == "the-main-job-examplestrain_lmpy"
    assert github_slug("fp8 (experimental)") == "fp8-experimental"
    assert github_slug("`MegatronStrategy` options") == "megatronstrategy-options"
    assert github_slug("Preemption: SIGTERM ends every rank") == "preemption-sigterm-ends-every-rank"
    text = "a [x](y.md#z) and `[no](code.md)` and ![img](i.png)\n```\n[no](fenced.md)\n```\n[ref]: r.md\n"
    assert text_links(text) == [(1, "i.png"), (1, "y.md#z"), (5, "r.md")]
    assert _REFERENCE.match("[ref]: r.md").group(1) == "r.md"


def test_links_are_read_across_line_breaks() -> None:
    text = (
        "see the [Hugging Face\n"  # the text over two lines: a link
        "page](hf.md#lora) and [this](\n"  # the target on the next line: a link
        "other.md) and `code [not](a-link.md)\n"  # inline code over two lines
        "still code` and [two\n\nparagraphs](no.md)\n"  # a blank line ends the text: not a link
    )
    assert text_links(text) == [(1, "hf.md#lora"), (2, "other.md")]
    assert split_links(text) == []


def test_a_link_split_so_that_it_renders_as_text_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n")
    page.write_text(
        "Intact: [other](other.md#other).\n"
        "Broken: see [the other\npage]\n(other.md) and [another](other.md#oth\ner) here.\n"
        "A parenthesis that is prose: [a note]\n(see above) stays prose.\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert problems == [
        "page.md:2: [the other page] (other.md): a link split over two lines renders as text",
        "page.md:4: [another](other.md#oth er): a link split over two lines renders as text",
    ], problems


def test_dated_and_diary_wording_is_found_and_named() -> None:
    text = "\n".join(
        [
            "Measured on 2026-12-03 and in Dec 2026, and on 3 December 2026.",  # 1: three dates
            "The first save took 1.6x at 9d2372c (e4f8008+uncommitted).",  # 2: two commits
            "On machine C and on the H100 B it ran slower; machines A and B agree.",  # 3: three machine letters
            "In this session and at this stop, earlier versions of the package did not help so far.",  # 4
            "It used to be slower.",  # 5
            "Fine: `2026-12-03` in code, 0x7fffffff, 1234567 tokens, a defaced word, what is used to build it.",  # 6
            "```",
            "9d2372c in a code block, machine C",  # 8: fenced
            "```",
            "<!-- tables:start -->",
            "| a generated row | 2026-12-07 | 9d2372c | H100 |",  # 11: a generated table row
            "Generated prose on 2026-12-07.",  # 12: generated prose still counts
            "<!-- tables:end -->",
            "| a hand-written row | 2026-12-07 |",  # 14: a table outside the generated blocks counts
            "A [dated file](results/2026-12-07-h100-moe-c.jsonl) is a path, not prose.",  # 15
        ]
    )
    found = [(number, what, phrase) for number, what, phrase in diary(text)]
    assert found == [
        (1, "a date", "2026-12-03"),
        (1, "a date", "Dec 2026"),
        (1, "a date", "3 December 2026"),
        (2, "a commit hash", "9d2372c"),
        (2, "a commit hash", "e4f8008"),
        (3, "a machine letter", "machine C"),
        (3, "a machine letter", "H100 B"),
        (3, "a machine letter", "machines A"),
        (4, "a diary phrase", "this session"),
        (4, "a diary phrase", "this stop"),
        (4, "a diary phrase", "earlier versions"),
        (4, "a diary phrase", "did not help"),
        (4, "a diary phrase", "so far"),
        (5, "a diary phrase", "used to"),
        (12, "a date", "2026-12-07"),
        (14, "a date", "2026-12-07"),
    ], found


def test_a_figure_the_tables_do_not_hold_is_found() -> None:
    generated = "| (a) | 1b | 87,016 | 50.4% | 2.43 |"
    text = (
        "The 1B shape trains at 87,016 tokens/s, 50.4%\nMFU ([table](../benchmarks/README.md#x)).\n\n"
        "- A list item: 2.43 ms against 9.99 ms ([table](../benchmarks/README.md#x)), 300 steps, 16 layers.\n"
        "- An item without a link: 1.23 ms.\n\n"
        "A paragraph quoting 12,345 without a link.\n"
    )
    assert unquoted_figures(text, generated) == [(4, "9.99")]


def test_the_diary_test_names_file_line_and_phrase(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nIt ran on machine C, earlier versions at 9d2372c.\n")
    assert diary_problems(page, root=tmp_path) == [
        "page.md:3: a commit hash: '9d2372c'",
        "page.md:3: a machine letter: 'machine C'",
        "page.md:3: a diary phrase: 'earlier versions'",
    ]
