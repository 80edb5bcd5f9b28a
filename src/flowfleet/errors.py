"""User-facing errors: the CLI prints their message as one line and exits 1 (no traceback); and how a validated
document (run.yaml, a model folder's JSON, a request) says its first fault as that line."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Doc = TypeVar("Doc", bound=BaseModel)


class FlowfleetError(ValueError):
    """Bad input or state that a user can fix; the message names the file, field or expert at fault."""


class ParameterError(FlowfleetError):
    """A parameter of a library function at fault. `where` names it, with its value where that helps ("ref_n",
    "expert 5"); the message reads "ref_n: must be >= 2". The command line, which knows the flag that set the
    parameter, says it as that flag instead ("--ref-n: must be >= 2": flowfleet.cli)."""

    def __init__(self, where: str, message: str):
        self.parameter, _, self.value = where.partition(" ")
        self.message = message
        super().__init__(f"{where}: {message}")

    def as_flag(self, flag: str) -> str:
        """The message with the parameter said as its command-line flag."""
        return f"{flag}{' ' + self.value if self.value else ''}: {self.message}"


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
