"""Where matrix keeps its files by default.

Everything lives under one data directory: `$MATRIX_HOME` if set, else `$XDG_DATA_HOME/matrix`, else
`~/.local/share/matrix`. It holds the default SQLite database (`matrix.db`), cell logs (`runs/`), the
port registry (`ports.json`) and, later, provisioned environments (`envs/`).
"""

from __future__ import annotations

import os
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
