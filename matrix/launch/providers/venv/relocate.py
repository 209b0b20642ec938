"""Relocation: make an environment built in a temporary directory correct at its final path."""

from __future__ import annotations

import os

from collections.abc import Callable, Sequence
from pathlib import Path

from matrix.launch.providers.venv.target import ProvisionError

Echo = Callable[[str], None]


def relocate(tmp: Path, final: Path, python_version: str, run: Callable[[Sequence[str]], object], log: Path) -> None:
    """Make the environment built in `tmp` correct at `final` before it gets there.

    Virtual environments are not relocatable as built: console scripts carry the interpreter's absolute
    path in their `#!` line, and byte code carries source paths. So the scripts are rewritten to the final
    path and byte code is compiled as if the files already lived there. `run` runs one build command
    (`ProvisionError` when it fails); `log` gets a line when byte compilation is incomplete.
    """
    python = str(tmp / "bin" / "python")
    if tuple(int(p) for p in python_version.split(".")) >= (3, 9):
        # -s/-p (3.9+) record the final path in byte code, so tracebacks show real files. Exit 1 only
        # means some file did not compile (test data, other Python versions): pip ignores that too.
        argv = [python, "-m", "compileall", "-q", "-f", "-j", "0", "-s", str(tmp), "-p", str(final)]
        argv.append(str(tmp / "lib"))
        try:
            run(argv)
        except ProvisionError as exc:
            with log.open("a") as out:
                out.write(f"byte compilation incomplete, modules compile on first import: {exc}\n")
    old, new = str(tmp).encode(), str(final).encode()
    candidates = [p for p in (tmp / "bin").iterdir() if p.is_file() and not p.is_symlink()]
    for path in [*candidates, tmp / "pyvenv.cfg"]:
        try:
            content = path.read_bytes()
        except OSError:
            continue
        if old in content and len(content) < 1_000_000:
            # A new file, renamed over the old one: uv may have hard-linked the old one from its cache.
            fresh = path.with_name(f".{path.name}.relocated")
            fresh.write_bytes(content.replace(old, new))
            fresh.chmod(path.stat().st_mode & 0o7777)
            os.replace(fresh, path)
