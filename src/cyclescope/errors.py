"""Errors that reach the user as one line and an exit code."""

from __future__ import annotations


class CycleScopeError(Exception):
    """An error the user can act on. The CLI prints ``cyclescope: <message>``."""

    exit_code = 1


class UsageError(CycleScopeError):
    """Bad options or arguments."""

    exit_code = 2


class DataError(CycleScopeError):
    """A database, profile or binary that cannot be read as expected."""

    exit_code = 3


class NotFoundError(CycleScopeError):
    """Something named on the command line does not exist."""

    exit_code = 4
