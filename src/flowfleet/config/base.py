"""What every section of run.yaml is: a strict pydantic model (an unknown key is an error), and the error a run
configuration that cannot be used raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from flowfleet.errors import FlowfleetError


class ConfigError(FlowfleetError):
    """A run configuration that cannot be used; the message names the file and key."""


class Strict(BaseModel):
    """A run.yaml section: an unknown key is an error, and so is an assignment its checks refuse."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
