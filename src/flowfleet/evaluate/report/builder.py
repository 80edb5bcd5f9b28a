"""The report's sections other than quality (quality.py), one method each, in the order of SECTIONS."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from flowfleet.errors import FlowfleetError
from flowfleet.evaluate import views
from flowfleet.evaluate.report.parts import (
    EVALUATION_FILE,
    MIX_LABELS,
    SECTIONS,
    TIMINGS_FILE,
    TITLES,
    Section,
    Table,
    fmt,
    job_dirs,
    job_label,
    read_json,
    read_metrics,
    run_yaml,
    wall_time,
)
from flowfleet.evaluate.report.quality import QualitySections
from flowfleet.evaluate.report.tables import cluster_rows, generalization_table, router_accuracy_table
from flowfleet.layout import (
    CLUSTER_REPORT,
    CLUSTERS,
    DATA,
    FINAL,
    INDEX_FILE,
    JOB_REPORT,
    MANIFEST,
    MODEL,
    REPORTS,
    ROUTERS,
    RUN_FILE,
    SAMPLES,
    SHOWCASE,
    STATUS_FILE,
)
from flowfleet.storage import RunRoot


class ReportBuilder(QualitySections):
    """Reads a run root and fills one Section per id in SECTIONS."""

    def build(self) -> list[Section]:
        """Every section, in the page's order: SECTIONS, their HTML ids."""
        sections = [
            self.section_overview,
            self.section_samples,
            self.section_fid,
            self.section_clusters,
            self.section_training,
            self.section_routing,
            self.section_adherence,
            self.section_diagnostics,
            self.section_timings,
            self.section_config,
        ]
        built = [section() for section in sections]
        if [s.id for s in built] != list(SECTIONS):  # a programming error, caught by the report's tests
            raise RuntimeError(f"report sections {[s.id for s in built]} are not SECTIONS {list(SECTIONS)}")
        return built

    # -- overview, config ---------------------------------------------------------------------------

    def section_overview(self) -> Section:
        """What the run found, first: one line on the run, then each model's scores (results_table)."""
        s = Section("overview", TITLES["overview"])
        cfg = run_yaml(self.root)
        manifest = read_json(self.root, DATA, MANIFEST)
        if cfg:
            data = cfg.get("data", {})
            s.notes.append(
                f"Run {cfg.get('name', '?')} ({self.root.url}): source {data.get('source', '?')}"
                + (f", {manifest.get('count', '?')} training items" if manifest else "")
                + f", {data.get('image_size', '?')} px, K = {cfg.get('cluster', {}).get('k', '?')} experts."
            )
        if self._needs_evaluation(s):
            return s
        table = self.results_table()
        if table:
            s.tables.append(table)
        return s

    def section_config(self) -> Section:
        s = Section("config", TITLES["config"])
        if not self.root.exists(RUN_FILE):
            s.missing = "run.yaml is missing: `flowfleet init RUN_ROOT --preset mnist`"
            return s
        s.pre = self.root.read_bytes(RUN_FILE).decode(errors="replace")
        if self.evaluation:
            settings = {k: self.evaluation.get(k) for k in ("model", "reference", "n", "seed", "sampling")}
            s.pre += "\n# evaluation (reports/evaluation.json)\n" + json.dumps(settings, indent=2)
        return s

    # -- clusters ------------------------------------------------------------------------------------

    def section_clusters(self) -> Section:
        s = Section("clusters", TITLES["clusters"])
        rep = read_json(self.root, *CLUSTER_REPORT)
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
        rows = cluster_rows(rep)
        if rows:
            s.tables.append(Table(caption=make_up, header=["cluster", "items", "labels"], rows=rows))
        # another fleet evaluated beside this one (evaluate --fleet): its own run root's clusters, when it has one
        for name, folder in ((self.evaluation or {}).get("fleets") or {}).items():
            other = read_json(RunRoot(posixpath.dirname(folder.rstrip("/"))), *CLUSTER_REPORT)
            if other and (rows := cluster_rows(other)):
                kind = (other.get("features") or {}).get("kind", "?")
                caption = f"the fleet of the rows STRATEGY@{name}: {kind} clusters' {make_up}"
                s.tables.append(Table(caption=caption, header=["cluster", "items", "labels"], rows=rows))
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
            st = read_json(self.root, job, STATUS_FILE) or {}
            speed = [r["samples_per_s"] for r in records if isinstance(r.get("samples_per_s"), (int, float))]
            rows.append(
                [
                    job_label(job),
                    st.get("state", "?"),
                    st.get("step", 0),
                    fmt(st.get("last_loss")),
                    fmt(sum(speed) / len(speed)) if speed else "",
                    fmt(wall_time(records)),
                ]
            )
        train = (run_yaml(self.root) or {}).get("train") or {}
        matching = self._matching()
        if matching:
            s.notes.append(f"{matching} (train.split {train.get('split', 'steps')}).")
        if train.get("expert_steps") == "by_size":
            shared = "the batch" if train.get("split") == "batch" else f"K x {train.get('steps', '?')} steps"
            s.notes.append(
                f"The experts share {shared} in proportion to their clusters' sizes "
                "(train.expert_steps by_size): each passes over its data as often as the monolith over all of it."
            )
        s.images.append(
            self._plot("loss_curves.png", views.loss_curves_png(curves), "loss of every job (metrics.jsonl)")
        )
        s.tables.append(
            Table(caption="jobs", header=["job", "state", "steps", "last loss", "samples/s", "wall s"], rows=rows)
        )
        routers = {
            name: rep for name in ROUTERS if (rep := read_json(self.root, name, JOB_REPORT)) and "accuracy" in rep
        }
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
            cfg = read_json(self.root, name, FINAL, "config.json") or {}
            sees = cfg.get("conditioning", "none") != "none"
            kinds[name] = "p(k | x_t, t, prompt)" if sees else "p(k | x_t, t) (Paris)"
        return kinds

    # -- evaluation ----------------------------------------------------------------------------------

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

    def section_adherence(self) -> Section:
        s = Section("adherence", TITLES["adherence"])
        if self._needs_evaluation(s):
            return s
        adh = self.evaluation.get("adherence")
        if not adh:
            s.notes.append("Not applicable: prompt adherence is measured for the shapes source only.")
            return s
        s.tables.append(
            Table(
                caption="share of samples whose drawn colour and shape match the prompt",
                header=["model", "colour and shape", "colour", "shape", "samples"],
                rows=[
                    [name, fmt(a.get("both")), fmt(a.get("colour")), fmt(a.get("shape")), a.get("n")]
                    for name, a in adh.items()
                ],
            )
        )
        return s

    def _matching(self) -> str | None:
        """The run's compute-matching convention in one line (train.split), or None where run.yaml does not load."""
        from flowfleet.config import load_run_config
        from flowfleet.train.specs import compute_matching

        try:
            return compute_matching(load_run_config(self.root))
        except FlowfleetError:
            return None

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
                        acc["t_buckets"],
                        acc["accuracy"],
                        acc.get("chance"),
                        heldout=held["accuracy"] if held else None,
                        heldout_without_prompt=(held.get("without_prompt") or {}).get("accuracy") if held else None,
                    ),
                    caption,
                )
            )
        align = diag.get("alignment") or {}
        if align:
            s.tables.append(
                Table(
                    caption="expert-data alignment: semantic distance (L2-normalised clustering features) of "
                    "generated samples to the centroid of their dominant expert vs. the other centroids, and how often "
                    "the sample falls in its dominant expert's cluster (chance: the largest cluster's share)",
                    header=["model", "to dominant", "to others", "in dominant's cluster", "chance", "samples"],
                    rows=[
                        [
                            n,
                            fmt(a.get("dominant_distance")),
                            fmt(a.get("other_distance")),
                            fmt(a.get("assigned_is_dominant")),
                            fmt(a.get("chance")),
                            a.get("n"),
                        ]
                        for n, a in align.items()
                    ],
                )
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
        stages = read_json(self.root, REPORTS, TIMINGS_FILE) or {}
        if stages:
            s.tables.append(
                Table(
                    caption="stages (flowfleet demo)",
                    header=["stage", "seconds"],
                    rows=[[k, fmt(v)] for k, v in stages.items()],
                )
            )
        rows = []
        for job in job_dirs(self.root):
            w = wall_time(read_metrics(self.root, job))
            if w is not None:
                rows.append([job_label(job), fmt(w)])
        if rows:
            s.tables.append(
                Table(caption="training jobs (first to last logged step)", header=["job", "seconds"], rows=rows)
            )
        ev = (self.evaluation or {}).get("timings") or {}
        if ev:
            s.tables.append(
                Table(caption="evaluation", header=["part", "seconds"], rows=[[k, fmt(v)] for k, v in ev.items()])
            )
        outputs = [
            (f"{DATA}/{MANIFEST}", "prepare"),
            ("/".join(CLUSTER_REPORT), "cluster"),
            (f"{MODEL}/{INDEX_FILE}", "assemble"),
            (f"{REPORTS}/{EVALUATION_FILE}", "evaluate"),
        ]
        if any(self.root.exists(path) for path, _ in outputs):
            s.tables.append(
                Table(
                    caption="stages' outputs",
                    header=["stage", "output", "present"],
                    rows=[[st, path, "yes" if self.root.exists(path) else "no"] for path, st in outputs],
                )
            )
        if not s.tables:
            s.missing = "no timings recorded yet"
        return s
