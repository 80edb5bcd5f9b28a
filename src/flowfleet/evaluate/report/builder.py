"""The report: every section in the order of SECTIONS; the overview, samples, routing, adherence, diagnostics and
config sections here, the quality sections in quality.py, the run's clusters, training and timings in run.py."""

from __future__ import annotations

import json

from flowfleet.evaluate import views
from flowfleet.evaluate.report.parts import SECTIONS, TITLES, Section, Table, fmt, read_json, run_yaml
from flowfleet.evaluate.report.quality import QualitySections
from flowfleet.evaluate.report.run import RunSections
from flowfleet.evaluate.report.tables import generalization_table
from flowfleet.layout import DATA, MANIFEST, REPORTS, RUN_FILE, SHOWCASE


class ReportBuilder(QualitySections, RunSections):
    """Reads a run root and fills one Section per id in SECTIONS (the quality sections: QualitySections; the run's
    clusters, training and timings: RunSections)."""

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

    # -- training ------------------------------------------------------------------------------------

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
