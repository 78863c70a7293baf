"""Errors the CLI reports as one clear line and a non-zero exit, never a traceback."""

import errno


class UserError(Exception):
    """Bad input or a failed precondition the user can fix; the message says what and where."""


class EngineError(Exception):
    """An engine could not build or run a stack environment."""


class DiskFull(EngineError):
    """The run directory's file system ran out of space (or quota) while runner or an adapter wrote to it."""


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
