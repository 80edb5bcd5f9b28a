"""What every section of run.yaml is: a strict pydantic model (an unknown key is an error), the error a run
configuration that cannot be used raises, and how any validated document (run.yaml, a model folder's JSON, a
request) says its first fault in one line."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from flowfleet.errors import FlowfleetError

Doc = TypeVar("Doc", bound=BaseModel)


class ConfigError(FlowfleetError):
    """A run configuration that cannot be used; the message names the file and key."""


class Strict(BaseModel):
    """A run.yaml section: an unknown key is an error, and so is an assignment its checks refuse."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def validation_message(err: ValidationError) -> str:
    """The first pydantic error as 'dotted.key: message' on one line. flowfleet's model-level validators phrase
    their messages as 'key: message' relative to the section they validate; those keys are joined onto its path."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "value_error":
        key, sep, rest = msg.partition(": ")
        if sep and key.replace(".", "").replace("_", "").isalnum():
            loc, msg = loc + [key], rest
    return f"{'.'.join(loc) or '(top level)'}: {msg}"


def validated(model: type[Doc], raw: Any, where: str, error: type[Exception], expected: str = "a JSON object") -> Doc:
    """A parsed document (JSON, YAML) as the pydantic `model`, or `error` in one line naming `where` and the field
    at fault."""
    if not isinstance(raw, dict):
        raise error(f"{where}: expected {expected}")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise error(f"{where}: {validation_message(err)}") from None
