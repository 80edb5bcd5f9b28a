"""Every source kind: order, captions, labels, restart positions, fingerprints and bad input."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from flowfleet.config import DataConfig
from flowfleet.data.images import ImageDecodeError, open_image, to_tensor
from flowfleet.data.sources import (
    DIGIT_WORDS,
    SHAPES,
    FolderSource,
    HfDiskSource,
    MnistSource,
    ParquetSource,
    ShapesSource,
    SourceError,
    WebdatasetSource,
    build_source,
    draw_shape,
)


def png(color=(200, 30, 30), size=(12, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(color=(10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (9, 9), color).save(buf, format="JPEG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------
#                                          images
# ------------------------------------------------------------------------------------------------


def test_open_image_rejects_corrupt_and_truncated_data():
    with pytest.raises(ImageDecodeError):
        open_image(b"not an image at all")
    with pytest.raises(ImageDecodeError, match="empty"):
        open_image(b"")
    with pytest.raises(ImageDecodeError):
        open_image(png()[:40])  # header only: truncated
    assert open_image(png()).size == (12, 10)
    assert open_image(np.zeros((4, 5), np.uint8)).size == (5, 4)


def test_to_tensor_crops_resizes_and_scales():
    img = Image.new("RGB", (20, 10), (255, 0, 0))
    x = to_tensor(img, 8, 3)
    assert x.shape == (3, 8, 8)
    assert x[0].min() == 1.0 and x[1].max() == -1.0  # pure red in [-1, 1]
    g = to_tensor(img, 8, 1)
    assert g.shape == (1, 8, 8)
    rgba = Image.new("RGBA", (6, 6), (0, 0, 0, 0))  # fully transparent -> white
    assert to_tensor(rgba, 6, 3).min() == 1.0


# ------------------------------------------------------------------------------------------------
#                                          built-ins
# ------------------------------------------------------------------------------------------------


def test_mnist_source_real_digits_balanced_prefix_and_captions():
    src = MnistSource()
    assert len(src) == 5000 and src.has_labels
    items = list(src.items(0))
    assert len(items) == 5000
    first = items[:100]
    assert np.bincount([it.label for it in first], minlength=10).tolist() == [10] * 10
    for it in items[:20]:
        assert it.caption == f"a handwritten digit {DIGIT_WORDS[it.label]}"
        assert it.image.shape == (28, 28) and it.image.dtype == np.uint8 and it.image.max() > 100
    assert [it.key for it in src.items(4990)] == [it.key for it in items[4990:]]
    assert src.fingerprint() == MnistSource().fingerprint()


def test_shapes_source_is_deterministic_and_described():
    a = ShapesSource(count=12, size=16, seed=3)
    b = ShapesSource(count=12, size=16, seed=3)
    c = ShapesSource(count=12, size=16, seed=4)
    ia, ib, ic = list(a.items()), list(b.items()), list(c.items())
    assert len(ia) == 12
    for x, y in zip(ia, ib):
        assert np.array_equal(x.image, y.image) and x.caption == y.caption and x.label == y.label
    assert any(not np.array_equal(x.image, z.image) for x, z in zip(ia, ic))
    tail = list(a.items(7))
    assert [t.key for t in tail] == [t.key for t in ia[7:]] and np.array_equal(tail[0].image, ia[7].image)
    for it in ia:
        assert it.image.shape == (16, 16, 3)
        assert SHAPES[it.label] in it.caption and "background" in it.caption
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_shapes_pixels_match_the_caption_colour():
    img, caption, label = draw_shape(0, 5, 32)
    from flowfleet.data.sources import BACKGROUNDS, COLOURS

    colour = next(name for name in COLOURS if f" {name} {SHAPES[label]}" in caption)
    background = next(name for name in BACKGROUNDS if caption.endswith(f"on a {name} background"))
    pixels = img.reshape(-1, 3).astype(int)
    near = lambda rgb: (np.abs(pixels - np.array(rgb)).sum(1) < 30).mean()  # noqa: E731
    assert near(COLOURS[colour]) > 0.01  # the shape is drawn
    assert near(BACKGROUNDS[background]) > 0.3  # and the rest is background


# ------------------------------------------------------------------------------------------------
#                                          folder
# ------------------------------------------------------------------------------------------------


def test_folder_with_txt_captions_and_bad_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.png").write_bytes(png())
    (tmp_path / "b.txt").write_text("  a red box \n")
    (tmp_path / "a.jpg").write_bytes(jpeg())  # no caption
    (tmp_path / "sub" / "c.png").write_bytes(b"garbage")
    (tmp_path / "sub" / "c.txt").write_text("broken")
    (tmp_path / "notes.md").write_text("ignored")
    src = FolderSource(str(tmp_path))
    items = list(src.items())
    assert [it.key for it in items] == ["a.jpg", "b.png", "sub/c.png"]
    assert [it.caption for it in items] == [None, "a red box", "broken"]
    assert open_image(items[0].image).size == (9, 9)
    with pytest.raises(ImageDecodeError):
        open_image(items[2].image)
    assert [it.key for it in src.items(2)] == ["sub/c.png"]
    fp = src.fingerprint()
    (tmp_path / "b.txt").write_text("a longer caption than before")
    assert FolderSource(str(tmp_path)).fingerprint() != fp


@pytest.mark.parametrize("table", ["jsonl", "csv"])
def test_folder_with_caption_table_and_labels(tmp_path, table):
    (tmp_path / "x.png").write_bytes(png())
    (tmp_path / "y.png").write_bytes(png((0, 0, 255)))
    (tmp_path / "z.png").write_bytes(png((0, 255, 0)))
    rows = [{"file": "x.png", "text": "first", "label": 4}, {"file": "y.png", "text": "second", "label": 1}]
    if table == "jsonl":
        (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        (tmp_path / "captions.csv").write_text("file,text,label\nx.png,first,4\ny.png,second,1\n")
    src = FolderSource(str(tmp_path))
    items = list(src.items())
    assert [(it.key, it.caption, it.label) for it in items] == [
        ("x.png", "first", 4),
        ("y.png", "second", 1),
        ("z.png", None, -1),
    ]
    assert src.has_labels


def test_folder_labels_may_be_names(tmp_path):
    """captions.jsonl labels as names (a category, a class): label i is the i-th name in sorted order, and the
    names travel with the source (prepare records them); names mixed with integers are refused naming the row."""
    for name in ("x.png", "y.png", "z.png"):
        (tmp_path / name).write_bytes(png())
    rows = [{"file": "x.png", "text": "a", "label": "Flags"}, {"file": "y.png", "text": "b", "label": "Animals"}]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    src = FolderSource(str(tmp_path))
    assert [it.label for it in src.items()] == [1, 0, -1] and src.label_names == ("Animals", "Flags")
    assert src.has_labels
    rows.append({"file": "z.png", "text": "c", "label": 3})
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(SourceError, match=r"captions.jsonl: row 1: label 'Flags' is a name where other rows give"):
        FolderSource(str(tmp_path))


def test_folder_errors_name_the_path(tmp_path):
    with pytest.raises(SourceError, match="no such folder"):
        FolderSource(str(tmp_path / "missing"))
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(SourceError, match=f"{tmp_path}: no images"):
        FolderSource(str(tmp_path))
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "captions.jsonl").write_text('{"file": "a.png", "text": "ok"}\n{broken\n')
    with pytest.raises(SourceError, match=r"captions.jsonl: line 2: not valid JSON"):
        FolderSource(str(tmp_path))


# ------------------------------------------------------------------------------------------------
#                                          webdataset
# ------------------------------------------------------------------------------------------------


def write_tar(path, samples: list[dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            for name, data in sample.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_brace_pattern_groups_members(tmp_path):
    write_tar(
        tmp_path / "shard-0.tar",
        [
            {"k0.jpg": jpeg(), "k0.txt": b"zero", "k0.cls": b"3"},
            {"k1.png": png(), "k1.txt": b"one"},
        ],
    )
    write_tar(
        tmp_path / "shard-1.tar",
        [
            {"dir/k2.jpg": jpeg(), "dir/k2.json": b'{"caption": "two"}'},
            {"k3.txt": b"no image"},
            {"k4.jpg": jpeg()},
        ],
    )
    src = WebdatasetSource(str(tmp_path / "shard-{0..1}.tar"))
    items = list(src.items())
    assert [it.key for it in items] == [
        "shard-0.tar:k0",
        "shard-0.tar:k1",
        "shard-1.tar:dir/k2",
        "shard-1.tar:k3",
        "shard-1.tar:k4",
    ]
    assert [it.caption for it in items] == ["zero", "one", "two", "no image", None]
    assert items[0].label == 3 and items[1].label == -1
    assert items[3].error and "no image" in items[3].error and items[4].error is None
    assert [it.key for it in src.items(3)] == ["shard-1.tar:k3", "shard-1.tar:k4"]
    assert WebdatasetSource(str(tmp_path / "shard-*.tar")).fingerprint()["files"] == 2


def test_webdataset_truncated_tar_keeps_earlier_samples(tmp_path):
    write_tar(tmp_path / "a.tar", [{f"s{i}.png": png(size=(64, 64)), f"s{i}.txt": f"c{i}".encode()} for i in range(4)])
    with tarfile.open(tmp_path / "a.tar") as tar:
        cut = tar.getmember("s2.png").offset_data + 10  # inside the third sample's image
    (tmp_path / "a.tar").write_bytes((tmp_path / "a.tar").read_bytes()[:cut])
    items = list(WebdatasetSource(str(tmp_path / "a.tar")).items())
    assert [(it.key, it.caption) for it in items[:2]] == [("a.tar:s0", "c0"), ("a.tar:s1", "c1")]
    assert all(it.error is None for it in items[:2])
    assert items[-1].error is not None and "unreadable tar" in items[-1].error


def test_webdataset_missing_files(tmp_path):
    with pytest.raises(SourceError, match="matches no tar files"):
        WebdatasetSource(str(tmp_path / "*.tar"))
    with pytest.raises(SourceError, match="no such file"):
        WebdatasetSource(str(tmp_path / "{0..1}.tar"))


# ------------------------------------------------------------------------------------------------
#                                          parquet, save_to_disk
# ------------------------------------------------------------------------------------------------


def test_parquet_bytes_and_hf_struct_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"image": [png(), jpeg()], "text": ["p", None], "label": [1, 2]}),
        tmp_path / "0.parquet",
        row_group_size=1,
    )
    struct = pa.array([{"bytes": png((1, 2, 3)), "path": None}, {"bytes": None, "path": "gone.png"}])
    pq.write_table(pa.table({"image": struct, "text": ["q", "r"], "label": [3, 4]}), tmp_path / "1.parquet")
    src = ParquetSource(str(tmp_path), "image", "text")
    assert len(src) == 4 and src.has_labels
    items = list(src.items())
    assert [(it.caption, it.label) for it in items] == [("p", 1), (None, 2), ("q", 3), ("r", 4)]
    assert open_image(items[2].image).getpixel((0, 0)) == (1, 2, 3)
    assert items[3].error is not None  # a struct without bytes cannot be decoded
    assert [it.key for it in src.items(2)] == [it.key for it in items[2:]]
    source = ParquetSource(str(tmp_path / "*.parquet"), "image", "text")
    assert [it.caption for it in source.items(1)] == [None, "q", "r"]
    with pytest.raises(SourceError, match="data.text_column: 'caption' is not a column"):
        ParquetSource(str(tmp_path), "image", "caption")
    with pytest.raises(SourceError, match="no such file or folder"):
        ParquetSource(str(tmp_path / "nope"), "image", "text")


def test_hf_save_to_disk_dataset(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "image": [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(5)],
            "text": [f"t{i}" for i in range(5)],
            "label": list(range(5)),
        },
        features=datasets.Features(
            {"image": datasets.Image(), "text": datasets.Value("string"), "label": datasets.Value("int64")}
        ),
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    src = HfDiskSource(str(tmp_path / "ds"), "image", "text")
    items = list(src.items())
    assert len(items) == 5 and [it.caption for it in items] == [f"t{i}" for i in range(5)]
    assert [it.label for it in items] == list(range(5))
    assert open_image(items[3].image).getpixel((0, 0)) == (120, 0, 0)
    assert [it.key for it in src.items(4)] == ["row-4"]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match="holds splits"):
        HfDiskSource(str(tmp_path / "dd"), "image", "text")
    with pytest.raises(SourceError, match="data.image_column: 'img'"):
        HfDiskSource(str(tmp_path / "ds"), "img", "text")


def test_build_source_dispatches_every_kind(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    write_tar(tmp_path / "a.tar", [{"k.png": png(), "k.txt": b"t"}])
    assert isinstance(build_source(DataConfig(source="mnist")), MnistSource)
    assert isinstance(build_source(DataConfig(source="shapes", count=3)), ShapesSource)
    assert isinstance(build_source(DataConfig(source="folder", path=str(tmp_path))), FolderSource)
    assert isinstance(build_source(DataConfig(source="webdataset", path=str(tmp_path / "a.tar"))), WebdatasetSource)
    with pytest.raises(ValueError, match="path: required"):
        DataConfig(source="folder")
