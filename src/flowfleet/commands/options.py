"""The options several stages share, declared once each with one default and one help text."""

from __future__ import annotations

import argparse
import inspect
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence, TypeVar, get_args, get_origin

from flowfleet.errors import FlowfleetError
from flowfleet.parallel.mode import DEFAULT_PARALLEL, DISPLACED_WARMUP, PARALLEL_MODES

if TYPE_CHECKING:
    from pydantic import ValidationError

T = TypeVar("T")


def add_command(
    sub: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], **kwargs: Any
) -> argparse.ArgumentParser:
    """A stage's sub-command, documented where it runs: the first paragraph of `run`'s docstring is its line in
    `flowfleet --help`, the rest its description in `flowfleet NAME --help` (as click and typer do); `run(args)`
    returns the exit code. kwargs go to add_parser (epilog, formatter_class, a description of its own)."""
    summary, _, description = (inspect.getdoc(run) or "").partition("\n\n")
    kwargs.setdefault("description", description or summary)
    p = sub.add_parser(name, help=" ".join(summary.split()), **kwargs)
    p.set_defaults(func=run)
    return p


def add_run_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_root", metavar="RUN_ROOT", help="run folder or fsspec URL (s3://bucket/run)")


def add_model_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="DIR", help="assembled model folder (flowfleet assemble's output)")


def add_device(p: argparse.ArgumentParser) -> None:
    """--device, as flowfleet.device.resolve_device reads it."""
    p.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | cuda:N (default auto: this process's GPU when there is one, else the CPU)",
    )


def add_progress(p: argparse.ArgumentParser, *aliases: str) -> None:
    """--no-progress (args.progress False): no progress bars; messages still go to the log (-q for fewer)."""
    p.add_argument("--no-progress", *aliases, dest="progress", action="store_false", help="no progress bars")


# the shorter flags sampling settings also answer to (the guidance scale is CFG's)
FLAG_ALIASES = {"guidance_scale": ("--cfg",), "guidance_max_t": ("--cfg-max-t",)}


def add_sampling(p: argparse.ArgumentParser, *, without: Sequence[str] = ()) -> None:
    """An option for every sampling setting (config.SamplingSettings; --route-every for route_every), its help the
    field's description; unset (None), a setting is the model folder's (`sampling_choices` leaves it out)."""
    from flowfleet.config import SAMPLING_CHOICES, SamplingConfig, SamplingSettings

    for name in SAMPLING_CHOICES:
        if name in without:
            continue
        info = SamplingSettings.model_fields[name]
        # int, float or str; a value of its own type (a Strategy) is given as text, which the settings parse
        kind: dict[str, Any] = {"type": info.annotation if info.annotation in (int, float, str) else str}
        if get_origin(info.annotation) is Literal:
            kind = {"choices": get_args(info.annotation)}
        default = "the fleet's" if name in SamplingConfig.model_fields else info.default
        flags = [f"--{name.replace('_', '-')}", *FLAG_ALIASES.get(name, ())]
        p.add_argument(*flags, default=None, help=f"{info.description} (default: {default})", **kind)


def sampling_choices(args: argparse.Namespace, *, without: Sequence[str] = ()) -> dict[str, Any]:
    """The sampling settings the command line set (add_sampling's options), as keywords for a sampling call."""
    from flowfleet.config import SAMPLING_CHOICES

    return {n: getattr(args, n) for n in SAMPLING_CHOICES if n not in without and getattr(args, n) is not None}


def add_data_source(p: argparse.ArgumentParser, source_default: str | None = None) -> None:
    """--source/--path/--labels/--limit: where new data comes from, as run.yaml `data` says it (`data_config`)."""
    p.add_argument(
        "--source",
        required=source_default is None,
        default=source_default,
        metavar="SOURCE",
        # the names are DataConfig.source's (their one home): a wrong one is refused listing them
        help="where the data comes from, as run.yaml data.source: mnist, shapes, folder, parquet, ..."
        + (f" (default {source_default})" if source_default else ""),
    )
    p.add_argument("--path", default=None, help="folder / tar glob / parquet glob / save_to_disk folder")
    p.add_argument("--labels", default=None, metavar="LIST", help="keep only these class labels, e.g. 8,9")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N items of the source")


def data_config(args: argparse.Namespace, **like: Any) -> Any:
    """config.DataConfig from add_data_source's options and `like` (image_size, channels, ...: the fleet's)."""
    from pydantic import ValidationError

    from flowfleet.config import ConfigError, DataConfig
    from flowfleet.errors import validation_message

    try:
        labels = [int(v) for v in args.labels.split(",") if v.strip()] if args.labels else None
    except ValueError:
        raise ConfigError(f"--labels: {args.labels!r} is not a comma-separated list of integers") from None
    fields = {"source": args.source, "path": args.path, "labels": labels, "limit": args.limit}
    try:
        return DataConfig(**like, **fields)
    except ValidationError as err:
        raise ConfigError(f"--source {args.source}: {validation_message(err)}") from None


def add_parallel(p: argparse.ArgumentParser) -> None:
    """--nproc/--parallel/--warmup/--ulysses-degree: one image split over N processes (flowfleet.parallel)."""
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="split each image over N processes (DistriFusion patch parallelism: one GPU each, or "
        "CPU processes); relaunches itself under torchrun unless already inside one (default 1)",
    )
    p.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default=DEFAULT_PARALLEL,
        help="with --nproc: how image bands exchange attention keys/values: this step's (sync, "
        "exact), the previous step's, overlapped with compute (displaced), or never (naive); or exact "
        "sequence parallelism: an all-to-all over heads (ulysses, heads must divide by the bands), keys/values "
        "around a ring (ring), or both (usp: Ulysses inside groups of bands, ring across them)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=DISPLACED_WARMUP,
        metavar="W",
        help=f"with --parallel displaced: synchronous steps after the first one (default {DISPLACED_WARMUP})",
    )
    p.add_argument(
        "--ulysses-degree",
        type=int,
        default=None,
        metavar="U",
        help="with --parallel usp: Ulysses inside groups of U bands, ring across the groups (default: the "
        "largest U dividing the bands and every expert's heads)",
    )


def relaunch_parallel(args: argparse.Namespace) -> int | None:
    """With --nproc N > 1 outside torchrun: this same command relaunched on N ranks (its exit code);
    else None, and the command runs here (every rank runs it under torchrun)."""
    if args.nproc <= 1:
        return None
    from flowfleet.distributed import in_torchrun
    from flowfleet.parallel.launch import relaunch_torchrun

    return None if in_torchrun() else relaunch_torchrun(args.nproc, args.argv)


def settings_from(cls: type[T], args: argparse.Namespace, fields: Sequence[str], **more: Any) -> T:
    """A validated settings model from the options of the same names (and `more`); a one-line error
    naming the option at fault."""
    from pydantic import ValidationError

    try:
        return cls(**{f: getattr(args, f) for f in fields}, **more)
    except ValidationError as err:
        raise option_error(err) from None


def option_error(err: "ValidationError") -> FlowfleetError:
    """A settings model's first validation error as the option at fault: '--max-batch: ...'. A check across
    fields (pydantic's "(root)") names its first field itself."""
    from flowfleet.errors import validation_message

    return FlowfleetError("--" + validation_message(err).removeprefix("(root): ").replace("_", "-"))
