"""The report's quality section (each model's scores at its guidance scale, the real floor, the draws, the
guidance sweep) and the results table the page opens with."""

from __future__ import annotations

from typing import Any

from flowfleet.data.sources import describe_source
from flowfleet.evaluate import views
from flowfleet.evaluate.report.parts import TITLES, BuilderBase, Section, Table, fmt, run_yaml
from flowfleet.evaluate.report.tables import draws_table, one_draw


class QualitySections(BuilderBase):
    """The sections read from the evaluation's scores."""

    def results_table(self) -> Table | None:
        """The page's first table: each model at its guidance scale, its distance to the held-out reference (the
        judge's classifier FD, else FID), that distance over the real floor's and over the monolith's, prompt
        accuracy, precision and recall; over the evaluation's draws (mean ± sd, ratios draw by draw) when it made
        several. None before a model was scored."""
        runs = self._runs()
        draws = (self.evaluation or {}).get("draws")
        if not draws:
            if not any(r.get(m) is not None for r in runs.values() for m in ("classifier_fd", "fid")):
                return None
            draws = one_draw(runs, ((self.evaluation or {}).get("reference_split") or {}).get("floor") or {})
        table = draws_table(draws)
        header = [table.header[0], "cfg", *table.header[1:]]
        rows = [[row[0], fmt(runs.get(row[0], {}).get("cfg")), *row[1:]] for row in table.rows]
        n = len(draws["seeds"])
        over = f"mean ± sd over {n} evaluation draws (other prompts, noise and reference each)" if n > 1 else "one draw"
        return Table(
            caption=f"each model at its guidance scale (cfg; the lowest distance at the accuracy the evaluation "
            f"asks for), {over}; lower distances are better, the real floor is held-out real images scored like a "
            "model. Details: Quality below",
            header=header,
            rows=rows,
        )

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
        judged = self.evaluation.get("prompt_accuracy") or None
        if judged:
            self._judge_tables(s, runs, judged)
        else:
            s.tables.append(
                Table(
                    caption="FID per strategy (lower is better)",
                    header=["model", "FID"],
                    rows=[[name, f"{v:.2f}"] for name, v in scores.items()],
                )
            )
        draws = self.evaluation.get("draws")
        if draws:
            s.tables.append(draws_table(draws))
        self._model_notes(s, runs)
        split = self.evaluation.get("reference_split") or {}
        s.notes.append(
            f"Feature network {fid.get('extractor', '?')} at {fid.get('resize', '?')} px input; "
            f"{fid.get('generated_images', '?')} generated images against {fid.get('reference_images', '?')} "
            + (
                "reference images held out of training (eval/, data.holdout)."
                if split.get("held_out")
                else "reference images of data/ (the training items: the run holds none out, data.holdout)."
            )
        )
        self._guidance_sweep(s, runs, split)
        if fid.get("standard_input") is False:
            s.notes.append(
                "Non-standard Inception input size: compare these numbers only with FIDs computed "
                "at the same size and sample counts, not with published FIDs."
            )
        s.images.append(self._plot("fid.png", views.fid_png(scores), "FID"))
        return s

    def _judge_tables(self, s: Section, runs: dict[str, Any], judged: dict[str, Any]) -> None:
        """The judge's scores per model and per prompted class, what the judge is and what it is measured
        against."""
        clf = judged.get("classifier") or {}
        fine = any(r.get("subcategory_accuracy") is not None for r in runs.values())  # the emoji judge's
        s.tables.append(
            Table(
                caption="per model at its guidance scale (cfg): prompt accuracy (share of samples the judge "
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
                header=[
                    "model",
                    "cfg",
                    "prompt accuracy",
                    *(["subcategory accuracy"] if fine else []),
                    "confidence",
                    "classifier FD",
                    "precision",
                    "recall",
                    "FID",
                ],
                rows=[
                    [
                        name,
                        fmt(r.get("cfg")),
                        fmt(r.get("prompt_accuracy")),
                        *([fmt(r.get("subcategory_accuracy"))] if fine else []),
                        fmt(r.get("confidence")),
                        fmt(r.get("classifier_fd")),
                        fmt(r.get("precision")),
                        fmt(r.get("recall")),
                        fmt(r.get("fid")),
                    ]
                    for name, r in [*runs.items(), *self._floor_row()]
                ],
            )
        )
        per_model = judged.get("scores") or {}
        classes = list(dict.fromkeys(c for a in per_model.values() for c in (a.get("per_class") or {})))
        s.tables.append(
            Table(
                caption="prompt accuracy per prompted class",
                header=["model", *classes],
                rows=[
                    [name, *[fmt((a.get("per_class") or {}).get(c)) for c in classes]] for name, a in per_model.items()
                ],
            )
        )
        s.notes.append(_judge_note(clf))
        reference = self._reference_note()
        if reference:
            s.notes.append(reference)

    def _model_notes(self, s: Section, runs: dict[str, Any]) -> None:
        """The regime of each row, which rows are another fleet, and which sample the same experts as an earlier
        row."""
        regime = self._regime()
        if regime:
            s.notes.append(regime)
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

    def _regime(self) -> str:
        """Which regime the fleet's rows come from: Paris' (a router blind to the prompt) or DDM's (a router that reads
        it, the fleet guided over the mixture or inside each expert), each comparison router's, and the run's compute
        matching."""
        raw = run_yaml(self.root) or {}
        router = (raw.get("router") or {}).get("conditioning", "none")
        sampling = self.evaluation.get("sampling") or {}
        guided = "inside each expert" if sampling.get("guidance") == "expert" else "over the mixture"
        own = (
            f"DDM's regime: the fleet's router reads the prompt, p(k | x_t, t, prompt), the fleet guided {guided}"
            if router != "none"
            else "Paris' regime: the fleet's router is blind to the prompt, p(k | x_t, t)"
        )
        rows = [own]
        if raw.get("router_baseline"):
            rows.append("rows +router-paris: Paris' regime, the same experts routed by p(k | x_t, t)")
        if raw.get("router_prompt"):
            rows.append(f"rows +router-prompt: the same experts routed by p(k | x_t, t, prompt), guided {guided}")
        if any("." in name for name in self.evaluation.get("runs") or {}):
            rows.append("rows STRATEGY.RULE: guided over the mixture (mixture) or inside each expert (expert)")
        return "Regime: " + "; ".join(rows) + "."

    def _guidance_sweep(self, s: Section, runs: dict[str, Any], split: dict[str, Any]) -> None:
        """The guidance sweep's note and plot (each model's figures at every scale, the chosen one marked)."""
        guidance = self.evaluation.get("guidance") or {}
        sweeps = {
            name: [{**rec, "chosen": rec["cfg"] == r.get("cfg")} for rec in r["sweep"]]
            for name, r in runs.items()
            if r.get("sweep") and not r.get("same_as")
        }
        if not sweeps:
            return
        on = guidance.get("chosen_on")
        where = (
            "on the validation split (held-out images, prompts and noise of its own); the figures above are the "
            "test split's, at the chosen scale"
            if on == "validation"
            else "on the same draw as the figures above (the run has no validation split: run.yaml data.validation)"
        )
        s.notes.append(
            f"Guidance sweep: every model sampled at scales {guidance.get('sweep')} {where}; its row above is the "
            f"scale with the lowest classifier FD among those with prompt accuracy >= {guidance.get('min_accuracy')} "
            "(the most accurate when none reaches it), the large dot in the plot. Where the best lay at an edge, the "
            f"sweep went one scale further, within {guidance.get('bounds')}."
        )
        stops = [
            f"{name}: {r['sweep_stop']}" for name, r in runs.items() if r.get("sweep_stop") and not r.get("same_as")
        ]
        if stops:
            s.notes.append("The sweep stopped at its bound: " + "; ".join(stops) + ".")
        # the sweep's own draw: the validation split has no floor of its own (the test split's would be another
        # reference's distance)
        floor = {} if on == "validation" else split.get("floor") or {}
        s.images.append(self._plot("guidance.png", views.guidance_sweep_png(sweeps, floor), "guidance sweep per model"))

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


def _judge_note(clf: dict[str, Any]) -> str:
    """What the judge is, from its record in evaluation.json: the emoji judge, the digit judge, or --judge's."""
    if "val_subcategory_accuracy" in clf:  # the emoji judge (flowfleet.evaluate.emoji)
        return (
            f"Judge: the {clf.get('judge', 'classifier')}, trained by flowfleet on the set's "
            f"{clf.get('train_items', '?')} training emoji (one judge for every run on the built-in emoji, "
            f"weights sha256 {str(clf.get('sha256', '?'))[:16]}...), category accuracy "
            f"{fmt(clf.get('val_accuracy'))} and subcategory accuracy "
            f"{fmt(clf.get('val_subcategory_accuracy'))} on its {clf.get('val_items', '?')} held-out emoji, "
            "which no model and not the judge trained on."
        )
    if "val_accuracy" in clf:
        return (
            f"Judge: the {clf.get('judge', 'classifier')}, trained by flowfleet on the first "
            f"{clf.get('train_items', '?')} MNIST-5k digits (the first of the 10,000 too: one judge for every "
            f"run on the built-in digits), validation accuracy {fmt(clf.get('val_accuracy'))} on the other "
            f"{clf.get('val_items', '?')} (reports/digit_classifier/)."
        )
    return f"Judge: {clf.get('judge', '?')}."
