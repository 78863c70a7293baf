"""Errors the CLI reports as one clear line and a non-zero exit, never a traceback."""


class UserError(Exception):
    """Bad input or a failed precondition the user can fix; the message says what and where."""


class EngineError(Exception):
    """An engine could not build or run a stack environment."""
