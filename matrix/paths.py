"""Where matrix keeps its files by default.

Everything lives under one data directory: `$MATRIX_HOME` if set, else `$XDG_DATA_HOME/matrix`, else
`~/.local/share/matrix`. It holds the default SQLite database (`matrix.db`), cell logs (`runs/`) and
provisioned environments (`envs/`). The port registry is the host's, not the data directory's: ports are
shared by every process on the host, whatever data directory it uses.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path


def data_dir() -> Path:
    """The data directory (not created here)."""
    if home := os.environ.get("MATRIX_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "matrix"


def staging_path(path: Path) -> Path:
    """A hidden file beside `path` whose name is this writer's own (pid and a random token): written, then
    moved onto `path`, so two processes writing the same file at once never move each other's work away."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def default_db_path() -> Path:
    return data_dir() / "matrix.db"


def runs_dir() -> Path:
    return data_dir() / "runs"


def port_registry_path() -> Path:
    """The registry of ports reserved by this user's runners on this host (`$MATRIX_PORT_REGISTRY` if set).

    One per host, not per data directory: two runners with different data directories (two CI jobs, a test
    worker each) otherwise each check only their own reservations, and a port one of them handed out but
    whose server has not bound it yet looks free to the other. The directory is made private to this user;
    should the shared name be unusable (someone else's, a link), the data directory's own file is used.
    """
    if override := os.environ.get("MATRIX_PORT_REGISTRY"):
        return Path(override).expanduser()
    shared = Path(tempfile.gettempdir()) / f"matrix-ports-{os.getuid()}"
    try:
        shared.mkdir(mode=0o700, exist_ok=True)
        info = shared.lstat()
    except OSError:
        return data_dir() / "ports.json"
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        return shared / "ports.json"
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
