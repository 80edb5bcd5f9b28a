"""The lint step's function-length check (`make test`): no function or method in the given folders runs over
LIMIT lines, counted by the ast from its `def` (decorators excluded) to its last line. Prints each one over it
and exits 1; silent and 0 otherwise.

    python .ci/function_lengths.py src 80
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def long_functions(folder: Path, limit: int) -> list[tuple[int, str, str]]:
    """(lines, file, name) of every function under `folder` longer than `limit` lines, longest first."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path}:{node.lineno}", node.name))
    return sorted(found, reverse=True)


def main() -> int:
    *folders, limit = sys.argv[1:] or ["src", "80"]
    over = [row for folder in folders for row in long_functions(Path(folder), int(limit))]
    for lines, where, name in over:
        print(f"{where}: {name} is {lines} lines (at most {limit}): split it by meaning")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
