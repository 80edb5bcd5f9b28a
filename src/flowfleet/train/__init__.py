"""Training jobs: K isolated experts, the router and the monolith, through one loop.

specs.py       JobSpec: a job's name, folder, command line (built once for every backend), steps and cost
tasks.py       the tasks a JobSpec becomes: expert/monolith flow matching, router CE, distillation
loop.py        Trainer: the one training loop (AdamW, EMA, accumulation, AMP, DDP, checkpoints, signals)
data.py        shard sets in memory, seeded batches with a resumable position, shape checks
stream.py      shard sets read batch by batch from their files (train.loader: stream)
feed.py        a job's next batches read ahead while a step computes (train.prefetch)
checkpoint.py  safetensors + JSON checkpoints, written so that a crash leaves the previous one loadable
ema.py         EMA of the weights (what gets sampled and saved as final/)
status.py      status.json and the heartbeat lease of a running job
metrics.py     metrics.jsonl + TensorBoard events
preview.py     sample grids and router accuracy plots
fanout.py      train-all: every job as a local OS process, N at a time

A job's processes under torchrun (DDP) form its own world (flowfleet.distributed), never two jobs'.
"""
