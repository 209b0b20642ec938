"""A real PEP 691 simple index on loopback, served from files: `<root>/<project>.json` is the project page.

Any path that is not a project page of the directory answers 404, `/html/...` answers HTML only (an
index that does not speak the JSON API), so `matrix discover` is tested against real HTTP end to end.
`/files/NAME` serves `<root>/files/NAME` where it exists (real wheels a resolver downloads: `built_wheel`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def project_page(name: str, files: list[dict[str, Any]]) -> dict[str, Any]:
    return {"meta": {"api-version": "1.1"}, "name": name, "files": files}


def wheel(
    name: str, version: str, yanked: bool | str = False, requires_python: str | None = None, tags: str = "py3-none-any"
) -> dict[str, Any]:
    """A wheel entry; `tags` is the file name's python-abi-platform part (`cp312-cp312-manylinux_2_28_aarch64`)."""
    filename = f"{name.replace('-', '_')}-{version}-{tags}.whl"
    entry: dict[str, Any] = {"filename": filename, "url": f"../../files/{filename}", "hashes": {"sha256": "0" * 64},
                             "yanked": yanked}  # fmt: skip
    if requires_python is not None:
        entry["requires-python"] = requires_python
    return entry


def built_wheel(root: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> dict[str, Any]:
    """A real, tiny py3-none-any wheel of `name` `version` with these Requires-Dist under `<root>/files`, and
    its index entry (sha256 of the file): what uv downloads and reads when it resolves against the index."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)  # fmt: skip
    wheel_file = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {f"{dist}.dist-info/METADATA": metadata, f"{dist}.dist-info/WHEEL": wheel_file}
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(body.encode())}\n" for path, body in files.items()) + f"{dist}.dist-info/RECORD,,\n"  # fmt: skip
    path = root / "files" / f"{dist}-py3-none-any.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for member, body in {**files, f"{dist}.dist-info/RECORD": record}.items():
            archive.writestr(member, body)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"filename": path.name, "url": f"../../files/{path.name}", "hashes": {"sha256": digest}, "yanked": False}


def sdist(name: str, version: str, yanked: bool | str = False) -> dict[str, Any]:
    filename = f"{name.replace('-', '_')}-{version}.tar.gz"
    return {"filename": filename, "url": f"../../files/{filename}", "hashes": {"sha256": "0" * 64}, "yanked": yanked}


def write_project(root: Path, name: str, files: list[Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.json").write_text(json.dumps(project_page(name, files)))


@contextmanager
def serve_index(root: Path, upstream: str | None = None) -> Iterator[str]:
    """Serve `root` as a simple index on 127.0.0.1; yields the index URL (`http://127.0.0.1:PORT/simple`).
    With `upstream` (a PEP 691 index URL), a project page `root` lacks is the upstream's page as it is (its
    files stay where the upstream keeps them): `root` then overrides a few projects of a real index."""
    requests: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append({"path": self.path, "accept": self.headers.get("Accept", "")})
            parts = [p for p in self.path.split("/") if p]
            if len(parts) == 2 and parts[0] == "files" and (root / "files" / parts[1]).is_file():
                self._answer(200, "application/octet-stream", (root / "files" / parts[1]).read_bytes())
                return
            if len(parts) == 2 and parts[0] in ("simple", "html") and (root / f"{parts[1]}.json").is_file():
                if parts[0] == "html":
                    self._answer(200, "text/html", b"<html><body><a href='x.whl'>x.whl</a></body></html>")
                else:
                    self._answer(200, JSON_TYPE, (root / f"{parts[1]}.json").read_bytes())
                return
            if len(parts) == 2 and parts[0] == "simple" and upstream is not None:
                self._answer(*_upstream_page(upstream, parts[1]))
                return
            self._answer(404, "text/plain", b"not found")

        def do_HEAD(self) -> None:  # a resolver asks a wheel's size before it reads its metadata
            self.head_only = True
            self.do_GET()

        def _answer(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not getattr(self, "head_only", False):
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/simple"
        serve_index.requests = requests  # type: ignore[attr-defined]
        yield url
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _upstream_page(upstream: str, project: str) -> tuple[int, str, bytes]:
    import httpx

    answer = httpx.get(f"{upstream.rstrip('/')}/{project}/", headers={"Accept": JSON_TYPE}, timeout=60,
                       follow_redirects=True)  # fmt: skip
    return answer.status_code, answer.headers.get("Content-Type", JSON_TYPE), answer.content


def upstream_project(upstream: str, name: str, keep: set[str]) -> dict[str, Any]:
    """`name`'s real page on `upstream` with only the files of the versions in `keep` (absolute URLs kept)."""
    import httpx
    from packaging.utils import parse_wheel_filename

    page: dict[str, Any] = httpx.get(f"{upstream.rstrip('/')}/{name}/", headers={"Accept": JSON_TYPE}, timeout=60,
                                     follow_redirects=True).raise_for_status().json()  # fmt: skip
    files = [f for f in page["files"] if f["filename"].endswith(".whl")
             and str(parse_wheel_filename(f["filename"])[1]) in keep]  # fmt: skip
    return project_page(name, files)
