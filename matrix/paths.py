"""Where matrix keeps its files by default.

Everything lives under one data directory: `$MATRIX_HOME` if set, else `$XDG_DATA_HOME/matrix`, else
`~/.local/share/matrix`. It holds the default SQLite database (`matrix.db`), cell logs (`runs/`), the
port registry (`ports.json`) and, later, provisioned environments (`envs/`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def data_dir() -> Path:
    """The data directory (not created here)."""
    if home := os.environ.get("MATRIX_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "matrix"


def default_db_path() -> Path:
    return data_dir() / "matrix.db"


def runs_dir() -> Path:
    return data_dir() / "runs"


def port_registry_path() -> Path:
    return data_dir() / "ports.json"


def usable_dir(path: Path, option: str) -> Path:
    """`path` as a directory this process can write into (created if missing), else a `ConfigError`.

    Called before anything is recorded, so an unusable `--logs-dir` or `--report-dir` stops a command
    before it creates a campaign, not after its cells ran.
    """
    from matrix.errors import ConfigError

    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a directory: pass a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{option} {path} cannot be used ({exc.strerror or exc}): pass a directory this user can write"
        ) from None
    return path
