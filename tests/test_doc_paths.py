"""The docs' path check (.ci/doc_paths.py, run by `make test`): every repository path the docs name exists."""

from __future__ import annotations

from fixtures.ci_checks import run_check


def test_every_path_the_readme_and_docs_name_exists():
    done = run_check("doc_paths.py", "README.md", "BENCHMARKS.md", "docs")
    assert done.returncode == 0 and done.stdout == "", done.stdout


def test_a_path_that_does_not_exist_is_a_line_naming_the_page_and_the_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "The trainer lives in `train/loop.py` and `src/flowfleet/train/`; the report in `evaluate/report/`.\n"
        "Gone: `stages/admit.py` `Gate`, `benchmarks/nothing_here.py:12` and [a page](missing.md).\n"
        "Not repository paths: `runs/demo/model`, `data/manifest.json`, `flowfleet demo`, [site](https://x.org/a).\n"
    )
    done = run_check("doc_paths.py", str(page))
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"{page}:2: stages/admit.py",
        f"{page}:2: benchmarks/nothing_here.py",
        f"{page}:2: missing.md",
    ]
