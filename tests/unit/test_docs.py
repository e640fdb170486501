"""The README and the pages under docs/: every relative link and every ``#anchor`` resolves,
and the README stays a short front page.

Links are read as GitHub renders them: fenced code blocks and inline code hold no links,
http(s) and other ``scheme:`` links are not checked, a path is relative to the page that holds
it, and an anchor must be the slug of a heading of the target page (lowercase, spaces to ``-``,
punctuation other than ``-`` and ``_`` removed; the second of two equal headings gets ``-1``,
the third ``-2``)."""

import re
from pathlib import Path
from typing import Dict, List
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README] + DOCS
README_MAX_LINES = 300

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose_blocks(text: str) -> List[str]:
    """The page's paragraphs outside fenced code blocks (a code span never crosses a blank line)."""
    blocks, current, fence = [], [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            blocks.append("\n".join(current))
            current = []
        elif line.strip():
            current.append(line)
        else:
            blocks.append("\n".join(current))
            current = []
    blocks.append("\n".join(current))
    return [b for b in blocks if b]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), heading)
    text = _LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> List[str]:
    """Every heading's anchor on a page, duplicates numbered as GitHub numbers them."""
    seen: Dict[str, int] = {}
    found = []
    for block in _prose_blocks(text):
        for line in block.splitlines():
            m = _HEADING.match(line)
            if not m:
                continue
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.append(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> List[str]:
    """Every link target on a page, outside code."""
    targets = []
    for block in _prose_blocks(text):
        targets += [m.group(2) for m in _LINK.finditer(_CODE_SPAN.sub("", block))]
    return targets


def broken_links(page: Path, root: Path = ROOT) -> List[str]:
    """What is wrong with each relative link of ``page``, one message per broken link."""
    problems = []
    for target in links(page.read_text()):
        if not target or _SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if root.resolve() not in dest.parents and dest != root.resolve():
            problems.append(f"{target}: {dest} is outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: {dest.relative_to(root.resolve())} does not exist")
        elif anchor:
            if dest.suffix != ".md" or not dest.is_file():
                problems.append(f"{target}: an anchor into {dest.name}, which is not a Markdown page")
            elif anchor not in anchors(dest.read_text()):
                problems.append(f"{target}: no heading of {dest.relative_to(root.resolve())} "
                                f"has the anchor #{anchor}")
    return problems


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_there_are_docs_pages():
    assert len(DOCS) >= 10, DOCS


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    problems = broken_links(page)
    assert not problems, f"{_name(page)} has broken links:\n  " + "\n  ".join(problems)


def test_the_readme_is_a_short_front_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to a page "
        "under docs/ and link to it")


def test_the_readme_links_every_docs_page():
    targets = {t.partition("#")[0] for t in links(README.read_text())}
    missing = [_name(p) for p in DOCS if _name(p) not in targets]
    assert not missing, f"README.md does not link these pages: {missing}"


@pytest.mark.parametrize("heading, expected", [
    ("Several processes (torchrun + FSDP2)", "several-processes-torchrun--fsdp2"),
    ("A pretrained model on this CPU: SmolLM2-135M-Instruct",
     "a-pretrained-model-on-this-cpu-smollm2-135m-instruct"),
    ("8-layer model (`--cpu-large`), interleaved (2026-12-02)",
     "8-layer-model---cpu-large-interleaved-2026-12-02"),
    ("One prefill per group (`share_group_prefill`, 2026-12-02)",
     "one-prefill-per-group-share_group_prefill-2026-12-02"),
    ("Differences from torchtune's recipe", "differences-from-torchtunes-recipe"),
    ("See [the plan](plan.md) *now*", "see-the-plan-now"),
])
def test_slugs_follow_githubs_rules(heading, expected):
    assert slug(heading) == expected


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Part\n\n## Part\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md), [fine](other.md#part-1), [fine](#page), [web](https://example.com/x.md)\n"
        "[missing file](nothere.md) and [missing anchor](other.md#part-2)\n"
        "![missing image](nothere.png), [outside](../../outside.md)\n\n"
        "`[in code](nothere.md)` is code, and so is this block:\n\n"
        "```\n[in a block](nothere.md)\n# not a heading\n```\n\n"
        "[not a heading](#not-a-heading)\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(":")[0] for p in problems] == [
        "nothere.md", "other.md#part-2", "nothere.png", "../../outside.md", "#not-a-heading"], problems


# Figures: every ratio and every decimal time the README and the docs state is a quote of
# benchmarks/RESULTS.md, where the dated measurements live.

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
_NUMBER = r"\d+(?:\.\d+)?"
# A number, or a range of two, directly before an "x" that ends a word.
_RATIO = re.compile(rf"(?<![\w.\-]){_NUMBER}(?:-{_NUMBER})?x\b")
# A number with a decimal point, or a range of two, then a space and a unit of time.
_DECIMAL = r"\d+\.\d+"
_TIME = re.compile(rf"(?<![\w.\-])({_DECIMAL})(?:-({_DECIMAL}))? (?:s|ms|min)\b")
_NUMBER_TOKEN = re.compile(rf"(?<![\w.]){_NUMBER}(?![\w]|\.\d)")

# (page, figure) pairs that are not measurements, each with its reason.
NOT_MEASUREMENTS = {
    # none yet: a figure that is a setting, not a measurement, goes here with its reason
}


def stated_figures(text: str) -> List[str]:
    """The ratios and decimal times a page states in its prose (code and code spans left out)."""
    found = []
    for block in _prose_blocks(text):
        prose = _CODE_SPAN.sub(" ", block)
        found += [m.group(0) for m in _RATIO.finditer(prose)]
        found += [m.group(0) for m in _TIME.finditer(prose)]
    return found


def unquoted_figures(text: str, results: str) -> List[str]:
    """The figures of ``text`` that ``results`` does not state.

    A ratio is a number or a range of two numbers written directly before an ``x`` that ends a
    word: ``1.74x``, ``1.07-1.16x``, ``2x``. Hex (``0x1f``: its ``x`` does not end a word) and
    products written with spaces (``16 x 49152``) are not ratios. It holds when RESULTS.md states
    the same ratio written the same way (RESULTS' ratios are read with the same pattern, so
    ``2x`` is not found inside ``1.2x`` and ``1.16x`` not inside ``1.07-1.16x``).

    A decimal time is a number with a decimal point, or a range of two, followed by a space and
    ``s``, ``ms`` or ``min``: ``61.7 s``, ``2.152-2.386 s``, ``14.42 ms``, ``8.1 min``. Whole
    seconds (``435 s``) are not checked. It holds when each of its numbers appears in RESULTS.md
    as a whole number token (its tables give seconds in columns headed ``(s)``, without a unit
    after each cell); ``8.59`` is not found inside ``8.591`` or ``18.59``.
    """
    ratios = {m.group(0) for m in _RATIO.finditer(results)}
    numbers = {m.group(0) for m in _NUMBER_TOKEN.finditer(results)}
    missing = []
    for figure in stated_figures(text):
        if figure.endswith("x"):
            if figure not in ratios:
                missing.append(figure)
        elif not all(n in numbers for n in re.findall(_DECIMAL, figure)):
            missing.append(figure)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_every_figure_is_a_quote_of_results(page):
    """Each ratio and decimal time on the page appears in benchmarks/RESULTS.md (see
    ``unquoted_figures`` for what counts and what matches): RESULTS holds the dated
    measurements, the README and the docs quote them, so no page keeps a second version."""
    missing = [f for f in unquoted_figures(page.read_text(), RESULTS.read_text())
               if (_name(page), f) not in NOT_MEASUREMENTS]
    assert not missing, (
        f"{_name(page)} states figures benchmarks/RESULTS.md does not: {missing}. Quote "
        "RESULTS' figure and link its dated section, add a ratio RESULTS' own figures give to "
        "that section (saying how it follows), or drop the figure")


def test_a_figure_results_does_not_state_is_found():
    results = ("| row | step (s) |\n| --- | ---: |\n| a | 8.591 |\n\n"
               "1.74x [1.65-2.90], the layers 1.07-1.16x, a goal of 3x, 61.7 s, 0x1f\n")
    page = ("The step is 1.74x (8.591 s), where 1.7x, 1.16x and 2x are not stated, nor 8.59 s "
            "or 61.70 s; 3x is the goal and 1.07-1.16x the range; 0x1f is hex, `9.9x` code, "
            "16 x 49152 a shape, 435 s whole seconds.\n\n```\n7.7x in a block\n```\n")
    assert unquoted_figures(page, results) == ["1.7x", "1.16x", "2x", "8.59 s", "61.70 s"]
