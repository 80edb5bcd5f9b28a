"""Evaluation of a fleet: FID, prompt adherence, routing diagnostics, and the HTML report.

inception.py    the FID feature network (offline default_1 Inception, or torch-fidelity's), uint8 in
fid.py          FID with torchmetrics; feature statistics cached in RUN_ROOT/reports/
adherence.py    shapes source: does the drawn colour and shape match the prompt (measured from pixels)
diagnostics.py  router accuracy per t-bucket, centroid distances, expert disagreement, expert usage
report/         RUN_ROOT/reports/report.html, viewable offline: the results first (one module per concern)
"""
