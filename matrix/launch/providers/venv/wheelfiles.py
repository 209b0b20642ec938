"""The files of one wheel that a build step reads without installing it (its METADATA, one member): a wheel
file (pip's download, the wheelhouse's copy) or the tree uv unpacked from it (`uv pip install --target`)."""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from matrix.launch.providers.recipe import wheel_metadata
from matrix.launch.providers.venv.target import ProvisionError


class WheelFiles(Protocol):
    """What `requirements_of` and `extract` read of a wheel."""

    @property
    def name(self) -> str:
        """The wheel's file name, for messages."""
        ...

    def metadata(self) -> str:
        """The text of its .dist-info/METADATA."""
        ...

    def read(self, member: str) -> bytes:
        """The bytes of one member; `KeyError` when the wheel has no such member."""
        ...


@dataclass(frozen=True)
class WheelFile:
    """A wheel file on disk."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def metadata(self) -> str:
        return wheel_metadata(self.path)

    def read(self, member: str) -> bytes:
        with zipfile.ZipFile(self.path) as archive:
            return archive.read(member)


@dataclass(frozen=True)
class UnpackedWheel:
    """A wheel unpacked into `root` (nothing else there), with its one .dist-info directory and the file name
    the wheel had (kept: messages use it after the tree is gone)."""

    root: Path
    dist_info: Path
    name: str

    @classmethod
    def of(cls, root: Path, requirement: str) -> UnpackedWheel:
        found = sorted(p for p in root.glob("*.dist-info") if (p / "METADATA").is_file())
        if len(found) != 1:
            raise ProvisionError(f"unpacking {requirement} gave {len(found)} distributions, expected one")
        return cls(root, found[0], _wheel_name(found[0]))

    def metadata(self) -> str:
        return (self.dist_info / "METADATA").read_text(encoding="utf-8")

    def read(self, member: str) -> bytes:
        path = self.root / member
        if not path.is_file() or path.is_symlink():
            raise KeyError(member)
        return path.read_bytes()


def _wheel_name(dist_info: Path) -> str:
    """name-version from the .dist-info, tags from its WHEEL file, compressed as in a wheel's file name
    (py2.py3-none-any)."""
    stem = dist_info.name.removesuffix(".dist-info")
    try:
        lines = (dist_info / "WHEEL").read_text().splitlines()
    except OSError:
        return f"{stem}.whl"
    tags = [line.split(":", 1)[1].strip().split("-") for line in lines if line.startswith("Tag:")]
    parts = [".".join(dict.fromkeys(tag[i] for tag in tags if len(tag) == 3)) for i in range(3)] if tags else []
    return "-".join([stem, *parts]) + ".whl"


@contextmanager
def fetched_wheel(
    run: Callable[[list[str]], Any], download: Path, requirement: str, *, python: str, uv: str | None,
    uv_args: Sequence[str] = (), pip_args: Sequence[str] = (),
) -> Iterator[WheelFiles]:
    """One pinned distribution's wheel (no dependencies), not installed: unpacked by uv (from its cache)
    into `download`, or downloaded there by `python -m pip`; `download` is removed afterwards. The full build
    and a variant's build both read wheels this way."""
    download.mkdir()
    try:
        if uv:
            run([uv, "pip", "install", "--python", python, "--target", str(download), "--no-deps",
                 "--only-binary", ":all:", *uv_args, requirement])  # fmt: skip
            yield UnpackedWheel.of(download, requirement)
            return
        run([python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *pip_args, "--dest",
             str(download), requirement])  # fmt: skip
        wheels = sorted(download.glob("*.whl"))
        if len(wheels) != 1:
            raise ProvisionError(f"`pip download {requirement}` gave {len(wheels)} wheels, expected one")
        yield WheelFile(wheels[0])
    finally:
        shutil.rmtree(download, ignore_errors=True)
