"""The fleet card: what a person should see about a model folder before sampling it.

    card.json               experts (size, parameters, training steps, cluster size and contents),
                            the router (its accuracy per t), what kind of model the folder holds
    card/preview-<k>.png    a grid of expert k's training data (the cluster preview of `cluster`)

`assemble` writes both from the run root into the model folder, so the card travels with the weights;
`serve` shows it. A folder without card.json (assembled by an older flowfleet) gets a card built from
its own configs: experts and sizes, no clusters or router accuracy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from flowfleet.layout import CLUSTER_REPORT, CLUSTERS, JOB_REPORT
from flowfleet.models.files import read_dit_config
from flowfleet.sampling.folder import expert_folder, read_model_index
from flowfleet.storage import RunRoot

CARD_FILE = "card.json"
CARD_FOLDER = "card"
ModelKind = Literal["fleet", "monolith", "student"]


def preview_name(k: int) -> str:
    return f"preview-{k}.png"


@dataclass
class ExpertCard:
    expert: int
    hidden_size: int
    depth: int
    num_heads: int
    patch_size: int
    params: int | None = None  # None: not recorded (an older folder)
    steps: int | None = None  # training steps of the weights in the folder
    cluster_size: int | None = None  # training items (its partition; the whole data for a monolith)
    label_mix: dict[str, int] | None = None  # label -> count in its cluster, where the data has labels
    examples: list[str] = field(default_factory=list)  # a few of its captions
    preview: str | None = None  # card/preview-<k>.png, relative to the model folder
    # a contributed expert (flowfleet admit): {"signer": key id, "manifest_sha256", "package"}
    contributed: dict[str, str] | None = None


@dataclass
class RouterCard:
    overall_accuracy: float
    chance: float
    t_buckets: list[list[float]]  # [[t_lo, t_hi], ...]
    accuracy: list[float]  # per t bucket
    job: str = ""


@dataclass
class FleetCard:
    name: str
    kind: ModelKind
    num_experts: int
    present: list[int]
    conditioning: str
    latent_shape: list[int]
    experts: list[ExpertCard]
    router: RouterCard | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "FleetCard":
        router = raw.get("router")
        return cls(
            **{
                **raw,
                "experts": [ExpertCard(**e) for e in raw["experts"]],
                "router": RouterCard(**router) if router else None,
            }
        )


def cluster_facts(root: RunRoot, n: int) -> dict[str, Any]:
    """clusters/report.json of the run (n = 0) or of addition n; {} when absent."""
    return root.origin(n).read_document(*CLUSTER_REPORT) or {}


def cluster_preview(root: RunRoot, n: int, j: int) -> bytes | None:
    """The PNG `cluster` drew of partition j of the run's data (n = 0) or of addition n."""
    origin = root.origin(n)
    return origin.read_bytes(CLUSTERS, preview_name(j)) if origin.exists(CLUSTERS, preview_name(j)) else None


def expert_card(folder: RunRoot, k: int, **facts: Any) -> ExpertCard:
    cfg = read_dit_config(folder, expert_folder(k))
    return ExpertCard(k, cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.patch_size, **facts)


def router_card(root: RunRoot, job: str) -> RouterCard | None:
    if not root.exists(job, JOB_REPORT):
        return None
    rep = root.read_json(job, JOB_REPORT)
    return RouterCard(
        float(rep["overall_accuracy"]), float(rep["chance"]), rep["t_buckets"], list(rep["accuracy"]), job
    )


def write_card(folder: RunRoot, card: FleetCard, previews: dict[int, bytes]) -> None:
    """card.json and card/preview-<k>.png into an assembled model folder (atomic writes)."""
    folder.remove(CARD_FOLDER, recursive=True)
    for k, png in previews.items():
        folder.write_bytes(png, CARD_FOLDER, preview_name(k))
    folder.write_json(card.to_json(), CARD_FILE)


def read_card(model_dir: str | RunRoot) -> FleetCard:
    """The folder's card.json, or a card from its configs alone (experts and sizes)."""
    folder = model_dir if isinstance(model_dir, RunRoot) else RunRoot(model_dir)
    if folder.exists(CARD_FILE):
        return FleetCard.from_json(folder.read_json(CARD_FILE))
    index = read_model_index(folder)
    return FleetCard(
        name=str(index.source.get("run_name", "")),
        kind="fleet" if index.num_experts > 1 else "monolith",
        num_experts=index.num_experts,
        present=list(index.present_experts),
        conditioning=index.conditioning,
        latent_shape=list(index.latent_shape),
        experts=[expert_card(folder, k) for k in index.present_experts],
    )


def card_markdown(card: FleetCard) -> str:
    """The card as Markdown (the web page's fleet card; tables a person reads at a glance)."""
    what = {
        "fleet": f"a fleet of {card.num_experts} experts",
        "monolith": "one model",
        "student": "a distilled student",
    }
    lines = [
        f"**{card.name or 'model'}**: {what[card.kind]}, {card.conditioning} conditioning, "
        f"latents {' × '.join(str(s) for s in card.latent_shape)}",
        "",
        "| expert | size (hidden × depth, heads, patch) | parameters | steps | training items | contents |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for e in card.experts:  # labels and captions are the data's (a contributor's too): escaped, never Markdown
        contents = ", ".join(f"{markdown_text(label)}: {count}" for label, count in (e.label_mix or {}).items())
        contents = contents or "; ".join(markdown_text(c) for c in e.examples[:3])
        lines.append(
            f"| {e.expert} | {e.hidden_size} × {e.depth}, {e.num_heads}, {e.patch_size} | "
            f"{_count(e.params)} | {_count(e.steps)} | {_count(e.cluster_size)} | {contents or '–'} |"
        )
    missing = sorted(set(range(card.num_experts)) - set(card.present))
    if missing and card.kind == "fleet":
        lines += ["", f"Left out of this folder: experts {', '.join(map(str, missing))}."]
    if card.router is not None:
        r = card.router
        buckets = " · ".join(f"t {lo:.1f}–{hi:.1f}: {a:.2f}" for (lo, hi), a in zip(r.t_buckets, r.accuracy))
        lines += [
            "",
            f"**Router** ({r.job}): accuracy {r.overall_accuracy:.3f} (chance {r.chance:.3f}); per t: {buckets}",
        ]
    elif card.kind == "fleet" and card.num_experts > 1:
        lines += ["", "**Router**: no accuracy recorded in this folder."]
    return "\n".join(lines)


MARKDOWN_SPECIAL = "\\`*_{}[]()<>#+-!|~"


def markdown_text(text: object, limit: int = 120) -> str:
    """Text shown as itself in Markdown: every control character a space, every Markdown character escaped (an image
    link, a table's `|`, HTML), cut to `limit` characters."""
    plain = "".join(ch if ch.isprintable() else " " for ch in str(text))[:limit]
    return "".join(f"\\{ch}" if ch in MARKDOWN_SPECIAL else ch for ch in plain)


def _count(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n / 1e6:.2f} M" if n >= 1_000_000 else f"{n:,}"
