"""The report's sections on what the run did (clusters, training, timings), read from the run root's files;
quality.py has those read from the evaluation's scores, builder.py the rest."""

from __future__ import annotations

import posixpath
from typing import Any

from flowfleet.errors import FlowfleetError
from flowfleet.evaluate import views
from flowfleet.evaluate.report.parts import (
    EVALUATION_FILE,
    MIX_LABELS,
    TIMINGS_FILE,
    TITLES,
    BuilderBase,
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
from flowfleet.evaluate.report.tables import cluster_rows, router_accuracy_table
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
    SAMPLES,
    STATUS_FILE,
)
from flowfleet.storage import RunRoot


class RunSections(BuilderBase):
    """The sections read from the run's own files: its clusters, each job's training, the stages' timings."""

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

    def _matching(self) -> str | None:
        """The run's compute-matching convention in one line (train.split), or None where run.yaml does not load."""
        from flowfleet.config import load_run_config
        from flowfleet.train.specs import compute_matching

        try:
            return compute_matching(load_run_config(self.root))
        except FlowfleetError:
            return None

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
