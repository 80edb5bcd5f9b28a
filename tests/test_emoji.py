"""The built-in emoji (flowfleet.data.sources.emoji): the conversion of a tiny fake tarball of each style (an RGBA
PNG and a palette PNG with a transparent index), CLDR captions with their skin tones, the refusal of a changed
tarball, the one-line fallback without npm, the held-out tail disjoint from training and from the judge's images,
the licences and attribution carried into every prepared run; and the emoji judge's reading of a prompt."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.emoji_packages import ENTRIES, TONES, fake_packages

from flowfleet.cli import main
from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSet
from flowfleet.data.sources import SourceError, build_source
from flowfleet.data.sources.emoji import (
    CACHE_FILE,
    NOTICE_FILE,
    EmojiArt,
    EmojiNotFetched,
    EmojiSet,
    convert_emoji,
    fetch_emoji,
    load_emoji,
)
from flowfleet.evaluate.emoji import EmojiJudge, TrainSettings
from flowfleet.presets import preset
from flowfleet.stages.prepare import merge_parts, prepare
from flowfleet.storage import RunRoot

HELD_OUT = 6
IMAGES_PER_STYLE = len(ENTRIES) + len(TONES)  # every emoji, and Santa's five skin tones


@pytest.fixture
def emoji_cache(tmp_path, monkeypatch) -> tuple[EmojiSet, dict[str, Path], tuple[EmojiArt, ...]]:
    """Both fake packages converted into this test's cache, and the arts that record their sha256."""
    tarballs, arts = fake_packages(tmp_path / "npm")
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLOWFLEET_CACHE", str(cache))
    s = convert_emoji(tarballs, cache / CACHE_FILE, cache / NOTICE_FILE, arts=arts, held_out=HELD_OUT, progress=False)
    return s, tarballs, arts


def test_the_conversion_composites_over_white_and_keeps_every_image(emoji_cache):
    s, _, _ = emoji_cache
    n = 2 * IMAGES_PER_STYLE
    assert s.images.shape == (n, 32, 32, 3) and s.images.dtype == np.uint8 and len(set(s.ids.tolist())) == n
    # transparent pixels are white in both styles (the RGBA PNGs and the palette PNGs), the disc is coloured
    for style in ("google", "twitter"):
        mine = s.images[np.char.startswith(s.ids.astype(str), style + "/")]
        assert len(mine) == IMAGES_PER_STYLE
        assert (mine[:, 0, 0] == 255).all() and (mine[:, 16, 16] < 250).any(axis=1).all()
    assert load_emoji().digest == s.digest and np.array_equal(load_emoji().images, s.images)  # read back as written
    assert "CC-BY-4.0" in (Path(os.environ["FLOWFLEET_CACHE"]) / NOTICE_FILE).read_text()  # licences beside it
    assert s.categories == tuple(sorted({c for _, c, _, _ in ENTRIES}))
    by_id = dict(zip(s.ids.tolist(), zip(s.category.tolist(), s.subcategory.tolist())))
    assert [s.categories[by_id["twitter/1f1ea-1f1ec"][0]], s.subcategories[by_id["twitter/1f1ea-1f1ec"][1]]] == [
        "Flags",
        "country-flag",
    ]


def test_captions_are_cldr_names_with_skin_tones_and_style(emoji_cache):
    s, _, _ = emoji_cache
    captions = dict(zip(s.ids.tolist(), s.captions.tolist()))
    assert captions["google/1f385"] == "Santa Claus, Noto style"
    assert captions["twitter/1f385-1f3fd"] == "Santa Claus: medium skin tone, Twemoji style"
    assert captions["google/1f385-1f3ff"] == "Santa Claus: dark skin tone, Noto style"
    assert captions["google/1f385-1f3fb"] == "Santa Claus: light skin tone, Noto style"
    assert captions["twitter/1f1ea-1f1ec"] == "flag of Egypt, Twemoji style"
    assert captions["google/2764-fe0f"] == "red heart, Noto style"
    assert len(set(captions.values())) == len(captions)  # one caption per image


def test_the_held_out_tail_is_disjoint_from_training_and_from_the_judge(emoji_cache, tmp_path):
    s, _, _ = emoji_cache
    held = set(s.ids[s.train_stop :].tolist())
    assert len(held) == HELD_OUT and not held & set(s.ids[: s.train_stop].tolist())
    # a run of the set holds the tail out (data.holdout): eval/ has exactly those, data/ none of them
    run = _run(tmp_path / "r")
    prepare(run, progress=False)
    keys = {folder: _captions(run, folder) for folder in ("data", "eval")}
    assert set(keys["eval"]) == set(s.captions[s.train_stop :].tolist()) and not set(keys["eval"]) & set(keys["data"])
    # the judge trains on the training part only, and says how it reads the held-out one
    judge = EmojiJudge.load_or_train(s, progress=False, settings=TrainSettings(epochs=1))
    assert judge.record["train_items"] == s.train_stop and judge.record["val_items"] == HELD_OUT
    again = EmojiJudge.load_or_train(s, progress=False, settings=TrainSettings(epochs=1))  # cached: the same weights
    assert again.record["sha256"] == judge.record["sha256"]


def test_the_source_prepares_and_carries_the_licences(emoji_cache, tmp_path):
    s, _, _ = emoji_cache
    source = build_source(RunConfig.from_dict(preset("emoji-tiny").to_dict()).data)
    first = next(source.items())
    assert (first.key, first.caption, first.label) == (s.ids[0], s.captions[0], int(s.category[0]))
    assert source.fingerprint() == {"kind": "emoji", "count": len(s), "digest": s.digest}
    run = _run(tmp_path / "r")
    manifest = prepare(run, progress=False)
    assert manifest.count == s.train_stop and manifest.extra["label_names"] == list(s.categories)
    notice = run.read_bytes("data", "NOTICE.md").decode()
    assert "emoji-datasource-twitter@16.0.0 (CC-BY-4.0)" in notice and "Twemoji" in notice
    assert "emoji-datasource-google@16.0.0 (Apache-2.0)" in notice and "resized to 32 x 32" in notice


def test_a_run_prepared_in_parts_carries_the_licences_too(emoji_cache, tmp_path):
    whole, parted = _run(tmp_path / "whole"), _run(tmp_path / "parted")
    prepare(whole, progress=False)
    for i in range(2):
        prepare(parted, part=(i, 2), progress=False)
    assert not parted.exists("data", "NOTICE.md")  # written with data/ itself, by the merge
    merge_parts(parted, 2, progress=False)
    assert parted.read_bytes("data", "NOTICE.md") == whole.read_bytes("data", "NOTICE.md")


def test_a_changed_tarball_is_refused(tmp_path, emoji_cache):
    _, tarballs, arts = emoji_cache
    with open(tarballs["twitter"], "ab") as f:
        f.write(b"\0")
    out = tmp_path / "again.npz"
    changed = rf"twitter-fake.tgz: sha256 .*, expected {arts[1].sha256} \(emoji-datasource-twitter@16.0.0\); refusing"
    with pytest.raises(SourceError, match=changed):
        convert_emoji(tarballs, out, tmp_path / "notice.md", arts=arts, progress=False)
    assert not out.exists()
    with pytest.raises(SourceError, match=r"google-fake.tgz: sha256 .*, expected fb5fd131"):  # the real packages'
        convert_emoji(tarballs, out, tmp_path / "notice.md", progress=False)


def test_without_npm_one_line_and_an_error_naming_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm
    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SourceError, match="npm: not found"):
        fetch_emoji(progress=False)
    assert main(["fetch-data", "--set", "emoji", "--optional"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "npm: not found" in line and "data.source emoji stops with an error until they are fetched" in line
    assert main(["fetch-data", "--set", "emoji"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("flowfleet fetch-data: error: npm: not found")
    with pytest.raises(EmojiNotFetched, match=r"emoji are not fetched .*`flowfleet fetch-data --set emoji`"):
        load_emoji()


def test_the_judge_reads_a_prompt_as_its_captions_category(emoji_cache):
    s, _, _ = emoji_cache
    judge = EmojiJudge.load_or_train(s, progress=False, settings=TrainSettings(epochs=1))
    santa = "Santa Claus: dark skin tone, Twemoji style"
    assert s.categories[judge.target(santa)] == "People & Body"
    assert s.categories[judge.target("flag of Egypt, Noto style")] == "Flags"
    assert judge.target("a handwritten digit seven") is None  # no emoji's caption: left out
    x = torch.from_numpy(s.images[:4]).permute(0, 3, 1, 2).float() / 127.5 - 1
    prompts = [str(c) for c in s.captions[:3]] + ["not an emoji"]
    scores = judge.prompt_accuracy(x, prompts)
    assert scores["n"] == 3 and scores["skipped"] == 1 and 0 <= scores["subcategory_accuracy"] <= 1
    assert judge.extractor()(torch.from_numpy(s.images[:2]).permute(0, 3, 1, 2)).shape == (2, 128)


def _run(path: Path) -> RunRoot:
    raw = preset("emoji-tiny").to_dict()
    raw["data"].update(holdout=HELD_OUT, shard_size=8, batch_size=8)
    root = RunRoot(str(path))
    RunConfig.from_dict(raw).save(root)
    return root


def _captions(run: RunRoot, folder: str) -> list[str]:
    sset = ShardSet(run, folder)
    return [c for shard in sset.manifest().shards for c in sset.read_shard(shard["name"])[1]]
