"""Comments explain, BENCHMARKS.md measures (`make test`): no comment or docstring in src/flowfleet quotes a measured
time, speed-up, ratio or date, and few name BENCHMARKS.md.

The rule, on the text of comments and docstrings only (code, its literals and its settings are not read):
  - a time with decimals ("0.12 s", "1.5 min"), or any time a measurement verb is near ("took 264 s", "in 7 min");
  - a ratio or speed-up ("1.56x", "3-4x", "6x less", "1.07x the monolith"; a shape "8 x 8" is none);
  - a throughput ("107 GFLOP/s", "183 samples/s");
  - a date (2026-11-29);
  - a measured share ("slowed by 23 %", "57 % faster");
  - a measured quality, spread or change ("classifier FD 43.8", "± 0.3", "51.7 -> 41.7").
A default chosen by measurement names its BENCHMARKS.md section in one line; at most MAX_CITATIONS lines of src do.
Prints `FILE:LINE: TEXT` for each line that breaks the rule and exits 1; silent and 0 otherwise.

    python .ci/measured_words.py src/flowfleet
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

MAX_CITATIONS = 8
TIME = r"(?:s|ms|µs|us|sec|seconds?|min|minutes?|h|hours?)\b"
MEASURED = [
    re.compile(rf"\b\d+\.\d+\s?{TIME}"),  # a time with decimals
    re.compile(rf"\b(?:took|takes|taking|measured|in|after|ran|runs)\s(?:about\s|~)?\d+(?:\.\d+)?\s?{TIME}"),
    re.compile(r"\b\d+\.\d+\s?[x×](?![\w])(?!\s\d)"),  # a ratio with decimals ("1.56x"; not "8 x 8")
    re.compile(r"\b\d+[-–]\d+\s?[x×](?![\w])"),  # a range of ratios ("3-4x")
    re.compile(r"\b\d+\s?[x×]\s(?:faster|slower|cheaper|dearer|less|fewer|more|lower|higher|the)\b"),  # "6x less"
    re.compile(r"\b\d+(?:\.\d+)?\s?(?:[GTM]FLOP/s|samples/s|images/s|steps/s|it/s)"),  # a throughput
    re.compile(r"(?<![\w-])20\d\d-\d\d-\d\d(?![\w-])"),  # a date (not one inside a file's name)
    re.compile(r"\b\d+(?:\.\d+)?\s?%\s(?:faster|slower|more|less|of its time|lower|higher)"),  # a measured share
    re.compile(r"\b(?:faster|slower|slowed|sped up)\sby\s\d"),
    re.compile(r"(?:±|\+-)\s?\d"),  # a measured spread
    re.compile(r"\b\d+\.\d+\s?(?:->|→|vs\.?|against)\s?\d+\.\d+"),  # a measured change ("51.7 -> 41.7")
    re.compile(r"\b(?:FD|FID|NMI|accuracy|loss)\s(?:of\s)?\d+\.\d+"),  # a measured quality
]
CITATION = re.compile(r"BENCHMARKS\.md")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a module."""
    source = path.read_text()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                for i, text in enumerate(first.value.value.splitlines()):
                    out.append((first.lineno + i, text))
    return sorted(out)


def main(package: str) -> int:
    bad, citations = [], []
    for path in sorted(Path(package).rglob("*.py")):
        for line, text in prose_lines(path):
            if any(p.search(text) for p in MEASURED):
                bad.append(f"{path}:{line}: {text.strip()[:100]}")
            if CITATION.search(text):
                citations.append(f"{path}:{line}: {text.strip()[:100]}")
    for entry in bad:
        print(entry)
    if len(citations) > MAX_CITATIONS:
        print(f"{len(citations)} lines name BENCHMARKS.md (at most {MAX_CITATIONS}):")
        for entry in citations:
            print(f"  {entry}")
    return 1 if bad or len(citations) > MAX_CITATIONS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "src/flowfleet"))
