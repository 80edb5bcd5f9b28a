"""Your own images, as the README's five lines take them: a folder of PNGs with transparency and a captions.jsonl
whose labels are names, `init --preset images --set data.path=...`, prepare (transparent pixels white, no field a
folder does not need), cluster (a partition under cluster.min_share refused in one line, or balanced)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from flowfleet.cli import main
from flowfleet.config import RunConfig, load_run_config
from flowfleet.data.shards import ShardSet
from flowfleet.errors import FlowfleetError
from flowfleet.stages.cluster import cluster
from flowfleet.stages.prepare import prepare
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small models on a shared 2-core box

# small and fast: pixel features, pixels as the latent, tiny models (the preset's own are for 2 cores and minutes)
SMALL = [
    "encoders.semantic={name: pixels, image_size: 8}",
    "encoders.latent={name: pixels}",
    "data.image_size=16",
    "expert.input_size=[16, 16]",
    "expert.in_channels=3",
    "expert.patch_size=4",
    "router.input_size=[16, 16]",
    "router.in_channels=3",
    "router.patch_size=4",
    "cluster.k=2",
    "router.num_outputs=2",
    "cluster.fine_k=4",
    "data.shard_size=8",
    "data.batch_size=8",
]


def png_folder(folder, reds: int = 11, blues: int = 1) -> None:
    """`reds` red discs and `blues` blue squares on transparent backgrounds (RGBA, and a palette PNG with a
    transparent index), with captions.jsonl naming each and labelling it by name."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(reds + blues):
        rgba = np.zeros((24, 24, 4), dtype=np.uint8)
        if i < reds:
            yy, xx = np.mgrid[:24, :24]
            rgba[(yy - 12) ** 2 + (xx - 12) ** 2 < (5 + i % 4) ** 2] = [200, 30, 30, 255]
            label, text = "disc", f"a red disc number {i}"
        else:
            rgba[4:20, 4:20] = [20, 40, 220, 255]
            label, text = "square", f"a blue square number {i}"
        img = Image.fromarray(rgba, "RGBA")
        if i % 2:  # every other one a palette PNG whose transparent index is the background
            img = img.quantize(colors=4)
            img.save(folder / f"{i:02d}.png", transparency=int(np.asarray(img)[0, 0]))
        else:
            img.save(folder / f"{i:02d}.png")
        rows.append({"file": f"{i:02d}.png", "text": text, "label": label})
    (folder / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def init(run, folder, *sets: str) -> RunRoot:
    args = ["init", str(run), "--preset", "images", "--set", f"data.path={folder}"]
    for s in (*SMALL, *sets):
        args += ["--set", s]
    assert main(args) == 0
    return RunRoot(str(run))


def test_a_folder_of_transparent_pngs_prepares_with_white_backgrounds(tmp_path):
    png_folder(tmp_path / "pngs")
    root = init(tmp_path / "run", tmp_path / "pngs")
    saved = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert saved["data"]["source"] == "folder" and saved["data"]["count"] is None  # nothing a folder does not use
    assert saved["encoders"]["semantic"] == {"name": "pixels", "path": None, "image_size": 8}  # --set reached it
    manifest = prepare(root, progress=False)
    assert manifest.count == 12 and manifest.extra["label_names"] == ["disc", "square"]
    sset = ShardSet(root, "data")
    latents = torch.cat([sset.read_shard(s["name"])[0]["latents"] for s in manifest.shards])  # pixels: [12, 3, 16, 16]
    assert torch.equal(latents[:, :, 0, 0], torch.ones(12, 3))  # every transparent corner is white, both PNG kinds
    assert (latents[:11, 0, 8, 8] > 0.5).all() and (latents[:11, 2, 8, 8] < -0.5).all()  # the discs stay red


def test_a_cluster_under_the_floor_takes_its_nearest_fine_clusters_or_is_refused_in_one_line(tmp_path):
    png_folder(tmp_path / "pngs", reds=20, blues=1)  # k-means puts the one blue square in a partition of its own
    # two fine clusters (the square, the discs): nothing can fill the square's partition
    root = init(tmp_path / "run", tmp_path / "pngs", "cluster.fine_k=2", "cluster.min_share=0.2")
    prepare(root, progress=False)
    with pytest.raises(FlowfleetError) as err:
        cluster(root, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and re.search(r"cluster \d holds 1 of 21 items \(4.8%\), under cluster.min_share 0.2", msg)
    assert msg.endswith(
        "more fine clusters (cluster.fine_k) can fill it, or set cluster.balance: true, or fewer partitions (cluster.k)"
    )
    assert not root.exists("clusters") and not root.exists("partitions")  # refused before anything was written
    # with more fine clusters the square's partition takes the discs nearest it, up to the floor
    raw = load_run_config(root).to_dict()
    raw["cluster"]["fine_k"] = 8
    RunConfig.from_dict(raw).save(root)
    report = cluster(root, progress=False)
    assert min(report["sizes"]) >= 0.2 * 21 and report["label_names"] == ["disc", "square"]
    assert any("took the fine clusters nearest them" in note for note in report["notes"])


def test_init_set_names_a_bad_assignment(tmp_path, capsys):
    assert main(["init", str(tmp_path / "r"), "--preset", "images", "--set", "data.path"]) == 1
    assert "--set: expected KEY=VALUE" in capsys.readouterr().err
    assert main(["init", str(tmp_path / "r"), "--preset", "images", "--set", "cluster.k=three"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cluster.k" in err
