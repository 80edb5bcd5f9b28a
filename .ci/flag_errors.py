"""The library's errors name its parameters, not command-line flags (`make test`): no exception raised in
src/flowfleet outside the command line (commands/, cli.py) has a message that starts with "--". A library function
raises flowfleet.errors.ParameterError("ref_n", ...), which the command line says as the flag that set it.

Reads each module's syntax tree: a call of a name ending in Error (or Exception) whose first argument is a string or
f-string starting with "--". Prints `FILE:LINE: MESSAGE` for each and exits 1; silent and 0 otherwise.

    python .ci/flag_errors.py src/flowfleet
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

COMMAND_LINE = ("commands", "cli.py")  # where a message may speak of flags: the parsers and their commands


def first_text(node: ast.expr) -> str | None:
    """The literal start of a string or f-string argument (None for anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def flag_errors(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        text = first_text(node.args[0])
        if name.endswith(("Error", "Exception")) and text is not None and text.startswith("--"):
            out.append((node.lineno, text))
    return sorted(out)


def main(package: str) -> int:
    bad = 0
    for path in sorted(Path(package).rglob("*.py")):
        if any(part in COMMAND_LINE for part in path.relative_to(package).parts):
            continue
        for line, text in flag_errors(path):
            print(f"{path}:{line}: {text.splitlines()[0][:80]}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "src/flowfleet"))
