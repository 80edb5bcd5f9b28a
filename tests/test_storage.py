"""RunRoot: atomic writes, retries of transient errors, and the same API on S3 (moto on 127.0.0.1)."""

from __future__ import annotations

import os

import pytest
import torch

from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import load_model, save_model
from flowfleet.storage import RunRoot, with_retries


def test_json_yaml_and_listing(tmp_path):
    root = RunRoot(tmp_path)
    root.write_json({"a": 1}, "x", "a.json")
    root.write_yaml({"b": [1, 2]}, "x", "b.yaml")
    assert root.read_json("x", "a.json") == {"a": 1}
    assert root.read_yaml("x", "b.yaml") == {"b": [1, 2]}
    assert root.ls("x") == ["a.json", "b.yaml"] and root.ls("nothing") == []
    (tmp_path / "x" / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        root.read_json("x", "bad.json")


def test_copy_folder_copies_every_file_and_the_manifests_last(tmp_path, monkeypatch):
    src, dst = RunRoot(tmp_path / "a"), RunRoot(tmp_path / "b")
    files = {("d", "manifest.json"): b"m", ("d", "s-0.safetensors"): b"0", ("d", "sub", "manifest.json"): b"n",
             ("d", "sub", "z.bin"): b"z", ("other", "x"): b"x"}  # fmt: skip
    for rel, data in files.items():
        src.write_bytes(data, *rel)
    written = []
    write = RunRoot.write_bytes
    monkeypatch.setattr(RunRoot, "write_bytes", lambda self, data, *rel: (written.append(rel), write(self, data, *rel)))
    dst.copy_folder(src, "d")
    assert {rel: dst.read_bytes(*rel) for rel in written} == {r: v for r, v in files.items() if r[0] == "d"}
    assert [r[-1] for r in written[-2:]] == ["manifest.json", "manifest.json"]  # a complete set only at the end
    assert not dst.exists("other")


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    root = RunRoot(tmp_path)
    root.write_bytes(b"old", "f.bin")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        root.write_bytes(b"new-and-longer", "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_retries_transient_errors_then_gives_up():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset by peer")
        return "ok"

    assert with_retries(flaky, what="read x", base_delay=0.001) == "ok" and len(calls) == 3
    with pytest.raises(OSError, match="read y: failed after 2 attempts"):
        with_retries(lambda: (_ for _ in ()).throw(TimeoutError("slow")), what="read y", attempts=2, base_delay=0.001)
    with pytest.raises(FileNotFoundError):  # not transient: no retry
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), what="read z")


@pytest.mark.parametrize("error", [PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError])
def test_permanent_errors_fail_at_once_naming_the_path(error):
    from flowfleet.storage import is_transient

    calls = []

    def refused():
        calls.append(1)
        raise error("Access Denied")

    with pytest.raises(error, match="write s3://bucket/run/x.json: Access Denied"):
        with_retries(refused, what="write s3://bucket/run/x.json", base_delay=0.001)
    assert len(calls) == 1 and not is_transient(error("x"))
    assert all(is_transient(e) for e in (ConnectionResetError("reset"), TimeoutError(), OSError(5, "EIO")))


def test_append_line(tmp_path):
    root = RunRoot(tmp_path)
    root.append_line('{"step": 1}', "job", "metrics.jsonl")
    root.append_line('{"step": 2}', "job", "metrics.jsonl")
    assert (tmp_path / "job" / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}']


def test_s3_round_trip_of_files_and_models(s3_url, tmp_path):
    root = RunRoot(f"{s3_url}/run")
    assert not root.is_local
    root.write_json({"k": 3}, "a", "b.json")
    root.append_line("one", "log.txt")
    root.append_line("two", "log.txt")
    assert root.read_json("a", "b.json") == {"k": 3}
    assert root.read_bytes("log.txt") == b"one\ntwo\n"
    assert root.ls("a") == ["b.json"] and root.url_of("a").startswith("s3://")

    model = DiTExpert.from_dit_config(DiTConfig(size="tiny/2", input_size=(8, 8), in_channels=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_model(model, root, "experts", "0", "final")
    loaded = load_model(DiTExpert, root, "experts", "0", "final")
    x, t = torch.randn(2, 1, 8, 8), torch.rand(2)
    with torch.no_grad():
        assert torch.equal(model(x, t), loaded(x, t))
    assert sorted(root.ls("experts", "0", "final")) == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_storage_block_of_run_yaml_applies_to_every_write(s3_url, s3_endpoint):
    """run.yaml's `storage` block (endpoint_url, options) wins over the machine's AWS environment, for
    the run root and for its model/ folder; explicit storage_options win over both."""
    import boto3

    machine = RunRoot(f"{s3_url}/run")  # reads and writes through AWS_ENDPOINT_URL (127.0.0.1)
    assert machine.storage_options == {"endpoint_url": s3_endpoint}
    same_server = s3_endpoint.replace("127.0.0.1", "localhost")
    machine.write_yaml(
        {
            "name": "run",
            "storage": {
                "endpoint_url": same_server,
                "options": {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}},
            },
        },
        "run.yaml",
    )

    for root in (RunRoot(f"{s3_url}/run"), RunRoot(f"{s3_url}/run/model")):
        assert root.storage_options["endpoint_url"] == same_server
        assert root.fs.endpoint_url == same_server
        root.write_json({"k": 1}, "written.json")
        key = root.path("written.json").split("/", 1)[1]
        head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(Bucket=s3_url[5:], Key=key)
        assert head.get("ServerSideEncryption") == "AES256"

    explicit = RunRoot(f"{s3_url}/run", storage_options={"endpoint_url": s3_endpoint})
    assert explicit.storage_options == {"endpoint_url": s3_endpoint}
    explicit.write_json({"k": 2}, "plain.json")
    key = explicit.path("plain.json").split("/", 1)[1]
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(Bucket=s3_url[5:], Key=key)
    assert head.get("ServerSideEncryption") is None


@pytest.mark.parametrize("where", ["local", "s3"])
def test_create_bytes_writes_once_whoever_races(where, tmp_path, request):
    """One of the writers racing on a name wins (a hard link on a disk, a conditional PUT on S3); the others leave
    its bytes as they are, and no temporary file stays."""
    import threading

    url = str(tmp_path / "root") if where == "local" else f"{request.getfixturevalue('s3_url')}/root"
    root = RunRoot(url)
    won: list[int] = []
    go = threading.Barrier(4)

    def race(i: int) -> None:
        go.wait()
        if RunRoot(url).create_bytes(f"writer {i}".encode(), "rounds", "decision.json"):
            won.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert root.read_bytes("rounds", "decision.json") == f"writer {won[0]}".encode()
    assert not root.create_bytes(b"late", "rounds", "decision.json")
    assert root.read_bytes("rounds", "decision.json") == f"writer {won[0]}".encode()
    assert root.ls("rounds") == ["decision.json"]
