"""Stage `evaluate`: FID per routing strategy (and the monolith), prompt adherence, diagnostics.

    evaluate("runs/r/model", "runs/r", EvaluateOptions(n=1000, strategies=("top1", "top2", "full"), monolith=True))

On the built-in MNIST source every model is also judged by a digit classifier trained on MNIST-5k
(flowfleet.evaluate.digits): prompt accuracy (share of samples read as the prompted digit, with the
mean probability of that digit) and the Fréchet distance in the classifier's features ("classifier
FD"), which, unlike Inception FID at this size, tells a digit from a blob.

Every model samples the same n prompts (drawn from data/'s captions, seeded) from the same noise, so
the strategies are compared on identical inputs. The reference is the run's own prepared data/
(decoded from latents; a seeded random subset of `ref_n` items), its Inception statistics cached in
RUN_ROOT/reports/. Writes, under the reference run root:

    reports/evaluation.json             everything below, read by `flowfleet report`
    reports/samples/<name>.png          the first `grid` samples with their prompts
    reports/samples/<name>.npz          every scored sample: images uint8 [n, H, W, C], prompts, seed
    reports/digit_classifier/           (MNIST) the digit classifier behind prompt accuracy and classifier FD (a copy
                                        of the one this machine trained once)
    reports/samples/<name>.routing.png  router probabilities over the sampling steps (fleet strategies)
    reports/fid_ref_*.safetensors       the cached reference statistics

The stage's pieces live in flowfleet.evaluate: the reference items and the real floor (reference.py), FID
(fid.py), precision/recall, the judges, the diagnostics' probes (diagnostics.py) and the terminal table
(table.py). Options are validated (strategies parsed, the monolith finished, shapes matched) before anything
heavy is loaded. The encoders (transformers, the diffusers VAE) are imported only where one is built.

Modules: options.py (EvaluateOptions, ModelRun), draw.py (EvaluationDraw: one draw's inputs and what the models
drew on it, with scoring.py and sweep.py), record.py (evaluation.json), stage.py (evaluate; JudgedDraw: fleets
judged on one draw, nothing written; ValidationDraw: models scored on the validation split's draw), pieces.py
(choose_scale, the samples file, FID statistics), models.py (another fleet, comparison routers, the monolith),
probes.py (the generalisation and router-accuracy diagnostics).
"""

from __future__ import annotations

from flowfleet.stages.evaluate.options import EvaluateOptions, ModelRun
from flowfleet.stages.evaluate.pieces import choose_scale
from flowfleet.stages.evaluate.stage import JudgedDraw, ValidationDraw, evaluate

__all__ = ["EvaluateOptions", "JudgedDraw", "ModelRun", "ValidationDraw", "choose_scale", "evaluate"]
