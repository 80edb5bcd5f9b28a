"""evaluation.json: what one evaluation chose, drew and scored (docs/contracts.md, "Evaluation outputs")."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from flowfleet.evaluate.fid import fid_metadata
from flowfleet.layout import DATA, EVAL_DATA
from flowfleet.stages.evaluate.scoring import JUDGE_NAMES
from flowfleet.storage import RunRoot

if TYPE_CHECKING:
    from flowfleet.stages.evaluate.draw import EvaluationDraw


def evaluation_record(ev: "EvaluationDraw") -> dict[str, Any]:
    """evaluation.json (docs/contracts.md, "Evaluation outputs")."""
    o = ev.options
    sampling = {k: v for k, v in ev.settings.to_json().items() if k not in ("strategy", "k")}
    return {
        "model": ev.model_url,
        "reference": ev.root.url,
        "created": time.time(),
        "n": o.n,
        "seed": o.seed,
        "sampling": sampling,
        "fid": {
            **fid_metadata(o.fid, ev._fid_reference()[0].key, ev.ref_n, o.n),
            "scores": {name: r.fid for name, r in ev.runs.items()},
        },
        # What a perfect model would score at this n: real items, disjoint from the reference.
        "reference_split": {
            "set": EVAL_DATA if ev.split.held_out else DATA,
            "held_out": ev.split.held_out,
            "split": ev.split_name if ev.split.held_out else None,  # TEST: the held-out split the figures read
            "items": None if (pool := ev.splits.items(ev.split_name)) is None else int(pool.numel()),
            "source": ev.data.manifest().extra.get("source"),  # what prepare read (flowfleet.data.sources)
            "reference_images": ev.ref_n,
            "floor": ev.floor,
        },
        "validation_split": ev.validation,  # the choices' draw (None: no choice, or made on the figures' own)
        "guidance": (
            {
                "sweep": list(o.guidance_sweep),
                "min_accuracy": o.min_accuracy,
                "bounds": list(o.guidance_bounds),
                "extend": o.guidance_extend,
                "chosen_on": ev.validation["split"] if ev.validation else ev.split_name,
            }
            if o.guidance_sweep
            else None
        ),
        "runs": {name: r.to_json() for name, r in ev.runs.items()},
        "fleets": {name: RunRoot(folder).url for name, folder in o.fleets} or None,
        "adherence": ev.adherence or None,
        "prompt_accuracy": (
            {
                "classifier": {
                    "judge": JUDGE_NAMES.get(ev.builtin_judge() or "", o.judge or JUDGE_NAMES["digits"]),
                    **getattr(ev.judge, "record", {}),
                },
                "scores": ev.prompt_accuracy,
            }
            if ev.judge is not None
            else None
        ),
        "draws": ev.draws,
        "diagnostics": ev.diagnostics,
        "timings": ev.timings,
    }
