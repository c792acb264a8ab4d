"""The user documentation: README.md, CHANGELOG.md and docs/.

The README is for ComfyUI users: short, with its known limits in a few lines. None of the user
documentation names development rounds or tracker numbers, and every relative link in it points
at a file of this repository.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

README_MAX_LINES = 250
KNOWN_LIMITS_MAX_LINES = 15
# "session 12", "sessions 30-44", "issue 11", "issue #3", stage names such as "s43a".
DIARY = re.compile(r"\bsessions? [0-9]|\bissues? #?[0-9]|\b(?-i:s[0-9]{2}[a-z])\b", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code (a `kernel[grid](...)` is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [line for line in lines[start + 1:end] if line.strip()]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_sections_for_users():
    text = README.read_text(encoding="utf-8")
    for title in ("Speed-up to expect", "Install", "Wiring the nodes", "What the settings mean",
                  "Troubleshooting", "Known limits", "For contributors"):
        assert f"\n## {title}\n" in text, f"README.md lacks the section {title!r}"
    limits = _section(text, "Known limits")
    assert len(limits) <= KNOWN_LIMITS_MAX_LINES, f"Known limits has {len(limits)} lines"
    contributors = "\n".join(_section(text, "For contributors"))
    assert "bash tests/run.sh" in contributors and "install.py --venv .venv --demo" in contributors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_diary(path):
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if DIARY.search(line)]
    assert not hits, "development-round or tracker numbers:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(path):
    missing = []
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            missing.append(target)
    assert not missing, f"links to files that do not exist: {missing}"
