"""User-facing errors: the CLI prints their message as one line and exits 1 (no traceback)."""


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
