"""The gate's one line: `refused (CHECK): FILE: why`, with whatever the package wrote in it (file names, captions, a
header's tensor names) shown so that no control character of the attacker's reaches a terminal or a page."""

from __future__ import annotations

from flowfleet.errors import FlowfleetError

SHOWN_CHARS = 160  # of a package's text in a refusal line


class Refused(FlowfleetError):
    """The gate's answer to a package it does not admit: one line, the check, the file or field, why."""

    def __init__(self, check: str, message: str):
        # one line of printable characters whatever reached the message (a schema's "got ..." quotes the package)
        printable = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in message.replace("\n", " "))
        super().__init__(f"refused ({check}): {printable}")
        self.check = check


def refusing(check: str) -> type[Refused]:
    """A Refused of `check` made from its message alone (flowfleet.models.files.validated builds its error so)."""

    class CheckRefused(Refused):
        def __init__(self, message: str):
            super().__init__(check, message)

    return CheckRefused


def shown(text: object, limit: int = SHOWN_CHARS) -> str:
    """A package's text as a refusal line may carry it: as it is where every character is printable and it is short,
    else its repr (control characters escaped), cut to `limit` characters."""
    text = str(text)
    if text.isprintable() and len(text) <= limit:
        return text
    quoted = repr(text)
    return quoted if len(quoted) <= limit else quoted[: limit - 4] + "...'"


def first_line(err: BaseException) -> str:
    """An exception raised on a package's content, in words: its type and the first line of its message, shown."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return shown(f"{type(err).__name__}: {message}" if message else type(err).__name__)
