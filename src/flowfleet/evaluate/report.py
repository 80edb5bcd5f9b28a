"""RUN_ROOT/reports/report.html: one self-contained page (images embedded), viewable offline.

Everything is read from the run root's files (docs/contracts.md), so a report can be rebuilt at any
time and shows whatever stages have run; a section whose inputs do not exist yet says which command
produces them. Sections, in order (their HTML ids are SECTIONS):

    overview     run name, jobs and their states
    config       run.yaml
    clusters     clusters/report.json (sizes, NMI) and the preview-k.png grids
    training     loss curves of every job (metrics.jsonl), job table, router accuracy per t (each router)
    samples      sample grids per strategy (and the monolith) with their prompts
    routing      router-probability heatmaps per strategy
    fid          quality per model: prompt accuracy and classifier FD (MNIST), FID (reports/evaluation.json)
    adherence    prompt adherence (shapes source)
    diagnostics  router accuracy per t, centroid alignment, expert disagreement, expert usage
    timings      stage timings (reports/timings.json), job wall times, evaluation timings

The plots drawn here are also written beside the page, to reports/plots/*.png.
"""

from __future__ import annotations

import base64
import json
import posixpath
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import jinja2

from flowfleet.data.sources import describe_source
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate import views
from flowfleet.layout import (
    CLUSTER_REPORT,
    CLUSTERS,
    DATA,
    EXPERTS,
    FINAL,
    INDEX_FILE,
    JOB_REPORT,
    MANIFEST,
    METRICS_FILE,
    MODEL,
    MONOLITH,
    REPORTS,
    ROUTERS,
    RUN_FILE,
    SAMPLES,
    SHOWCASE,
    STATUS_FILE,
    expert_job,
)
from flowfleet.storage import RunRoot

REPORT_FILE = "report.html"
EVALUATION_FILE = "evaluation.json"
TIMINGS_FILE = "timings.json"
MIX_LABELS = 10  # labels listed per cluster in the report: all ten digits of the built-in data
SECTIONS = (
    "overview",
    "config",
    "clusters",
    "training",
    "samples",
    "routing",
    "fid",
    "adherence",
    "diagnostics",
    "timings",
)
TITLES = {
    "overview": "Overview",
    "config": "Configuration",
    "clusters": "Clusters",
    "training": "Training",
    "samples": "Samples per strategy",
    "routing": "Routing heatmaps",
    "fid": "Quality",
    "adherence": "Prompt adherence",
    "diagnostics": "Diagnostics",
    "timings": "Timings",
}


# --------------------------------------------------------------------------------------------------
#                                    Reading the run root
# --------------------------------------------------------------------------------------------------


def _json(root: RunRoot, *parts: str) -> Any:
    """A JSON file of the run root, or None when absent or unreadable (the report never fails on one)."""
    try:
        return root.read_json(*parts) if root.exists(*parts) else None
    except (ValueError, OSError):
        return None


def read_metrics(root: RunRoot, job_dir: str) -> list[dict[str, Any]]:
    """metrics.jsonl as records; torn or non-JSON lines (a crash mid-write) are skipped."""
    if not root.exists(job_dir, METRICS_FILE):
        return []
    records = []
    for line in root.read_bytes(job_dir, METRICS_FILE).decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            records.append(rec)
    return records


def job_dirs(root: RunRoot) -> list[str]:
    """experts/k (numeric order), router, monolith: whichever exist."""
    experts = sorted((int(n) for n in root.ls(EXPERTS) if n.isdigit()))
    return [expert_job(k) for k in experts] + [d for d in (*ROUTERS, MONOLITH) if root.exists(d)]


def job_label(job_dir: str) -> str:
    return f"expert {job_dir.split('/')[1]}" if job_dir.startswith(f"{EXPERTS}/") else job_dir


@dataclass
class Image:
    caption: str
    data: str  # data: URI (embedded PNG)


def _embed(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@dataclass
class Section:
    id: str
    title: str
    missing: str = ""  # non-empty: what to run to fill this section
    notes: list[str] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)  # {"caption", "header": [...], "rows": [[...]]}
    images: list[Image] = field(default_factory=list)
    pre: str = ""  # preformatted text (the config)
    lists: list[dict[str, Any]] = field(default_factory=list)  # {"caption", "items": [...]}


# --------------------------------------------------------------------------------------------------
#                                         Sections
# --------------------------------------------------------------------------------------------------


class ReportBuilder:
    """Reads a run root and fills one Section per id in SECTIONS."""

    def __init__(self, root: RunRoot):
        self.root = root
        self.evaluation = _json(root, REPORTS, EVALUATION_FILE)
        self.plots: dict[str, bytes] = {}  # written to reports/plots/ beside the page

    def _plot(self, name: str, png: bytes, caption: str) -> Image:
        self.plots[name] = png
        return Image(caption, _embed(png))

    def _file_image(self, caption: str, *parts: str) -> Image | None:
        if not self.root.exists(*parts):
            return None
        return Image(caption, _embed(self.root.read_bytes(*parts)))

    def build(self) -> list[Section]:
        return [getattr(self, f"section_{sid}")() for sid in SECTIONS]

    # -- overview, config ---------------------------------------------------------------------------

    def section_overview(self) -> Section:
        s = Section("overview", TITLES["overview"])
        cfg = _json_yaml(self.root)
        s.notes.append(f"Run root: {self.root.url}")
        if cfg:
            data = cfg.get("data", {})
            s.notes.append(
                f"Run {cfg.get('name', '?')}: source {data.get('source', '?')}, "
                f"{data.get('image_size', '?')} px, K = {cfg.get('cluster', {}).get('k', '?')} experts."
            )
        manifest = _json(self.root, DATA, MANIFEST)
        if manifest:
            s.notes.append(f"Prepared items: {manifest.get('count', '?')}.")
        runs = (self.evaluation or {}).get("runs") or {}
        scored = {name: r["prompt_accuracy"] for name, r in runs.items() if r.get("prompt_accuracy") is not None}
        if scored:  # the headline: does each model draw what it is asked for?
            s.notes.append(
                "Prompt accuracy (share of samples drawn as prompted; see Quality): "
                + ", ".join(f"{name} {acc:.3f}" for name, acc in scored.items())
                + "."
            )
        rows = []
        for job in job_dirs(self.root):
            st = _json(self.root, job, STATUS_FILE) or {}
            rows.append(
                [
                    job_label(job),
                    st.get("state", "?"),
                    f"{st.get('step', 0)}/{st.get('total_steps', '?')}",
                    _fmt(st.get("last_loss")),
                    st.get("host", ""),
                ]
            )
        if rows:
            s.tables.append({"caption": "jobs", "header": ["job", "state", "step", "last loss", "host"], "rows": rows})
        stages = [
            (f"{DATA}/{MANIFEST}", "prepare"),
            ("/".join(CLUSTER_REPORT), "cluster"),
            (f"{MODEL}/{INDEX_FILE}", "assemble"),
            (f"{REPORTS}/{EVALUATION_FILE}", "evaluate"),
        ]
        s.tables.append(
            {
                "caption": "stages",
                "header": ["stage", "output", "present"],
                "rows": [[st, path, "yes" if self.root.exists(path) else "no"] for path, st in stages],
            }
        )
        return s

    def section_config(self) -> Section:
        s = Section("config", TITLES["config"])
        if not self.root.exists(RUN_FILE):
            s.missing = "run.yaml is missing: `flowfleet init RUN_ROOT --preset mnist`"
            return s
        s.notes.append("run.yaml:")
        s.pre = self.root.read_bytes(RUN_FILE).decode(errors="replace")
        if self.evaluation:
            settings = {k: self.evaluation.get(k) for k in ("model", "reference", "n", "seed", "sampling")}
            s.pre += "\n# evaluation (reports/evaluation.json)\n" + json.dumps(settings, indent=2)
        return s

    # -- clusters ------------------------------------------------------------------------------------

    def section_clusters(self) -> Section:
        s = Section("clusters", TITLES["clusters"])
        rep = _json(self.root, *CLUSTER_REPORT)
        if rep is None:
            s.missing = "no clusters/report.json yet: `flowfleet cluster RUN_ROOT`"
            return s
        sizes = rep.get("sizes") or []
        nmi = rep.get("nmi")
        features = rep.get("features") or {}
        kind = features.get("kind", "semantic") if isinstance(features, dict) else "semantic"
        note = f"{len(sizes)} clusters of the {kind} features"
        if (rep.get("config") or {}).get("caption_residual"):
            note += (
                " less what the caption predicts of them (cluster.caption_residual: every cluster holds every caption)"
            )
        if isinstance(nmi, (int, float)):
            note += f"; NMI against the source labels {nmi:.3f}"
        coherence = rep.get("label_coherence")
        if isinstance(coherence, (int, float)):
            note += (
                f"; label coherence {coherence:.3f} (mean over labels of the share of a label's items in its "
                "majority cluster; 1 = every label whole in one cluster)"
            )
        s.notes.append(note)
        make_up = f"cluster sizes and make-up (items per source label, the {MIX_LABELS} most frequent)"
        rows = _cluster_rows(rep)
        if rows:
            s.tables.append({"caption": make_up, "header": ["cluster", "items", "labels"], "rows": rows})
        # another fleet evaluated beside this one (evaluate --fleet): its own run root's clusters, when it has one
        for name, folder in ((self.evaluation or {}).get("fleets") or {}).items():
            other = _json(RunRoot(posixpath.dirname(folder.rstrip("/"))), *CLUSTER_REPORT)
            if other and (rows := _cluster_rows(other)):
                kind = (other.get("features") or {}).get("kind", "?")
                caption = f"the fleet of the rows STRATEGY@{name}: {kind} clusters' {make_up}"
                s.tables.append({"caption": caption, "header": ["cluster", "items", "labels"], "rows": rows})
        for name in self.root.ls(CLUSTERS):
            if name.startswith("preview-") and name.endswith(".png"):
                img = self._file_image(f"cluster {name[8:-4]}", CLUSTERS, name)
                if img:
                    s.images.append(img)
        s.images.sort(key=lambda im: int(im.caption.split()[-1]) if im.caption.split()[-1].isdigit() else 0)
        return s

    # -- training ------------------------------------------------------------------------------------

    def section_training(self) -> Section:
        s = Section("training", TITLES["training"])
        jobs = job_dirs(self.root)
        if not jobs:
            s.missing = "no job folders yet: `flowfleet train-all RUN_ROOT`"
            return s
        curves, rows = {}, []
        for job in jobs:
            records = read_metrics(self.root, job)
            curves[job_label(job)] = [
                (r["step"], float(r["loss"])) for r in records if isinstance(r.get("loss"), (int, float))
            ]
            st = _json(self.root, job, STATUS_FILE) or {}
            speed = [r["samples_per_s"] for r in records if isinstance(r.get("samples_per_s"), (int, float))]
            rows.append(
                [
                    job_label(job),
                    st.get("state", "?"),
                    st.get("step", 0),
                    _fmt(st.get("last_loss")),
                    _fmt(sum(speed) / len(speed)) if speed else "",
                    _fmt(_wall_time(records)),
                ]
            )
        train = (_json_yaml(self.root) or {}).get("train") or {}
        if train.get("expert_steps") == "by_size":
            s.notes.append(
                f"The experts share K x {train.get('steps', '?')} steps in proportion to their clusters' sizes "
                "(train.expert_steps by_size): each passes over its data as often as the monolith over all of it."
            )
        s.images.append(
            self._plot("loss_curves.png", views.loss_curves_png(curves), "loss of every job (metrics.jsonl)")
        )
        s.tables.append(
            {"caption": "jobs", "header": ["job", "state", "steps", "last loss", "samples/s", "wall s"], "rows": rows}
        )
        routers = {name: rep for name in ROUTERS if (rep := _json(self.root, name, JOB_REPORT)) and "accuracy" in rep}
        if routers:
            s.tables.append(router_accuracy_table(routers, self._router_kinds(routers)))
        for name, rep in routers.items():
            s.images.append(
                self._plot(
                    f"{name}_training_accuracy.png",
                    views.router_accuracy_png(
                        rep["t_buckets"],
                        rep["accuracy"],
                        rep.get("chance"),
                        f"{name} accuracy per t ({name}/report.json)",
                    ),
                    f"{name} on {rep.get('items', '?')} training items",
                )
            )
        for job in jobs:  # the last sample grid each job drew while training
            grids = [n for n in self.root.ls(job, SAMPLES) if n.endswith(".png")]
            if grids:
                img = self._file_image(f"{job_label(job)}: {grids[-1]}", job, SAMPLES, grids[-1])
                if img:
                    s.images.append(img)
        return s

    def _router_kinds(self, routers: dict[str, Any]) -> dict[str, str]:
        kinds = {}
        for name in routers:
            cfg = _json(self.root, name, FINAL, "config.json") or {}
            sees = cfg.get("conditioning", "none") != "none"
            kinds[name] = "p(k | x_t, t, prompt)" if sees else "p(k | x_t, t) (Paris)"
        return kinds

    # -- evaluation ----------------------------------------------------------------------------------

    def _runs(self) -> dict[str, dict[str, Any]]:
        return (self.evaluation or {}).get("runs", {}) or {}

    def _needs_evaluation(self, s: Section) -> bool:
        if not self.evaluation:
            s.missing = "no reports/evaluation.json yet: `flowfleet evaluate RUN_ROOT/model --reference RUN_ROOT`"
            return True
        return False

    def section_samples(self) -> Section:
        s = Section("samples", TITLES["samples"])
        grids = [n for n in self.root.ls(REPORTS, SHOWCASE) if n.endswith(".png") and not n.endswith(".routing.png")]
        grids.sort(key=lambda n: (n != "monolith.png", n))  # `flowfleet demo`: the monolith, then each strategy
        for name in grids:
            img = self._file_image(
                f"{name[:-4]}: `flowfleet generate`, the same prompts and noise for every "
                "model, each image labelled with its prompt",
                REPORTS,
                SHOWCASE,
                name,
            )
            if img:
                s.images.append(img)
        if self._needs_evaluation(s):
            return s
        for name, run in self._runs().items():
            if run.get("grid"):
                img = self._file_image(f"{name}", REPORTS, run["grid"])
                if img:
                    s.images.append(img)
            prompts = run.get("prompts") or []
            if any(prompts):
                s.lists.append(
                    {
                        "caption": f"{name}: prompts of the grid, row by row",
                        "items": [f"{i}: {p}" for i, p in enumerate(prompts)],
                    }
                )
        return s

    def section_routing(self) -> Section:
        s = Section("routing", TITLES["routing"])
        if self._needs_evaluation(s):
            return s
        for name, run in self._runs().items():
            if run.get("heatmap"):
                img = self._file_image(f"{name}: router probabilities over the sampling steps", REPORTS, run["heatmap"])
                if img:
                    s.images.append(img)
        if not s.images:
            s.notes.append("No routed runs were evaluated (monolith only).")
        return s

    def section_fid(self) -> Section:
        s = Section("fid", TITLES["fid"])
        if self._needs_evaluation(s):
            return s
        fid = self.evaluation.get("fid") or {}
        scores = fid.get("scores") or {}
        if not scores:
            s.missing = "the evaluation computed no FID"
            return s
        runs = self._runs()
        digits = self.evaluation.get("prompt_accuracy") or None
        if digits:
            clf = digits.get("classifier") or {}
            s.tables.append(
                {
                    "caption": "per model at its guidance scale (cfg): prompt accuracy (share of samples the judge "
                    "reads as the prompted class; higher is better), the judge's mean probability of that class, "
                    "the Fréchet distance in the classifier's features (lower is better), precision and recall in "
                    "those features (Kynkäänniemi et al., k = 3: fidelity and diversity), and Inception FID. The "
                    "last row scores real images that no model saw, exactly like a model: the floor of each "
                    "distance at this sample count"
                    + (
                        ". A row STRATEGY+ROUTER is the same experts routed by another of the run's routers "
                        "(router-prompt: p(k | x_t, t, prompt), a comparison beyond Paris' prompt-blind router)"
                        if any("+" in name for name in runs)
                        else ""
                    ),
                    "header": [
                        "model",
                        "cfg",
                        "prompt accuracy",
                        "confidence",
                        "classifier FD",
                        "precision",
                        "recall",
                        "FID",
                    ],
                    "rows": [
                        [
                            name,
                            _fmt(r.get("cfg")),
                            _fmt(r.get("prompt_accuracy")),
                            _fmt(r.get("confidence")),
                            _fmt(r.get("classifier_fd")),
                            _fmt(r.get("precision")),
                            _fmt(r.get("recall")),
                            _fmt(r.get("fid")),
                        ]
                        for name, r in [*runs.items(), *self._floor_row()]
                    ],
                }
            )
            per_model = digits.get("scores") or {}
            classes = list(dict.fromkeys(c for a in per_model.values() for c in (a.get("per_class") or {})))
            s.tables.append(
                {
                    "caption": "prompt accuracy per prompted class",
                    "header": ["model", *classes],
                    "rows": [
                        [name, *[_fmt((a.get("per_class") or {}).get(c)) for c in classes]]
                        for name, a in per_model.items()
                    ],
                }
            )
            if "val_accuracy" in clf:
                s.notes.append(
                    f"Judge: the {clf.get('judge', 'classifier')}, trained by flowfleet on the first "
                    f"{clf.get('train_items', '?')} MNIST-5k digits (the first of the 10,000 too: one judge for every "
                    f"run on the built-in digits), validation accuracy {_fmt(clf.get('val_accuracy'))} on the other "
                    f"{clf.get('val_items', '?')} (reports/digit_classifier/)."
                )
            else:
                s.notes.append(f"Judge: {clf.get('judge', '?')}.")
            reference = self._reference_note()
            if reference:
                s.notes.append(reference)
        else:
            s.tables.append(
                {
                    "caption": "FID per strategy (lower is better)",
                    "header": ["model", "FID"],
                    "rows": [[name, f"{v:.2f}"] for name, v in scores.items()],
                }
            )
        draws = self.evaluation.get("draws")
        if draws:
            s.tables.append(draws_table(draws))
        fleets = self.evaluation.get("fleets") or {}
        if fleets:
            s.notes.append(
                "A row STRATEGY@NAME is another fleet in the same latent space, sampled with the same prompts and "
                "noise (evaluate --fleet NAME=FOLDER): " + "; ".join(f"{k}: {v}" for k, v in fleets.items()) + "."
            )
        for name, r in runs.items():
            if r.get("same_as"):
                s.notes.append(
                    f"{name} selects the same experts with the same weights as {r['same_as']} "
                    f"(k is at least the number of experts): its samples are {r['same_as']}'s."
                )
        split = self.evaluation.get("reference_split") or {}
        held_out = split.get("held_out")
        s.notes.append(
            f"Feature network {fid.get('extractor', '?')} at {fid.get('resize', '?')} px input; "
            f"{fid.get('generated_images', '?')} generated images against {fid.get('reference_images', '?')} "
            + (
                "reference images held out of training (eval/, data.holdout)."
                if held_out
                else "reference images of data/ (the training items: the run holds none out, data.holdout)."
            )
        )
        guidance = self.evaluation.get("guidance") or {}
        sweeps = {
            name: [{**rec, "chosen": rec["cfg"] == r.get("cfg")} for rec in r["sweep"]]
            for name, r in runs.items()
            if r.get("sweep") and not r.get("same_as")
        }
        if sweeps:
            s.notes.append(
                f"Guidance sweep: every model sampled at scales {guidance.get('sweep')}; its row above is the scale "
                f"with the lowest classifier FD among those with prompt accuracy >= {guidance.get('min_accuracy')} "
                "(the most accurate when none reaches it), the large dot in the plot."
            )
            floor = split.get("floor") or {}
            s.images.append(
                self._plot("guidance.png", views.guidance_sweep_png(sweeps, floor), "guidance sweep per model")
            )
        if fid.get("standard_input") is False:
            s.notes.append(
                "Non-standard Inception input size: compare these numbers only with FIDs computed "
                "at the same size and sample counts, not with published FIDs."
            )
        s.images.append(self._plot("fid.png", views.fid_png(scores), "FID"))
        return s

    def _reference_note(self) -> str:
        """Which real images every distance is measured against (the same for every run of one source)."""
        split = self.evaluation.get("reference_split") or {}
        source = split.get("source") or {}
        if not split.get("reference_images") or not source:
            return ""
        what = describe_source(source)
        where = "held out of training (eval/)" if split.get("held_out") else "of the training data (data/)"
        floor = (split.get("floor") or {}).get("n")
        return (
            f"Reference: {split['reference_images']} images {where} of {what}"
            + (f"; the real floor: {floor} others of them" if floor else "")
            + "."
        )

    def _floor_row(self) -> list[tuple[str, dict[str, Any]]]:
        floor = (self.evaluation.get("reference_split") or {}).get("floor") or {}
        return [(f"real images (n {floor['n']})", floor)] if floor.get("n") else []

    def section_adherence(self) -> Section:
        s = Section("adherence", TITLES["adherence"])
        if self._needs_evaluation(s):
            return s
        adh = self.evaluation.get("adherence")
        if not adh:
            s.notes.append("Not applicable: prompt adherence is measured for the shapes source only.")
            return s
        s.tables.append(
            {
                "caption": "share of samples whose drawn colour and shape match the prompt",
                "header": ["model", "colour and shape", "colour", "shape", "samples"],
                "rows": [
                    [name, _fmt(a.get("both")), _fmt(a.get("colour")), _fmt(a.get("shape")), a.get("n")]
                    for name, a in adh.items()
                ],
            }
        )
        return s

    def section_diagnostics(self) -> Section:
        s = Section("diagnostics", TITLES["diagnostics"])
        if self._needs_evaluation(s):
            return s
        diag = self.evaluation.get("diagnostics") or {}
        acc = diag.get("router_accuracy")
        if acc:
            held = diag.get("router_accuracy_heldout")
            caption = f"router accuracy against the cluster of x0, {acc.get('items', '?')} training items"
            if held:
                caption += f" and {held['items']} held-out items (each in the cluster of its nearest fine centroid)"
            s.images.append(
                self._plot(
                    "router_accuracy.png",
                    views.router_accuracy_png(
                        acc["t_buckets"], acc["accuracy"], acc.get("chance"), heldout=held["accuracy"] if held else None
                    ),
                    caption,
                )
            )
        align = diag.get("alignment") or {}
        if align:
            s.tables.append(
                {
                    "caption": "expert-data alignment: semantic distance (L2-normalised clustering features) of generated "
                    "samples to the centroid of their dominant expert vs. the other centroids, and how often "
                    "the sample falls in its dominant expert's cluster (chance: the largest cluster's share)",
                    "header": ["model", "to dominant", "to others", "in dominant's cluster", "chance", "samples"],
                    "rows": [
                        [
                            n,
                            _fmt(a.get("dominant_distance")),
                            _fmt(a.get("other_distance")),
                            _fmt(a.get("assigned_is_dominant")),
                            _fmt(a.get("chance")),
                            a.get("n"),
                        ]
                        for n, a in align.items()
                    ],
                }
            )
        gen = diag.get("generalization")
        if gen:
            s.tables.append(generalization_table(gen))
        dis = diag.get("disagreement") or {}
        if dis:
            s.images.append(
                self._plot(
                    "disagreement.png",
                    views.disagreement_png({n: (d["t"], d["spread"]) for n, d in dis.items()}),
                    "spread of the K experts' velocities at the states each strategy visits",
                )
            )
        usage = diag.get("usage") or {}
        if usage:
            s.images.append(self._plot("usage.png", views.usage_png(usage), "share of the ensemble weight per expert"))
        if not s.images and not s.tables:
            s.missing = "the evaluation computed no diagnostics"
        return s

    def section_timings(self) -> Section:
        s = Section("timings", TITLES["timings"])
        stages = _json(self.root, REPORTS, TIMINGS_FILE) or {}
        if stages:
            s.tables.append(
                {
                    "caption": "stages (flowfleet demo)",
                    "header": ["stage", "seconds"],
                    "rows": [[k, _fmt(v)] for k, v in stages.items()],
                }
            )
        rows = []
        for job in job_dirs(self.root):
            w = _wall_time(read_metrics(self.root, job))
            if w is not None:
                rows.append([job_label(job), _fmt(w)])
        if rows:
            s.tables.append(
                {"caption": "training jobs (first to last logged step)", "header": ["job", "seconds"], "rows": rows}
            )
        ev = (self.evaluation or {}).get("timings") or {}
        if ev:
            s.tables.append(
                {"caption": "evaluation", "header": ["part", "seconds"], "rows": [[k, _fmt(v)] for k, v in ev.items()]}
            )
        if not s.tables:
            s.missing = "no timings recorded yet"
        return s


def _cluster_rows(rep: dict[str, Any]) -> list[list[Any]]:
    """[cluster, items, "label: count, ..."] per cluster of a clusters/report.json (the most frequent labels)."""
    mixes = rep.get("label_mix") or []
    rows = []
    for k, size in enumerate(rep.get("sizes") or []):
        mix = mixes[k] if k < len(mixes) and isinstance(mixes[k], dict) else {}
        shown = sorted(mix.items(), key=lambda kv: -kv[1])[:MIX_LABELS]
        rows.append([k, size, ", ".join(f"{lab}: {cnt}" for lab, cnt in shown)])
    return rows


def _spread(values: list[float]) -> str:
    """mean ± sd (the sample sd) of a metric over evaluation draws."""
    if len(values) < 2:
        return _fmt(values[0]) if values else ""
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def draws_table(draws: dict[str, Any]) -> dict[str, Any]:
    """Each model's figures over the evaluation draws (evaluate --repeats): mean ± sd, its distance over the
    real floor of the same draw, and a fleet row's distance over the monolith's of the same draw."""
    seeds, floor, runs = draws["seeds"], draws["floor"], draws["runs"]
    metric = "classifier_fd" if "classifier_fd" in floor else "fid"
    mono = runs.get("monolith", {}).get(metric)

    def ratios(a: list[float], b: list[float] | None) -> str:
        return _spread([x / y for x, y in zip(a, b)]) if b and all(v is not None for v in [*a, *b]) else ""

    rows = [
        [
            name,
            _spread(r[metric]),
            ratios(r[metric], floor.get(metric)),
            "" if name == "monolith" else ratios(r[metric], mono),
            *[
                _spread(r[k]) if r.get(k) and None not in r[k] else ""
                for k in ("prompt_accuracy", "precision", "recall")
            ],
        ]
        for name, r in runs.items()
    ]
    rows.append(
        [
            "real images (the floor)",
            _spread(floor[metric]),
            "",
            "",
            "",
            *[_spread(floor[k]) if k in floor and None not in floor[k] else "" for k in ("precision", "recall")],
        ]
    )
    distance = "classifier FD" if metric == "classifier_fd" else "FID"
    return {
        "caption": f"over {len(seeds)} evaluation draws (seeds {seeds[0]}–{seeds[-1]}), each model at its chosen "
        f"scale: every draw samples other prompts and noise and splits the held-out reference and the real floor "
        f"afresh, so these are mean ± sd over draws. A {distance} at this sample count moves by several points "
        "from draw to draw; the ratios are taken draw by draw (the same reference, prompts and noise)",
        "header": [
            "model",
            distance,
            "÷ floor",
            "÷ monolith",
            "prompt accuracy",
            "precision",
            "recall",
        ],
        "rows": rows,
    }


def generalization_table(gen: dict[str, Any]) -> dict[str, Any]:
    """Each expert's and the monolith's loss on training and held-out items of the expert's cluster."""

    def cells(r: dict[str, Any]) -> list[str]:
        out = []
        for name in ("expert", "monolith"):
            train, held = r.get(f"{name}_train"), r.get(f"{name}_heldout")
            gap = held - train if train is not None and held is not None else None
            out += [_fmt(train), _fmt(held), "" if gap is None else f"{gap:+.4f}"]
        return out

    rows = [[f"expert {r['expert']}", r["items"]["train"], r["items"]["heldout"], *cells(r)] for r in gen["clusters"]]
    rows.append(
        [
            "all (item-weighted)",
            "",
            "",
            *cells({f"{m}_{s}": v for m, d in gen["summary"].items() for s, v in d.items()}),
        ]
    )
    return {
        "caption": "do the experts generalise? flow-matching loss (velocity MSE, condition on, mean over "
        f"{len(gen['t'])} t bins) of each expert and of the monolith on training items and on held-out items of "
        "the expert's cluster, the same items and noise for both. An expert whose held-out loss is well above "
        "its training loss and above the monolith's is short of data: the regime in which a fleet trails a "
        "monolith of the same FLOPs",
        "header": [
            "cluster",
            "train items",
            "held-out items",
            "expert train",
            "expert held-out",
            "expert gap",
            "monolith train",
            "monolith held-out",
            "monolith gap",
        ],
        "rows": rows,
    }


def router_accuracy_table(routers: dict[str, dict[str, Any]], kinds: dict[str, str]) -> dict[str, Any]:
    """Accuracy per t-bucket of each router (rows), from its report.json."""
    buckets = next(iter(routers.values()))["t_buckets"]
    return {
        "caption": "router accuracy against the cluster of x0, per t-bucket (t = 1 is noise); chance = the "
        "largest cluster's share",
        "header": ["router", "sees", *[f"t {lo:.1f}-{hi:.1f}" for lo, hi in buckets], "overall", "chance"],
        "rows": [
            [
                name,
                kinds.get(name, ""),
                *[_fmt(a) for a in rep["accuracy"]],
                _fmt(rep.get("overall_accuracy")),
                _fmt(rep.get("chance")),
            ]
            for name, rep in routers.items()
        ],
    }


def _json_yaml(root: RunRoot) -> dict[str, Any] | None:
    try:
        raw = root.read_yaml(RUN_FILE) if root.exists(RUN_FILE) else None
    except ValueError:
        return None
    return raw if isinstance(raw, dict) else None


def _wall_time(records: list[dict[str, Any]]) -> float | None:
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    return (max(times) - min(times)) if len(times) >= 2 else None


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# --------------------------------------------------------------------------------------------------
#                                         The page
# --------------------------------------------------------------------------------------------------

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>flowfleet report: {{ name }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
nav a { margin-right: 1em; } section { border-top: 1px solid #ccc; padding-top: .5em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 90%; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
figure { display: inline-block; margin: .5em; vertical-align: top; } figcaption { font-size: 85%; color: #555; }
img { max-width: 100%; image-rendering: pixelated; } pre { background: #f6f6f6; padding: .8em; overflow-x: auto; }
.missing { color: #a60; } ol.prompts { columns: 3; font-size: 80%; }
</style></head><body>
<h1>flowfleet report: {{ name }}</h1>
<p>Generated {{ created }} from {{ url }}.</p>
<nav>{% for s in sections %}<a href="#{{ s.id }}">{{ s.title }}</a>{% endfor %}</nav>
{% for s in sections %}
<section id="{{ s.id }}"><h2>{{ s.title }}</h2>
{% if s.missing %}<p class="missing">Not available: {{ s.missing }}</p>{% endif %}
{% for n in s.notes %}<p>{{ n }}</p>{% endfor %}
{% for t in s.tables %}<table><caption>{{ t.caption }}</caption>
<tr>{% for h in t.header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endfor %}
{% if s.pre %}<pre>{{ s.pre }}</pre>{% endif %}
{% for im in s.images %}<figure><img src="{{ im.data }}" alt="{{ im.caption }}"><figcaption>{{ im.caption }}</figcaption></figure>{% endfor %}
{% for l in s.lists %}<details><summary>{{ l.caption }}</summary><ol class="prompts" start="0">{% for item in l["items"] %}<li>{{ item }}</li>{% endfor %}</ol></details>{% endfor %}
</section>
{% endfor %}
</body></html>
"""


def render(sections: list[Section], *, name: str, url: str) -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        sections=sections, name=name, url=url, created=time.strftime("%Y-%m-%d %H:%M:%S")
    )


def write_report(run_root: str | RunRoot) -> str:
    """Build reports/report.html (and reports/plots/*.png) from whatever the run root holds; returns its URL."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    if not root.exists():
        raise FlowfleetError(f"{root.url}: no such run root")
    builder = ReportBuilder(root)
    sections = builder.build()
    cfg = _json_yaml(root) or {}
    for name, png in builder.plots.items():
        root.write_bytes(png, REPORTS, "plots", name)
    root.write_bytes(render(sections, name=str(cfg.get("name", root.url)), url=root.url).encode(), REPORTS, REPORT_FILE)
    return root.url_of(REPORTS, REPORT_FILE)
