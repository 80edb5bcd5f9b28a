"""User-facing errors: the CLI prints their message as one line and exits 1 (no traceback)."""


class FlowfleetError(ValueError):
    """Bad input or state that a user can fix; the message names the file, field or expert at fault."""
