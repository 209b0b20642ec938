"""Locate the files that ship with the package (migrations, templates, seed data).

In a wheel they are force-included under `matrix/_<name>`; in a source checkout (editable install or
tests) they live at the top level of the repository.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """Return the directory of shipped resource `name` ("migrations", "templates" or "data")."""
    packaged = _PACKAGE_DIR / f"_{name}"
    if packaged.is_dir():
        return packaged
    return _PACKAGE_DIR.parent / name
