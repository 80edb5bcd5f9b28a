"""The built-in emoji: 7572 captioned colour images, the same 3786 emoji (1911 emoji and 1875 skin-tone variants of
Unicode's Emoji 16.0) in two art styles, from the npm registry: data.source emoji.

    package                          art                  licence                                 images
    emoji-datasource-google@16.0.0   Noto Emoji (Google)  Apache-2.0                              3786
    emoji-datasource-twitter@16.0.0  Twemoji (jdecked)    CC-BY-4.0, attribution required         3786

(The same project's Apple and Facebook art is not licensed for this use and is left out.) Each tarball holds
`package/img/<style>/64/*.png`, 64 x 64 with transparency, and `package/emoji.json`: per emoji its code points,
one of 10 categories and 99 subcategories, and the image of each skin-tone variant.

Captions are Unicode's CLDR short names (PyPI's `emoji` package: "Santa Claus", "thumbs up", "A button (blood
type)"; a flag is "flag of Egypt"), a skin tone spelt out as CLDR writes it, and the art style:
"Santa Claus: medium skin tone, Twemoji style". The label is the category (`categories`, in sorted order); the
subcategory is kept beside it for the emoji judge (flowfleet.evaluate.emoji).

Images. Each PNG is composited over white (flowfleet.data.images.BACKGROUND: transparent pixels as a viewer shows
them, as every folder of PNGs is read) and resized to 32 px with the same antialiased bicubic filter prepare uses.

Order and held-out set. The 7572 are shuffled with a fixed seed and the last 1000 form the held-out tail
(`data.holdout: 1000`, drawn at random by image, both styles in it): no model and not the judge trains on them.
So every prefix of the set (data.limit) is a sample of all of it.

Fetching (`fetch_emoji`, `flowfleet fetch-data --set emoji`): `npm pack` of each package, pinned (npm checks the
registry's integrity; flowfleet checks it again and the tarball's sha256 against the ones recorded here), then one
conversion into CACHE/emoji-datasource-16.0.0-32px.npz (written atomically; CACHE is fetched.cache_dir()) and the
licences and attribution into CACHE/emoji-datasource-16.0.0-NOTICE.md, which every run prepared from the set
carries (RUN_ROOT/data/NOTICE.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm.auto import tqdm

from flowfleet.data.images import ImageDecodeError, opaque, open_image, square
from flowfleet.data.sources.base import RawItem, Source, SourceError
from flowfleet.data.sources.fetched import cache_dir, npm_pack, read_checked, save_arrays, write_cache_file

log = logging.getLogger(__name__)

SIDE = 32  # the cached images' side
HELD_OUT = 1000  # the set's tail, drawn at random by image: data.holdout
ORDER_SEED = 0
CONVERSION = 1  # bump when the cached arrays' layout, order or captions change: an older cache is converted again
VERSION = "16.0.0"
CACHE_FILE = f"emoji-datasource-{VERSION}-{SIDE}px.npz"
NOTICE_FILE = f"emoji-datasource-{VERSION}-NOTICE.md"
FETCH_HINT = "`flowfleet fetch-data --set emoji` fetches them with npm"
SKIN_TONES = {  # emoji.json's skin_variations keys: Fitzpatrick modifiers, as CLDR names them
    "1F3FB": "light skin tone",
    "1F3FC": "medium-light skin tone",
    "1F3FD": "medium skin tone",
    "1F3FE": "medium-dark skin tone",
    "1F3FF": "dark skin tone",
}
FLAGS = ("country-flag", "subdivision-flag")  # subcategories whose CLDR name is the place alone: "flag of <place>"


@dataclass(frozen=True)
class EmojiArt:
    """One licensed art style of the set: its npm package, pinned and checked, and what its licence asks."""

    style: str  # the folder under package/img/
    words: str  # how a caption names the style
    package: str  # npm spec, pinned
    integrity: str  # npm's sha512, as `npm pack --json` reports it
    sha256: str  # of the tarball
    licence: str
    notice: str  # the attribution the licence asks for

    @property
    def name(self) -> str:
        return self.package.rsplit("@", 1)[0]


ARTS = (
    EmojiArt(
        "google",
        "Noto",
        f"emoji-datasource-google@{VERSION}",
        "sha512-ZRexfzs7MVoLnmzZmNsO4TKhnAJp5D++Vm6PpUpH/jEQQlemp3l88CjZ+DoZ2faM9R4QxZkOPJCoT8DlPhfQ3A==",
        "fb5fd131b362aab7a55542d2a147a79708cce0a8b1c1bbacd470172708b5c438",
        "Apache-2.0",
        "Noto Emoji (v2.048), Copyright Google Inc., under the Apache License 2.0 "
        "(https://github.com/googlefonts/noto-emoji/blob/main/LICENSE)",
    ),
    EmojiArt(
        "twitter",
        "Twemoji",
        f"emoji-datasource-twitter@{VERSION}",
        "sha512-7F+uCuHH+7Qnrc15P5tnbvKkg9E6tlzi4MnT2uW1RlN4pLYTza6cP/dstIfSDMtpjFLWuZewWg8jBbuL2eyELQ==",
        "f64a530c63bca463bd8317fdc4615ce63a53a0c65018e4ce2d848aaba7a28877",
        "CC-BY-4.0",
        "Twemoji (jdecked/twemoji v16.0.1), Copyright Twitter, Inc and other contributors, graphics licensed under "
        "CC-BY 4.0 (https://creativecommons.org/licenses/by/4.0/; https://github.com/jdecked/twemoji)",
    ),
)


class EmojiNotFetched(SourceError):
    """The set is not in the cache (or the cache is another conversion's)."""


@dataclass(frozen=True)
class EmojiSet:
    """The converted set, in its order (training items, then the held-out tail)."""

    images: np.ndarray  # uint8 [N, 32, 32, 3], composited over white
    ids: np.ndarray  # str [N]: "<style>/<image file stem>", e.g. "twitter/1f385-1f3fd"
    captions: np.ndarray  # str [N]
    category: np.ndarray  # int64 [N], into `categories`
    subcategory: np.ndarray  # int64 [N], into `subcategories`
    categories: tuple[str, ...]  # sorted
    subcategories: tuple[str, ...]  # sorted
    held_out: int  # the last `held_out` items
    digest: str  # of the tarballs and this conversion (captions included)

    def __len__(self) -> int:
        return len(self.captions)

    @property
    def train_stop(self) -> int:
        return len(self) - self.held_out


# --------------------------------------------------------------------------------------------------
#                                        Conversion
# --------------------------------------------------------------------------------------------------


def cldr_names() -> dict[str, str]:
    """{emoji as a string: its CLDR short name} from PyPI's `emoji` package ("Santa Claus", "A button (blood
    type)"), with and without variation selectors."""
    try:
        import emoji
    except ImportError:
        raise SourceError(
            "data.source emoji: captions need PyPI's emoji package (pip install 'flowfleet[data]')"
        ) from None
    names: dict[str, str] = {}
    for char, info in emoji.EMOJI_DATA.items():
        name = info["en"].strip(":").replace("_", " ")
        names.setdefault(char, name)
        names.setdefault(char.replace("\ufe0f", ""), name)
    return names


def _char(unified: str) -> str:
    return "".join(chr(int(code, 16)) for code in unified.split("-"))


def caption(name: str, subcategory: str, tones: str | None, words: str) -> str:
    """ "<CLDR name>[: <skin tones>], <style> style"; a flag is "flag of <place>"."""
    what = f"flag of {name}" if subcategory in FLAGS else name
    if tones:
        what += ": " + ", ".join(SKIN_TONES[code] for code in tones.split("-"))
    return f"{what}, {words} style"


def emoji_entries(table: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """One record per image of emoji.json (an emoji, then each of its skin-tone variants): image file, CLDR name,
    skin tones (a skin_variations key, or None), category, subcategory."""
    out = []
    for e in table:
        name = names.get(_char(e["unified"])) or names.get(_char(e["unified"]).replace("\ufe0f", ""))
        if name is None:
            raise SourceError(f"emoji.json: {e.get('name')} ({e['unified']}) has no CLDR name in the emoji package")
        variants = [(e["image"], None)] + [(v["image"], k) for k, v in (e.get("skin_variations") or {}).items()]
        for image, tones in variants:
            out.append(dict(image=image, name=name, tones=tones, category=e["category"], sub=e["subcategory"]))
    return out


def read_art(tarball: Path, art: EmojiArt) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """One package's emoji.json records (emoji_entries, without names) and its 64 px PNGs by file name. Refuses a
    tarball whose sha256 is not the recorded one."""
    data = read_checked(tarball, art.sha256, art.package, "tarball")
    folder = f"package/img/{art.style}/64/"
    table: list[dict[str, Any]] | None = None
    pngs: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            if member.name == "package/emoji.json" or (member.name.startswith(folder) and member.isfile()):
                body = tar.extractfile(member)
                if body is None:
                    continue
                if member.name == "package/emoji.json":
                    table = json.loads(body.read())
                else:
                    pngs[member.name[len(folder) :]] = body.read()
    if table is None:
        raise SourceError(f"{tarball}: no package/emoji.json")
    return table, pngs


def to_side(png: bytes, side: int) -> np.ndarray:
    """A PNG (RGBA or a palette with transparency) as uint8 [side, side, 3]: over white, antialiased bicubic."""
    try:
        return np.asarray(square(opaque(open_image(png)).convert("RGB"), side), dtype=np.uint8)
    except ImageDecodeError as err:
        raise SourceError(f"an emoji PNG: {err}") from None


def convert_emoji(
    tarballs: dict[str, Path],
    out: Path,
    notice: Path,
    *,
    arts: tuple[EmojiArt, ...] = ARTS,
    side: int = SIDE,
    held_out: int = HELD_OUT,
    seed: int = ORDER_SEED,
    progress: bool = True,
) -> EmojiSet:
    """The packages (`tarballs`: style -> tarball) converted into the cached arrays `out` and the licences into
    `notice` (both atomically)."""
    names = cldr_names()
    images, ids, captions, cats, subs = [], [], [], [], []
    for art in arts:
        table, pngs = read_art(tarballs[art.style], art)
        entries = emoji_entries(table, names)
        for e in tqdm(entries, desc=f"emoji ({art.words})", unit="img", disable=not progress, leave=False):
            if e["image"] not in pngs:
                raise SourceError(f"{tarballs[art.style]}: no package/img/{art.style}/64/{e['image']}")
            images.append(to_side(pngs[e["image"]], side))
            ids.append(f"{art.style}/{e['image'].removesuffix('.png')}")
            captions.append(caption(e["name"], e["sub"], e["tones"], art.words))
            cats.append(e["category"])
            subs.append(e["sub"])
    if not 0 < held_out < len(ids):
        raise SourceError(f"emoji: {held_out} held-out images of {len(ids)}")
    order = np.random.default_rng(seed).permutation(len(ids))
    categories, subcategories = tuple(sorted(set(cats))), tuple(sorted(set(subs)))
    digest = hashlib.sha256(
        json.dumps([[a.sha256 for a in arts], CONVERSION, side, held_out, seed, captions]).encode()
    ).hexdigest()[:32]
    emoji_set = EmojiSet(
        images=np.stack(images)[order],
        ids=np.array(ids)[order],
        captions=np.array(captions)[order],
        category=np.array([categories.index(c) for c in cats], dtype=np.int64)[order],
        subcategory=np.array([subcategories.index(s) for s in subs], dtype=np.int64)[order],
        categories=categories,
        subcategories=subcategories,
        held_out=held_out,
        digest=digest,
    )
    write_cache_file(notice, notice_text(arts).encode())
    _save(out, emoji_set)
    return emoji_set


def notice_text(arts: tuple[EmojiArt, ...] = ARTS) -> str:
    """The set's licences and the attribution they ask for (CACHE/...-NOTICE.md, RUN_ROOT/data/NOTICE.md)."""
    lines = [
        "# The built-in emoji: licences and attribution",
        "",
        "The images of data.source emoji come from these npm packages (iamcal/emoji-data, MIT), each style under its",
        "own licence. flowfleet changed them: composited over white and resized to "
        f"{SIDE} x {SIDE} pixels. Captions are",
        "Unicode CLDR short names (via PyPI's emoji package).",
        "",
    ]
    lines += [f"- {art.package} ({art.licence}): {art.notice}" for art in arts]
    return "\n".join(lines) + "\n"


def _save(out: Path, s: EmojiSet) -> None:
    save_arrays(
        out,
        images=s.images,
        ids=s.ids,
        captions=s.captions,
        category=s.category,
        subcategory=s.subcategory,
        categories=np.array(s.categories),
        subcategories=np.array(s.subcategories),
        held_out=np.array(s.held_out),
        digest=np.array(s.digest),
        conversion=np.array(CONVERSION),
    )


def load_emoji(cache: Path | None = None) -> EmojiSet:
    """The converted set from the cache; EmojiNotFetched (naming the command) where it is not there."""
    path = (cache or cache_dir()) / CACHE_FILE
    if not path.is_file():
        raise EmojiNotFetched(f"the built-in emoji are not fetched ({path} is missing); {FETCH_HINT}")
    try:
        with np.load(path, allow_pickle=False) as f:
            if int(f["conversion"]) != CONVERSION:
                raise EmojiNotFetched(f"{path}: converted by another flowfleet version; {FETCH_HINT} again")
            return EmojiSet(
                images=f["images"],
                ids=f["ids"],
                captions=f["captions"],
                category=f["category"].astype(np.int64),
                subcategory=f["subcategory"].astype(np.int64),
                categories=tuple(str(c) for c in f["categories"]),
                subcategories=tuple(str(c) for c in f["subcategories"]),
                held_out=int(f["held_out"]),
                digest=str(f["digest"]),
            )
    except (OSError, KeyError, ValueError) as err:
        raise EmojiNotFetched(f"{path}: unreadable ({err}); {FETCH_HINT} again") from None


def fetch_emoji(cache: Path | None = None, npm: str = "npm", timeout_s: float = 900, progress: bool = True) -> Path:
    """`npm pack` both packages (pinned, integrity and sha256 checked) and convert them into the cache; the cached
    file. Nothing is fetched where a good cache is there already. SourceError (one line) on any failure."""
    folder = cache or cache_dir()
    path = folder / CACHE_FILE
    try:
        load_emoji(cache)
        if (folder / NOTICE_FILE).is_file():
            return path
    except EmojiNotFetched:
        pass
    with tempfile.TemporaryDirectory(prefix="flowfleet-npm-") as tmp:
        tarballs = {
            art.style: npm_pack(art.package, art.integrity, Path(tmp), npm=npm, timeout_s=timeout_s) for art in ARTS
        }
        log.info("converting %s into %s", ", ".join(a.package for a in ARTS), path)
        convert_emoji(tarballs, path, folder / NOTICE_FILE, progress=progress)
    return path


# --------------------------------------------------------------------------------------------------
#                                          Source
# --------------------------------------------------------------------------------------------------


class EmojiSource(Source):
    """The built-in emoji: uint8 32 x 32 x 3 images, captions "<name>[: <skin tone>], <style> style", label =
    category."""

    kind = "emoji"
    has_labels = True

    def __init__(self, emoji_set: EmojiSet | None = None) -> None:
        self.set = emoji_set if emoji_set is not None else load_emoji()
        self.label_names = self.set.categories

    def __len__(self) -> int:
        return len(self.set)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": len(self), "digest": self.set.digest}

    def notice(self) -> str | None:
        return notice_text()

    def items(self, start: int = 0) -> Iterator[RawItem]:
        s = self.set
        for i in range(start, len(s)):
            yield RawItem(str(s.ids[i]), s.images[i], str(s.captions[i]), int(s.category[i]))
