"""The first-block cache (`--cache T`) on an assembled fleet: block evaluations saved, sampling time, and
the change of the evaluation's classifier FD and prompt accuracy, per threshold.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/step_cache.py --run runs/cache15 --thresholds 0 0.05 0.1 0.2 0.4

Each threshold is one `flowfleet evaluate RUN --strategies top2 --cfg C --n N --no-diagnostics --cache T`
(the same prompts and noise every time: evaluate's seed), run in this process through the stage function;
the run's reports/evaluation.json is overwritten each time, so point --run at a copy of a run folder.
T = 0 is the uncached reference. The machine is shared: sampling seconds are comparable within one run
of this script only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from flowfleet.stages.evaluate import EvaluateOptions, evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run folder (a copy: its evaluation.json is overwritten)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.4])
    p.add_argument("--strategy", default="top2")
    p.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the fleet's)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args()
    rows = []
    for threshold in a.thresholds:
        options = EvaluateOptions(
            n=a.n,
            strategies=(a.strategy,),
            sampling=dict(guidance_scale=a.cfg, cache=threshold),
            diagnostics=False,
            batch_size=100,
        )
        result = evaluate(str(Path(a.run) / "model"), options=options)
        run = result["runs"][a.strategy]
        rows.append(
            {
                "threshold": threshold,
                "blocks_saved": run["cache_saved"],
                "sampling_s": round(run["sampling_s"], 2),
                "classifier_fd": run["classifier_fd"],
                "prompt_accuracy": run["prompt_accuracy"],
                "precision": run["precision"],
                "recall": run["recall"],
                "cfg": run["cfg"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n| T | blocks saved | sampling s (x of T={base['threshold']}) | classifier FD | prompt accuracy |")
    for r in rows:
        ratio = r["sampling_s"] / base["sampling_s"]
        print(
            f"| {r['threshold']} | {r['blocks_saved']:.1%} | {r['sampling_s']} ({ratio:.2f}x)"
            f" | {r['classifier_fd']:.1f} | {r['prompt_accuracy']:.3f} |"
        )
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "command": " ".join(sys.argv)}
        Path(a.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
