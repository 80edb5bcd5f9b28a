"""The library names its parameters in its errors, the command line says them as flags (flowfleet.errors
.ParameterError, flowfleet.cli.flag_of, and the check .ci/flag_errors.py that `make test` runs)."""

from __future__ import annotations

import pytest
from fixtures.ci_checks import REPO, run_check

from flowfleet.cli import main
from flowfleet.errors import ParameterError


def test_no_library_error_starts_with_a_flag():
    done = run_check("flag_errors.py", str(REPO / "src" / "flowfleet"))
    assert done.returncode == 0 and done.stdout == "", done.stdout


def test_the_check_names_each_library_error_worded_as_a_flag(tmp_path):
    package = tmp_path / "pkg"
    (package / "commands").mkdir(parents=True)
    (package / "lib.py").write_text(
        "def f(n, k):\n"
        "    if n < 1:\n"
        '        raise ValueError(f"--n: must be >= 1, got {n}")\n'
        "    if k:\n"
        '        raise ParameterError("k", "must be 0")\n'
        '    raise RuntimeError("--")\n'
    )
    (package / "commands" / "run.py").write_text('raise SystemExit("--n: the command line may say flags")\n')
    done = run_check("flag_errors.py", str(package))
    assert done.returncode == 1
    lib = package / "lib.py"
    assert done.stdout.splitlines() == [f"{lib}:3: --n: must be >= 1, got ", f"{lib}:6: --"]


def test_a_parameter_error_reads_as_its_parameter_in_the_library_and_as_its_flag_on_the_command_line(tmp_path, capsys):
    err = ParameterError("ref_n", "must be >= 2, got 1")
    assert str(err) == "ref_n: must be >= 2, got 1" and err.as_flag("--ref-n") == "--ref-n: must be >= 2, got 1"
    valued = ParameterError("expert 5", "run.yaml has 2 experts")
    assert str(valued) == "expert 5: run.yaml has 2 experts"
    assert valued.as_flag("--expert") == "--expert 5: run.yaml has 2 experts"
    with pytest.raises(ParameterError, match=r"^set: expected KEY=VALUE"):
        from flowfleet.config import set_dotted

        set_dotted({}, "data.path")
    assert main(["init", str(tmp_path / "r"), "--set", "data.path"]) == 1
    assert capsys.readouterr().err.strip() == (
        "flowfleet init: error: --set: expected KEY=VALUE with a dotted key (e.g. data.path=/my/images), "
        "got 'data.path'"
    )
