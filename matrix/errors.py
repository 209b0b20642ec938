"""User-facing errors.

A `MatrixError` is something the user can fix (bad input, bad configuration): the CLI prints its message
and exits with code 2 without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MatrixError(Exception):
    """An error the user can fix; its message says what was wrong and what to do."""

    exit_code = 2


class ConfigError(MatrixError):
    """The catalog, a TOML file or a command-line value is invalid."""


class DatabaseError(MatrixError):
    """The database cannot be opened or its schema does not match this matrix."""
