"""The docs' path check (`make test`): every repository path that README.md, BENCHMARKS.md and docs/*.md name exists.

A repository path is a link target (`[text](docs/x.md)`, read from the page's folder) or a word in backticks, less
anything from `:` or `#` on (`file.py:42`), whose first part is a top-level entry git tracks (`src/`,
`benchmarks/x.py`, `Makefile`), or a module or folder of the package (`flow/path.py`, `stages/evaluate/`: the docs name
them from src/flowfleet/). Run folders (`runs/demo/model`, `data/manifest.json`), commands and URLs are not.
Prints one line per path that does not exist, `FILE:LINE: PATH`, and exits 1; silent and 0 otherwise.

    python .ci/doc_paths.py README.md BENCHMARKS.md docs
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path("src/flowfleet")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
PATHLIKE = re.compile(r"[\w.-]+(/[\w.*-]*)*")


def roots(repo: Path) -> tuple[set[str], set[str]]:
    """The top-level entries git tracks (not a run folder a user made there) and the package's."""
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout
    top = {line.split("/", 1)[0] for line in tracked.splitlines()}
    package = {p.name for p in (repo / PACKAGE).iterdir() if not p.name.startswith("__")}
    return top, package


def candidates(line: str) -> list[tuple[str, bool]]:
    """(path, is a link) of every link target and backticked word of a line, in order, cut at its first ':' or '#'."""
    found = [(m.start(), m.group(1), True) for m in LINK.finditer(line)]
    found += [(m.start(), m.group(1), False) for m in CODE.finditer(line)]
    return [
        (re.split(r"[:#]", text, maxsplit=1)[0], link)
        for _, text, link in sorted(found)
        if not (link and ("://" in text or text.startswith(("#", "mailto:"))))
    ]


def missing(page: Path, repo: Path) -> list[str]:
    """`PAGE:LINE: PATH` for each repository path the page names that does not exist."""
    top, package = roots(repo)
    out = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for text, link in candidates(line):
            if not text or not PATHLIKE.fullmatch(text) or "*" in text:
                continue
            first = text.split("/", 1)[0]
            if link:
                target = (page.parent / text).resolve()
                exists = target.exists()
            elif first in top and ("/" in text or "." in text):
                exists = (repo / text).exists()
            elif first in package and text.endswith((".py", "/")):  # (a run folder's data/, backends/... are not)
                exists = (repo / PACKAGE / text).exists()
            else:
                continue
            if not exists:
                out.append(f"{page}:{number}: {text}")
    return out


def pages(args: list[str]) -> list[Path]:
    found = []
    for arg in args:
        path = Path(arg)
        found += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return found


def main() -> int:
    repo = Path.cwd()
    bad = [
        line for page in pages(sys.argv[1:] or ["README.md", "BENCHMARKS.md", "docs"]) for line in missing(page, repo)
    ]
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
