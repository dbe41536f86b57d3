"""The README is an entrance and docs/ is the reference: README.md stays short and opens with the
two commands, every relative link in README.md and docs/*.md reaches a file (and a heading, when
it names one), every docs page is linked from README.md, and the code's pointers into the docs
(`docs/<page>.md, "Section"`) name pages and sections that exist. Pure text: cheap."""

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

README_MAX_LINES = 300
TWO_COMMANDS = ["bash setup/quickstart.sh", "bash setup/test.sh"]
# Where code and tests point readers at a page, and at a section of it.
POINTER_ROOTS = ("lingua", "apps", "tests", "setup", "benchmarks", "configs")


def without_code(text: str) -> str:
    """The markdown outside fenced blocks and inline code spans (links there are not links)."""
    text = re.sub(r"(?ms)^```.*?^```[^\n]*$", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces and
    hyphens kept; inline code keeps its text), spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list:
    """The page's headings, in order (none from inside fenced blocks)."""
    text = re.sub(r"(?ms)^```.*?^```[^\n]*$", "", path.read_text())
    return re.findall(r"(?m)^#{1,6} +(.+?) *#*$", text)


def anchors(path: Path) -> set:
    """The anchors GitHub gives the page's headings (a repeated one gets -1, -2, ...)."""
    seen, out = {}, set()
    for heading in headings(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> list:
    """'target: why' for each relative link of `page` that reaches no file or no heading."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):                       # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    return problems


def docs_pages() -> list:
    return sorted((REPO / "docs").glob("*.md"))


def test_the_readme_is_short_and_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: it is the entrance (the two "
        f"commands, what lingua is, the layout, one example per app, links); move reference text "
        f"to the docs/ page of its topic")
    body = [line for line in lines if line.strip()]
    assert body[0].startswith("# "), "README.md starts with its title"
    assert body[1] == "```bash", "the first thing under the title is the commands' ```bash block"
    end = body.index("```", 2)
    commands = [line.split("#", 1)[0].strip() for line in body[2:end]]
    assert commands == TWO_COMMANDS, f"README.md's first block is {commands}, not {TWO_COMMANDS}"


@pytest.mark.parametrize("page", [REPO / "README.md", *docs_pages()], ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in
              re.findall(r"\]\(([^)\s]+)\)", without_code((REPO / "README.md").read_text()))}
    missing = [p.name for p in docs_pages() if p.resolve() not in linked]
    assert len(docs_pages()) >= 10 and not missing, f"docs pages README.md does not link: {missing}"


def test_pointers_from_code_name_pages_and_sections_that_exist():
    """`docs/training.md, "Loss spikes"` in an error message or a docstring: the page exists and
    has that section (or one whose heading starts with it); a page named alone exists."""
    problems = []
    pointer = re.compile(r"""(docs/[\w.-]+\.md|README(?:\.md)?)(?:,|\s)\s*\(?\\?["']"""
                         r"""([^"'\\\n]+)\\?["']""")
    files = [p for root in POINTER_ROOTS for p in (REPO / root).rglob("*")
             if p.suffix in (".py", ".sh", ".yaml") and "__pycache__" not in p.parts]
    checked = 0
    for path in files:
        for page in set(re.findall(r"docs/[\w.-]+\.md", path.read_text())):
            if not (REPO / page).is_file():
                problems.append(f"{path.relative_to(REPO)} names {page}, which does not exist")
        for page, section in pointer.findall(path.read_text()):
            page = "README.md" if page.startswith("README") else page
            target = REPO / page
            checked += 1
            if not target.is_file():
                problems.append(f"{path.relative_to(REPO)} names {page}, which does not exist")
            elif not any(h == section or h.startswith(section + ":") for h in headings(target)):
                problems.append(f"{path.relative_to(REPO)} names {page}, \"{section}\": no such "
                                f"section (its headings: {headings(target)})")
    assert checked >= 3, "the pointer pattern no longer finds the code's pointers into docs/"
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_broken_link_and_anchor(tmp_path):
    """The link check against a page whose answers are known: a heading's GitHub anchor, a missing
    file, a missing anchor, and a link inside code that is not a link."""
    assert slug("Fine-tuning (apps/sft)") == "fine-tuning-appssft"
    assert slug("A bigger fork: apps/deepseek") == "a-bigger-fork-appsdeepseek"
    assert slug("Sync vs `checkpoint.async_save`") == "sync-vs-checkpointasync_save"
    (tmp_path / "other.md").write_text("# Other\n\n## Twice\n\n## Twice\n\n"
                                       "```\n## Not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#twice-1) [ok](#here) [gone](missing.md) [bad](other.md#nope)\n"
                    "[code](other.md#not-a-heading) `[span](nowhere.md)` [web](https://x.org/a)\n"
                    "## Here\n```\n[fenced](nowhere.md)\n```\n")
    found = broken_links(page)
    assert [f.split(":")[0] for f in found] == ["missing.md", "other.md#nope",
                                                "other.md#not-a-heading"], found
