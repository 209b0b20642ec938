"""Serve a wheelhouse as a PEP 691 simple index on loopback while one command runs: `matrix discover` on a
GPU host that has no package index.

    python tests/gpu/wheelhouse_index.py WH -- matrix discover vllm --index-url {index}

Every wheel (and sdist) in WH is listed on its project's page, with the Requires-Python of its metadata,
so discover sees there what it would see on PyPI for those versions: the releases the wheelhouse was made
for become runtimes from the backend's runtime_template, exactly as they do where PyPI is reachable.
`{index}` in the command is replaced by the index URL (http://127.0.0.1:PORT/simple); the command runs as
an argument list (no shell) and its exit status is this script's. The server listens on 127.0.0.1 only and
stops when the command ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import zipfile
from email.parser import Parser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def _requires_python(path: Path) -> str | None:
    """A wheel's Requires-Python, from its METADATA (the zip's directory is read, not the whole file)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
            if name is None:
                return None
            value = Parser().parsestr(archive.read(name).decode("utf-8", "replace")).get("Requires-Python")
    except (OSError, zipfile.BadZipFile):
        return None
    return str(value).strip() if value else None


def project_pages(wheelhouse: Path) -> dict[str, dict[str, Any]]:
    """Canonical project name -> its PEP 691 page, for every distribution file in `wheelhouse`."""
    pages: dict[str, dict[str, Any]] = {}
    for path in sorted(wheelhouse.iterdir()):
        try:
            if path.name.endswith(".whl"):
                name = str(parse_wheel_filename(path.name)[0])
                requires = _requires_python(path)
            elif path.name.endswith((".tar.gz", ".zip")):
                name, requires = str(parse_sdist_filename(path.name)[0]), None
            else:
                continue
        except (InvalidWheelFilename, InvalidSdistFilename):
            continue
        page = pages.setdefault(name, {"meta": {"api-version": "1.1"}, "name": name, "files": []})
        entry: dict[str, Any] = {"filename": path.name, "url": f"../../files/{quote(path.name)}", "hashes": {}}
        if requires:
            entry["requires-python"] = requires
        page["files"].append(entry)
    return pages


def serve(pages: dict[str, dict[str, Any]]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            page = pages.get(canonicalize_name(parts[1])) if len(parts) == 2 and parts[0] == "simple" else None
            if page is None:
                body, kind, status = b"no such project", "text/plain", 404
            else:
                body, kind, status = json.dumps(page).encode(), JSON_TYPE, 200
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not Path(argv[0]).is_dir():
        print("usage: wheelhouse_index.py WHEELHOUSE -- COMMAND... ({index} in it is the index URL)", file=sys.stderr)
        return 2
    pages = project_pages(Path(argv[0]))
    server = serve(pages)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/simple"
        print(f"serving {sum(len(p['files']) for p in pages.values())} file(s) of {len(pages)} project(s) at {url}",
              file=sys.stderr)  # fmt: skip
        return subprocess.run([a.replace("{index}", url) for a in argv[2:]], check=False).returncode
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
