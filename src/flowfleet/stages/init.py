"""Stage `init`: write RUN_ROOT/run.yaml from a preset."""

from __future__ import annotations

from typing import Sequence

from flowfleet.errors import FlowfleetError
from flowfleet.layout import RUN_FILE
from flowfleet.presets import preset
from flowfleet.storage import RunRoot


def init_run(run_root: str, preset_name: str, *, force: bool = False, sets: Sequence[str] = ()) -> str:
    """Create run.yaml (validated) in run_root from a preset and `sets` ("data.path=/my/images"); refuses to
    overwrite unless force. Returns its URL."""
    root = RunRoot(run_root)
    if root.exists(RUN_FILE) and not force:
        raise FlowfleetError(f"{root.url_of(RUN_FILE)}: already exists (use --force to overwrite)")
    try:
        cfg = preset(preset_name, sets=sets, name=run_root.rstrip("/").split("/")[-1] or preset_name)
    except FlowfleetError:
        raise
    except ValueError as err:  # pydantic's, already one line (flowfleet.config)
        raise FlowfleetError(str(err)) from None
    cfg.save(root)
    return root.url_of(RUN_FILE)
