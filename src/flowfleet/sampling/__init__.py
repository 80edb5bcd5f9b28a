"""Routed sampling of an assembled fleet (paris §2.7): `assemble`'s folder in, images out.

folder.py    the assembled model folder: model_index.json (the assemble -> generate contract), SHA256SUMS, opening it
store.py     ExpertStore: experts loaded lazily, at most M resident (--offload M)
routing.py   per-sample top-k: group samples by expert, run each selected expert on its samples only
trace.py     RoutingTrace: what the router chose per step and sample (routing.json)
pipeline.py  FleetPipeline: from_pretrained, the per-step velocity seam, the condition, the sampling loop
views.py     image grid, router-probability heatmap, expert-usage bars
"""

from flowfleet.sampling.folder import ModelIndex, SchedulerConfig, read_model_index
from flowfleet.sampling.pipeline import FleetOutput, FleetPipeline, RoutedVelocity, SamplingSettings
from flowfleet.sampling.routing import Condition, ExecutionStats, Selection, run_selected, select_experts
from flowfleet.sampling.store import ExpertStore
from flowfleet.sampling.trace import RoutingTrace

__all__ = [
    "ModelIndex",
    "SchedulerConfig",
    "read_model_index",
    "FleetOutput",
    "FleetPipeline",
    "RoutedVelocity",
    "SamplingSettings",
    "Condition",
    "ExecutionStats",
    "Selection",
    "run_selected",
    "select_experts",
    "ExpertStore",
    "RoutingTrace",
]
