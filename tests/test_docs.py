"""The documentation: a short README, and links between the pages that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def links(page: Path) -> list[str]:
    """Relative link targets of a Markdown page, outside code (which Markdown does not render as links)."""
    text = CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a page: lower case, punctuation dropped, spaces as -."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in found:  # a repeated heading gets -1, -2, ...
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(root)}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_every_relative_link_in_the_readme_and_docs_points_to_an_existing_file_and_heading():
    broken = [problem for page in PAGES for problem in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_notices_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title\n\n## Two words\n\n[ok](#two-words) [ok](a.md#title)\n"
        "[gone](b.md) [no heading](a.md#three) `[code](x)`\n```\n[fenced](y.md)\n```\n"
    )
    assert broken_links(tmp_path / "a.md", tmp_path) == [
        "a.md: b.md (no such file)",
        "a.md: a.md#three (no heading #three in a.md)",
    ]


def test_the_readme_stays_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < 260, f"README.md has {lines} lines; move the detail into docs/ and link it"


def test_the_readme_links_every_page_of_docs():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README's 'Where to read next' does not link: {unlinked}"


def test_the_readme_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "bash run_training.sh --debug" in text and "bash run_tests.sh" in text


def test_every_launcher_option_is_in_the_commands_page():
    from launcher.cli import build_parser

    page = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    options = {s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")}
    # torchrun's underscore spellings are one row with the dashed ones ("dashes or underscores"); --help is argparse's
    missing = sorted(o for o in options - {"--help"} if o not in page and o.replace("_", "-") not in page)
    assert not missing, f"docs/commands.md does not describe {missing}"
