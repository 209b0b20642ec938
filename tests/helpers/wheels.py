"""Small wheels built on the spot, for installs that must not reach an index."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

WHEEL = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
TOOL = "#!/bin/sh\necho 'mtool {version} (built by a test)'\n"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder: Path, name: str, version: str, tool_version: str) -> Path:
    """A minimal valid wheel: a package holding an executable shell script, and its dist-info.

    One (name, version) should always get the same `tool_version` across the suite: uv caches a flat index's
    wheel by the folder's path and the file's name, and pytest reuses temporary paths from one run to the
    next, so another test's wheel of the same name could be installed from the cache instead of this one
    (the fixtures that install these wheels also give uv a cache of their own).
    """
    files = {
        f"{name}/__init__.py": b"",
        f"{name}/mtool": TOOL.format(version=tool_version).encode(),
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": WHEEL,
    }
    record = f"{name}-{version}.dist-info/RECORD"
    lines = [_record_line(path, data) for path, data in files.items()] + [f"{record},,"]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            info = zipfile.ZipInfo(member)
            info.external_attr = (0o755 if member.endswith("mtool") else 0o644) << 16
            archive.writestr(info, data)
        archive.writestr(record, "\n".join(lines) + "\n")
    return path
