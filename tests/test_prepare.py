"""Stage `prepare`: the data/ shard contract, resume after interruption, refusing a changed recipe,
and bad input (skipped and listed, empty captions counted, missing sources named)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from fixtures.prepared_runs import images_of, make_run
from PIL import Image

from flowfleet.cli import main
from flowfleet.data.images import open_image, to_tensor
from flowfleet.data.shards import FIELDS, ShardSet
from flowfleet.data.sources import MnistSource, ShapesSource
from flowfleet.errors import FlowfleetError
from flowfleet.stages.prepare import prepare


def png(color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 20), color).save(buf, format="PNG")
    return buf.getvalue()


def images_with_three_bad(tmp_path) -> Path:
    """A folder of 12 PNGs, im02, im05 and im09 corrupt; captions beside those not divisible by 4."""
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(12):
        bad = i in (2, 5, 9)
        (folder / f"im{i:02d}.png").write_bytes(b"corrupt" if bad else png((20 * i, 0, 0)))
        if i % 4:
            (folder / f"im{i:02d}.txt").write_text(f"image {i}")
    return folder


def test_mnist_shards_follow_the_contract(run_root):
    run = make_run(run_root, text="minilm", limit=40, shard_size=16, batch_size=8)
    m = prepare(run, progress=False)
    assert m.complete and m.count == 40 and [s["count"] for s in m.shards] == [16, 16, 8]
    assert m.fields["latents"] == {"shape": [1, 16, 16], "dtype": "float32"}
    assert m.fields["features"] == {"shape": [192], "dtype": "float32"}
    assert m.fields["text_tokens"] == {"shape": [8, 384], "dtype": "float16"}
    assert m.fields["text_mask"] == {"shape": [8], "dtype": "uint8"}
    assert m.fields["text_pooled"] == {"shape": [384], "dtype": "float32"}
    src = MnistSource()
    assert m.extra["source"] == src.fingerprint()
    assert m.extra["encoders"]["semantic"]["name"] == "pixels" and m.extra["encoders"]["text"]["width"] == 384
    assert m.extra["skipped"] == [] and m.extra["skipped_count"] == 0 and m.extra["missing_captions"] == 0

    data, captions = ShardSet(run, "data").load(FIELDS, with_captions=True)
    assert set(data) == set(FIELDS)
    items = list(src.items())[:40]
    assert torch.equal(data["index"], torch.arange(40))
    assert data["labels"].tolist() == [it.label for it in items]
    assert captions == [it.caption for it in items]
    expected = torch.stack([to_tensor(open_image(it.image), 16, 1) for it in items])
    assert torch.equal(data["latents"], expected)  # the pixel latent is the image: PIL's resize, one conversion
    # items 0 and 10 are both "a handwritten digit zero": identical text rows
    assert torch.equal(data["text_pooled"][0], data["text_pooled"][10])
    assert not torch.equal(data["text_pooled"][0], data["text_pooled"][1])
    assert data["text_mask"].sum(1).min() > 2
    assert Image.open(io.BytesIO(run.read_bytes("data", "preview.png"))).size[0] >= 64


def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    kw = dict(base="shapes-tiny", count=50, shard_size=16, batch_size=8)
    whole = make_run(tmp_path / "whole", **kw)
    prepare(whole, progress=False)

    cut = make_run(tmp_path / "cut", **kw)
    real_append = ShardSet.append
    calls = []

    def dying_append(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while encoding the third shard
        return real_append(self, *args, **kwargs)

    monkeypatch.setattr(ShardSet, "append", dying_append)
    with pytest.raises(KeyboardInterrupt):
        prepare(cut, progress=False)
    partial = ShardSet(cut, "data").manifest()
    assert not partial.complete and partial.count == 32 and partial.shards[-1]["source_end"] == 32
    cut.write_bytes(b"half a shard", "data", "shard-00002.safetensors")  # an orphan the manifest never named

    calls.clear()
    monkeypatch.setattr(ShardSet, "append", lambda self, *a, **k: (calls.append(1), real_append(self, *a, **k)))
    m = prepare(cut, progress=False)
    assert len(calls) == 2  # only the 18 missing items were encoded: shards of 16 and 2
    assert m.complete and m.count == 50
    a, ca = ShardSet(whole, "data").load(with_captions=True)
    b, cb = ShardSet(cut, "data").load(with_captions=True)
    assert ca == cb and set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name

    calls.clear()
    assert prepare(cut, progress=False).count == 50 and calls == []  # complete: nothing redone


def test_changed_recipe_is_refused_until_restart(run_root):
    run = make_run(run_root, base="shapes-tiny", count=20, shard_size=8)
    prepare(run, progress=False)
    make_run(run_root, base="shapes-tiny", count=24, shard_size=8)  # the source changed
    with pytest.raises(FlowfleetError, match=r"manifest.json: prepared with a different source.count; .*--restart"):
        prepare(run, progress=False)
    assert prepare(run, restart=True, progress=False).count == 24
    labels = ShardSet(run, "data").load(["labels"])["labels"]
    assert labels.tolist() == [it.label for it in ShardSource24()]


def ShardSource24():
    return ShapesSource(24, 16, 0).items()


def test_bad_images_are_skipped_and_missing_captions_counted(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(4):
        (folder / f"ok{i}.png").write_bytes(png((60 * i, 0, 0)))
        (folder / f"ok{i}.txt").write_text(f"red number {i}")
    (folder / "ok3.txt").unlink()  # one caption missing
    (folder / "broken.png").write_bytes(b"\x89PNG but not really")
    (folder / "empty.jpg").write_bytes(b"")
    run = make_run(tmp_path / "run", base="shapes-tiny", source="folder", path=str(folder), shard_size=2, batch_size=2)
    m = prepare(run, progress=False)
    assert m.count == 4 and m.extra["skipped_count"] == 2 and m.extra["missing_captions"] == 1
    assert sorted(s["key"] for s in m.extra["skipped"]) == ["broken.png", "empty.jpg"]
    assert all(s["reason"] for s in m.extra["skipped"])
    _, captions = ShardSet(run, "data").load(["index"], with_captions=True)
    assert captions == ["red number 0", "red number 1", "red number 2", ""]


def test_only_bad_images_is_an_error(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"junk")
    run = make_run(tmp_path / "run", base="shapes-tiny", source="folder", path=str(folder))
    with pytest.raises(FlowfleetError, match=r"gave no usable item; 1 skipped \(first: a.png"):
        prepare(run, progress=False)


def test_missing_source_is_one_line_naming_it(tmp_path, capsys):
    run = make_run(tmp_path / "run", base="shapes-tiny", source="folder", path=str(tmp_path / "nowhere"))
    with pytest.raises(FlowfleetError, match=f"data.path: {tmp_path / 'nowhere'}: no such folder"):
        prepare(run, progress=False)
    assert main(["prepare", str(tmp_path / "run"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nowhere: no such folder" in err
    assert main(["prepare", str(tmp_path / "no-run")]) == 1
    assert "run.yaml: missing" in capsys.readouterr().err


def test_no_text_encoder_writes_no_text_fields(run_root):
    run = make_run(run_root, base="shapes-tiny", count=10, shard_size=8)
    m = prepare(run, progress=False)
    assert set(m.fields) == {"latents", "features", "labels", "index"}
    assert m.fields["latents"]["shape"] == [3, 16, 16] and m.extra["encoders"]["text"] is None


def test_resume_counts_bad_items_once(tmp_path, monkeypatch):
    kw = dict(
        base="shapes-tiny", source="folder", path=str(images_with_three_bad(tmp_path)), shard_size=3, batch_size=2
    )
    whole = prepare(make_run(tmp_path / "whole", **kw), progress=False)

    run = make_run(tmp_path / "cut", **kw)
    real_append = ShardSet.append
    calls = []

    def dying_append(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_append(self, *args, **kwargs)

    monkeypatch.setattr(ShardSet, "append", dying_append)
    with pytest.raises(KeyboardInterrupt):
        prepare(run, progress=False)
    first = ShardSet(run, "data").manifest()
    assert first.count == 3 and first.extra["skipped_count"] == 1  # im02 lies before the first shard's end
    monkeypatch.setattr(ShardSet, "append", real_append)
    resumed = prepare(run, progress=False)
    assert resumed.count == whole.count == 9
    for key in ("skipped", "skipped_count", "missing_captions"):
        assert resumed.extra[key] == whole.extra[key], key
    assert whole.extra["skipped_count"] == 3 and whole.extra["missing_captions"] == 3  # im00, im04, im08
    assert [s["reason"] for s in whole.extra["skipped"]] == ["not an image in a format PIL can read"] * 3


def test_prepare_and_cluster_on_an_object_store_url():
    """memory:// stands in for s3:// (same fsspec code path: no local paths, atomic single PUTs)."""
    from flowfleet.stages.cluster import cluster

    url = "memory://flowfleet-test-prepare/run"
    run = make_run(url, base="shapes-tiny", count=24, shard_size=8)
    try:
        m = prepare(url, progress=False)
        assert m.count == 24 and run.exists("data", "shard-00002.safetensors")
        report = cluster(url, progress=False)
        assert sum(report["sizes"]) == 24
        assert sum(ShardSet(run, f"partitions/{k}").manifest().count for k in range(3)) == 24
    finally:
        run.remove("", recursive=True)


def shard_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((path / "data").glob("shard-*.safetensors"))}


def test_prepare_in_three_parts_then_merge_gives_the_one_machine_shards(tmp_path, capsys):
    """`prepare --part i/3` on each slice + `--merge 3`: data/ byte for byte a one-machine prepare's, with
    the same manifest entries; a part is resumable; merge refuses a missing part in one line."""
    kw = dict(text="minilm", limit=40, shard_size=16, batch_size=8)
    whole = prepare(make_run(tmp_path / "whole", **kw), progress=False)
    run = make_run(tmp_path / "parts", **kw)
    assert main(["prepare", str(tmp_path / "parts"), "--part", "0/3", "--quiet"]) == 0
    assert main(["prepare", str(tmp_path / "parts"), "--merge", "3", "--quiet"]) == 1
    assert "data-parts/1-of-3/manifest.json: missing or incomplete; run `flowfleet prepare" in capsys.readouterr().err
    for i in (1, 2):
        assert main(["prepare", str(tmp_path / "parts"), "--part", f"{i}/3", "--quiet"]) == 0
    again = prepare(run, progress=False, part=(1, 3))  # a finished part is not encoded again
    assert again.complete and again.extra["recipe"]["part"] == [1, 3, 16, 32]  # slices cut at whole batches
    assert main(["prepare", str(tmp_path / "parts"), "--merge", "3", "--quiet"]) == 0
    assert "prepared 40 items in 3 shards" in capsys.readouterr().out

    merged = ShardSet(run, "data").manifest()
    assert (
        shard_bytes(tmp_path / "parts") == shard_bytes(tmp_path / "whole") and len(shard_bytes(tmp_path / "whole")) == 3
    )
    assert merged.shards == whole.shards and merged.fields == whole.fields and merged.complete
    for key in ("recipe", "source", "encoders", "skipped", "skipped_count", "missing_captions"):
        assert merged.extra[key] == whole.extra[key], key
    assert (tmp_path / "parts" / "data" / "preview.png").read_bytes() == (
        tmp_path / "whole" / "data" / "preview.png"
    ).read_bytes()


def test_prepare_in_parts_as_local_processes_gives_the_one_machine_shards(tmp_path, capsys):
    """`prepare --parts 3`: three processes of `--part i/3` at once, then the merge: data/ byte for byte a one-machine
    prepare's; the parts' runs overlap in time; run again, it encodes nothing and merges the same shards."""
    kw = dict(text="minilm", limit=40, shard_size=16, batch_size=8)
    whole = prepare(make_run(tmp_path / "whole", **kw), progress=False)
    run = make_run(tmp_path / "parts", **kw)
    assert main(["prepare", str(tmp_path / "parts"), "--parts", "3", "--parallel", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "prepared 40 items in 3 shards" in out and all(f"part {i}/3: " in out for i in range(3))
    assert shard_bytes(tmp_path / "parts") == shard_bytes(tmp_path / "whole")
    merged = ShardSet(run, "data").manifest()
    assert merged.shards == whole.shards and merged.fields == whole.fields and merged.complete
    logs = sorted(p.name for p in (tmp_path / "parts" / "data-parts").glob("*.log"))
    assert logs == ["0-of-3.log", "1-of-3.log", "2-of-3.log"]

    from flowfleet.stages.prepare_parts import prepare_in_parts

    again = prepare_in_parts(str(tmp_path / "parts"), 3, parallel=3, progress=False)
    starts, ends = zip(*again.spans.values())
    assert len(starts) == 3 and max(starts) < min(ends)  # all three running at once
    assert shard_bytes(tmp_path / "parts") == shard_bytes(tmp_path / "whole")
    for i in range(3):  # each part's own output, in its log (both runs appended)
        assert (tmp_path / "parts" / "data-parts" / f"{i}-of-3.log").read_text().count(f"prepared part {i}/3") == 2


def test_prepare_parts_refuses_bad_counts_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    make_run(tmp_path / "r", limit=8)
    assert main(["prepare", str(tmp_path / "r"), "--parts", "0", "--quiet"]) == 1
    assert "parts: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "r"), "--parallel", "2", "--quiet"]) == 1
    assert "--parallel: 2 needs --parts N" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "r"), "--backend", "slurm", "--quiet"]) == 1
    assert "--backend: slurm needs --parts N" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "r"), "--parts", "2", "--backend", "ray", "--quiet"]) == 1
    assert "address: the Ray cluster's dashboard URL (http://HEAD:8265) is unknown" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "r"), "--parts", "2", "--backend", "campus", "--quiet"]) == 1
    assert "--backend: unknown 'campus' (known: local, slurm, ray)" in capsys.readouterr().err


def test_parts_with_bad_images_merge_to_the_same_records(tmp_path):
    kw = dict(
        base="shapes-tiny", source="folder", path=str(images_with_three_bad(tmp_path)), shard_size=3, batch_size=2
    )
    whole = prepare(make_run(tmp_path / "whole", **kw), progress=False)
    run = make_run(tmp_path / "parts", **kw)
    for i in range(3):
        prepare(run, progress=False, part=(i, 3))
    from flowfleet.stages.prepare import merge_parts

    merged = merge_parts(run, 3, progress=False)
    assert merged.shards == whole.shards and merged.count == 9
    for key in ("skipped", "skipped_count", "missing_captions"):
        assert merged.extra[key] == whole.extra[key], key
    assert shard_bytes(tmp_path / "parts") == shard_bytes(tmp_path / "whole")


def test_holdout_items_go_to_eval_and_never_into_a_training_shard(tmp_path):
    """data.holdout: the last items of the source are prepared into eval/ (resumable, with the recipe),
    and none of their images is in any shard of data/ — nor in a part that --merge joins."""
    run = make_run(tmp_path / "r", limit=60, holdout=20, shard_size=16, batch_size=8)
    train = prepare(run, progress=False)
    held = ShardSet(run, "eval").manifest()
    assert train.count == 40 and held.count == 20 and held.complete
    assert held.extra["recipe"] == {**train.extra["recipe"], "split": "eval"} and train.extra["recipe"]["holdout"] == 20

    def images(folder: str) -> set[bytes]:
        sset = ShardSet(run, folder)
        return {
            row.numpy().tobytes() for s in sset.manifest().shards for row in sset.read_shard(s["name"])[0]["latents"]
        }

    source = MnistSource()
    expected = {to_tensor(open_image(source.images[i]), 16, 1).numpy().tobytes() for i in range(40, 60)}
    assert images("eval") == expected  # exactly the last 20 items of the 60
    assert not images("eval") & images("data")  # (MNIST-5k has no duplicate digits among these)
    assert prepare(run, progress=False).shards == train.shards  # complete: nothing is encoded again

    parts = make_run(tmp_path / "p", limit=60, holdout=20, shard_size=16, batch_size=8)
    for i in range(2):
        prepare(parts, progress=False, part=(i, 2))
    assert main(["prepare", str(tmp_path / "p"), "--merge", "2", "--quiet"]) == 0
    assert images_of(tmp_path / "p", "data") == images_of(tmp_path / "r", "data")
    assert images_of(tmp_path / "p", "eval") == images_of(tmp_path / "r", "eval")


def test_holdout_that_leaves_nothing_or_has_no_known_length_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(FlowfleetError, match="data.holdout: 40 held-out items leave none of the 40 to train on"):
        prepare(make_run(tmp_path / "a", limit=40, holdout=40), progress=False)
    monkeypatch.setattr(MnistSource, "length", lambda self: None)  # as a tar stream: no length without reading it
    with pytest.raises(FlowfleetError, match="data.holdout: data.source mnist has no known length; give data.limit"):
        prepare(make_run(tmp_path / "b", limit=None, holdout=10), progress=False)
    assert prepare(make_run(tmp_path / "c", limit=30, holdout=10), progress=False).count == 20  # limit: known


def test_a_webdataset_source_of_unknown_length_prepares(tmp_path):
    """A tar stream has no length (Source.length() is None): prepare streams it to the end. (Before, prepare
    asked Python's len() of it and crashed with "__len__() should return >= 0".)"""
    import tarfile

    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for i in range(3):
            for name, data in ((f"s{i}.png", png((80 * i, 0, 0))), (f"s{i}.txt", f"red {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    run = make_run(tmp_path / "r", source="webdataset", path=str(tmp_path / "a.tar"), limit=None)
    assert prepare(run, progress=False).count == 3


def test_repa_tokens_are_the_semantic_feature_map_pooled_to_the_experts_grid(run_root):
    """expert.repa_dim: prepare stores each item's REPA targets, the semantic encoder's feature map pooled to the
    experts' token grid (the pixel features' map is the image itself), in half precision; the recipe names the grid,
    so shards prepared without the tokens are not resumed as if they held them."""
    import torch.nn.functional as F

    from flowfleet.config import RunConfig, load_run_config
    from flowfleet.data.inception import to_rgb

    run = make_run(run_root, limit=12, shard_size=8, batch_size=4)
    prepare(run, progress=False)
    raw = load_run_config(run).to_dict()
    raw["expert"]["repa_dim"] = 3  # the pixels' RGB channels
    cfg = RunConfig.from_dict(raw)
    cfg.save(run)
    with pytest.raises(FlowfleetError, match=r"prepared with a different repa_grid; .*--restart"):
        prepare(run, progress=False)
    m = prepare(run, restart=True, progress=False)
    gh, gw = cfg.expert.grid_size
    assert m.fields["repa_tokens"] == {"shape": [gh * gw, 3], "dtype": "float16"}
    assert m.extra["recipe"]["repa_grid"] == [gh, gw]
    data = ShardSet(run, "data").load(["latents", "repa_tokens"])
    pooled = F.adaptive_avg_pool2d(to_rgb(data["latents"]), (gh, gw)).flatten(2).transpose(1, 2)  # [N, T, 3]
    assert torch.equal(data["repa_tokens"], pooled.half())
