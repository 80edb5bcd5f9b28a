"""`flowfleet export skypilot`: one task file per training job of a K = 4 run on an object store, accepted
by SkyPilot's own parser (sky.Task.from_yaml, offline, from .venv-skypilot: .ci/install-skypilot)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fixtures.synthetic_run import synthetic_config

from flowfleet.backends.skypilot import SkyPilotOptions, export_skypilot
from flowfleet.cli import main
from flowfleet.errors import FlowfleetError
from flowfleet.storage import RunRoot

SKY_PYTHON = Path(__file__).resolve().parents[1] / ".venv-skypilot" / "bin" / "python"
PARSE = """
import json, sys
import sky
out = []
for path in sys.argv[1:]:
    try:
        t = sky.Task.from_yaml(path)
        out.append({"name": t.name, "nodes": t.num_nodes, "resources": str(t.resources), "run": t.run,
                    "envs": t.envs})
    except Exception as err:
        out.append({"error": f"{type(err).__name__}: {err}"})
print(json.dumps(out))
"""


def sky_parse(*paths) -> list[dict]:
    if not SKY_PYTHON.exists():  # never skipped: make test installs it
        pytest.fail(f"{SKY_PYTHON} missing: run .ci/install-skypilot (make test does)")
    out = subprocess.run([str(SKY_PYTHON), "-c", PARSE, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_k4_run_exports_one_valid_skypilot_task_per_job(s3_url, tmp_path, capsys):
    synthetic_config(k=4).save(RunRoot(s3_url))
    out = tmp_path / "sky"
    assert main(["export", "skypilot", s3_url, str(out), "--accelerators", "A100:1", "--cpus", "8+"]) == 0
    assert "wrote 5 SkyPilot task files" in capsys.readouterr().out
    names = ["expert-0", "expert-1", "expert-2", "expert-3", "router"]
    tasks = sky_parse(*(out / f"{n}.yaml" for n in names))
    for name, t in zip(names, tasks):
        assert "error" not in t, t
        assert t["name"] == f"flowfleet-synthetic-{name}" and t["nodes"] == 1
        assert "A100" in t["resources"] and "cpus=8+" in t["resources"]
        assert t["envs"]["FLOWFLEET_RUN_ROOT"] == s3_url
        assert "torchrun --nnodes=$SKYPILOT_NUM_NODES --node_rank=$SKYPILOT_NODE_RANK" in t["run"]
        assert "--nproc_per_node=${SKYPILOT_NUM_GPUS_PER_NODE:-1}" in t["run"]
    assert f"-m flowfleet.cli train-expert {s3_url} --expert 3" in tasks[3]["run"]
    assert f"-m flowfleet.cli train-router {s3_url}" in tasks[4]["run"]
    launch = (out / "launch.sh").read_text()
    assert launch.count("sky jobs launch -y -n flowfleet-synthetic-") == 5

    # a wrong field in a task file: SkyPilot names it
    bad = tmp_path / "bad.yaml"
    bad.write_text((out / "expert-0.yaml").read_text().replace("num_nodes", "num_nodez"))
    (error,) = sky_parse(bad)
    assert "num_nodez" in error["error"] and "did you mean 'num_nodes'" in error["error"]


def test_skypilot_export_refuses_what_cannot_run_in_one_line(s3_url, tmp_path):
    local = tmp_path / "run"
    synthetic_config(k=2).save(RunRoot(str(local)))
    with pytest.raises(FlowfleetError, match="the run root must be an object store URL"):
        export_skypilot(str(local), str(tmp_path / "out"))
    with pytest.raises(FlowfleetError, match=r"^accelerators: expected NAME\[:COUNT\]"):
        SkyPilotOptions(accelerators="A100:x")
    with pytest.raises(FlowfleetError, match="^cpus: expected a number"):
        SkyPilotOptions(cpus="lots")
    with pytest.raises(FlowfleetError, match="^num_nodes: must be >= 1"):
        SkyPilotOptions(num_nodes=0)
