"""Comments explain, BENCHMARKS.md measures: the check .ci/measured_words.py (run by `make test`) passes on src and
names each comment or docstring line that quotes a measured time, ratio, throughput, date or quality."""

from __future__ import annotations

from fixtures.ci_checks import REPO, run_check


def test_src_quotes_no_measurement_and_names_benchmarks_md_at_most_eight_times():
    done = run_check("measured_words.py", str(REPO / "src" / "flowfleet"))
    assert done.returncode == 0 and done.stdout == "", done.stdout


def test_the_check_names_each_measured_line_and_passes_shapes_settings_and_code(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        '"""A module.\n'
        "\n"
        "The step took 0.12 s on one thread.\n"
        "An 8 x 8 latent in 2 x 2 patches, checked every 30 s.\n"
        '"""\n'
        "\n"
        "TIMEOUT_S = 1.5  # seconds a request may wait\n"
        "RATIO = 3.1  # the fleet's share, a setting\n"
        "\n"
        "\n"
        "def f():\n"
        '    """Samples 3-4x faster with spinning threads (2026-11-29)."""\n'
        "    # top-2 classifier FD 51.7 -> 41.7 with the new batch\n"
        '    return "took 5.5 s"  # (a string in code is not prose)\n'
    )
    done = run_check("measured_words.py", str(package))
    assert done.returncode == 1
    assert [line.split(": ", 1)[0] for line in done.stdout.splitlines()] == [
        f"{package / 'm.py'}:{n}" for n in (3, 12, 13)
    ]


def test_more_than_eight_citations_of_benchmarks_md_fail(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("".join(f"X{i} = {i}  # chosen so (BENCHMARKS.md, section {i})\n" for i in range(9)))
    done = run_check("measured_words.py", str(package))
    assert done.returncode == 1 and "9 lines name BENCHMARKS.md (at most 8)" in done.stdout
    (package / "m.py").write_text("".join(f"X{i} = {i}  # chosen so (BENCHMARKS.md, section {i})\n" for i in range(8)))
    assert run_check("measured_words.py", str(package)).returncode == 0
