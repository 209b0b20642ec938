"""Every place that cuts untrusted text redacts the whole text first (`matrix.text.excerpt`).

A secret that straddles a cut, cut first and redacted after, keeps its first (or last) characters, and no
redaction rule recognises half a token: those characters then reached run output, `show`, exports, pages
and the database. The table below names each path that cuts; each places a token across its cut and
requires that no piece of the token's secret part survives.
"""

from __future__ import annotations

import http.server
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from matrix.bisect import _log_evidence
from matrix.check.client import send_chat
from matrix.check.oracle import ask
from matrix.check.specs import OracleSpec, RequestSpec
from matrix.check.validate import validate_chat_response
from matrix.launch import hang
from matrix.launch.providers.components import executable_version
from matrix.launch.providers.container import _first_error_line
from matrix.launch.providers.interpreters import probe
from matrix.launch.supervisor import _ERROR_LINE_CHARS, _FatalWatch, error_lines
from matrix.text import COMPLETION_EXCERPT_CHARS, completion_excerpt, excerpt

# Built from pieces so that no scanner mistakes this test data for a leaked credential. The redactor
# keeps the "ghp_" prefix; everything after it is the secret.
_PREFIX = "ghp_"
_SECRET = "Zq7Cut" + "StraddlesTheCut0123456789"
_TOKEN = _PREFIX + _SECRET


def _leaked(shown: str) -> list[str]:
    """Every 5-character piece of the secret that appears in `shown`."""
    return [_SECRET[i : i + 5] for i in range(len(_SECRET) - 4) if _SECRET[i : i + 5] in shown]


def _head(limit: int, filler: str = "x") -> str:
    """Text whose first `limit` characters end 10 characters into the token: a start-cut lands inside it."""
    lead = limit - len(_PREFIX) - 10
    return filler * lead + " " + _TOKEN + " and more text after it"


def _tail(limit: int) -> str:
    """Text whose last `limit` characters start inside the token: an end-cut lands inside it."""
    return "a log line with " + _TOKEN + " " + "y" * (limit - 12)


class _Server(http.server.ThreadingHTTPServer):
    status = 500
    body = b""
    content_type = "text/plain"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.server.status)
        self.send_header("Content-Type", self.server.content_type)
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(server: _Server, path: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- the call sites: each takes pytest's tmp_path and the test server, returns what matrix shows ---


def _http_status_body(tmp_path: Path, server: _Server) -> str:
    validation = validate_chat_response(500, _head(300).encode())
    return validation.failures[0].message


def _json_body(tmp_path: Path, server: _Server) -> str:
    validation = validate_chat_response(200, ("not json: " + _head(290)).encode())
    return validation.failures[0].message


def _json_value(tmp_path: Path, server: _Server) -> str:
    body = {"choices": [{"message": {"content": "x"}, "finish_reason": _head(79)}]}
    return " ".join(f.message for f in validate_chat_response(200, json.dumps(body).encode()).failures)


def _interpreter_stderr(tmp_path: Path, server: _Server) -> str:
    text = _head(200).replace("x", "e")
    shim = _script(tmp_path, "python-shim", f"echo 'some output' >&2\necho '{text}' >&2\nexit 3\n")
    return probe(str(shim)).problem


def _interpreter_stdout(tmp_path: Path, server: _Server) -> str:
    shim = _script(tmp_path, "python-odd", f"echo '{_head(40)}'\n")
    return probe(str(shim)).problem


def _hang_log_line(tmp_path: Path, server: _Server) -> str:
    log = tmp_path / "prefill.log"
    log.write_text("starting\n" + _head(300) + "\n")
    spec = RequestSpec(url="http://127.0.0.1:9/v1/chat/completions", model="m", prompt="p")
    return hang.waiting_on({"prefill": os.getpid()}, {"prefill": log}, spec, 5.0)


def _hang_log_window(tmp_path: Path, server: _Server) -> str:
    # The report reads the last 16 KiB of the log: the window's first byte falls inside the token.
    log = tmp_path / "decode.log"
    after = "\n" + "z" * (16_384 + 10 - len(_TOKEN) - 2) + "\n"
    log.write_text("w" * 50 + " " + _TOKEN + after)
    assert log.stat().st_size - 16_384 == 50 + 1 + len(_PREFIX) + 6  # the window starts inside the secret
    spec = RequestSpec(url="http://127.0.0.1:9/v1/chat/completions", model="m", prompt="p")
    return hang.waiting_on({"decode": os.getpid()}, {"decode": log}, spec, 5.0)


def _stream_error_event(tmp_path: Path, server: _Server) -> str:
    server.status, server.content_type = 200, "text/event-stream"
    server.body = ("event: error\ndata: " + _head(200) + "\n\n").encode()
    spec = RequestSpec(url=_url(server, "/v1/chat/completions"), model="m", prompt="p", timeout_s=10)
    return send_chat(spec, stream=True).error or ""


def _stream_bad_json(tmp_path: Path, server: _Server) -> str:
    server.status, server.content_type = 200, "text/event-stream"
    server.body = ("data: {" + _head(199) + "\n\n").encode()
    spec = RequestSpec(url=_url(server, "/v1/chat/completions"), model="m", prompt="p", timeout_s=10)
    return send_chat(spec, stream=True).error or ""


def _oracle_status(tmp_path: Path, server: _Server) -> str:
    server.status, server.content_type = 503, "text/plain"
    server.body = _head(300).encode()
    spec = OracleSpec(url=_url(server, "/v1/completions"), model="m", prompts=1, timeout_s=10)
    return str(ask(spec, ["p"])[0])


def _container_error_line(tmp_path: Path, server: _Server) -> str:
    return _first_error_line("pulling\nerror: " + _head(293))


def _executable_version(tmp_path: Path, server: _Server) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir, "dynamo", f"echo '{_head(120)}'\n")
    return executable_version("dynamo", {"PATH": str(bin_dir)})[1]


def _supervisor_error_lines(tmp_path: Path, server: _Server) -> str:
    log = tmp_path / "frontend.log"
    log.write_text("ERROR " + _head(_ERROR_LINE_CHARS - 6) + "\n")
    return error_lines(log)


def _supervisor_fatal_line(tmp_path: Path, server: _Server) -> str:
    watch = _FatalWatch()
    watch.see(("FATAL " + _head(_ERROR_LINE_CHARS - 6)).encode())
    return watch.line


def _bisect_log_evidence(tmp_path: Path, server: _Server) -> str:
    return _log_evidence(["--- error lines", "decode: ERROR " + _tail(160)])


def _completion(tmp_path: Path, server: _Server) -> str:
    return completion_excerpt(_head(COMPLETION_EXCERPT_CHARS))


CUTS: list[tuple[str, Callable[[Path, _Server], str]]] = [
    ("http_status body excerpt", _http_status_body),
    ("json_body body excerpt", _json_body),
    ("a JSON value in a check message", _json_value),
    ("interpreter probe: last stderr line", _interpreter_stderr),
    ("interpreter probe: not a version", _interpreter_stdout),
    ("hang report: a long log line", _hang_log_line),
    ("hang report: the log's byte window", _hang_log_window),
    ("stream: error event", _stream_error_event),
    ("stream: data is not JSON", _stream_bad_json),
    ("oracle: HTTP status body", _oracle_status),
    ("container engine error line", _container_error_line),
    ("executable --version output", _executable_version),
    ("start-up error lines", _supervisor_error_lines),
    ("start-up fatal line", _supervisor_fatal_line),
    ("bisect log evidence (end cut)", _bisect_log_evidence),
    ("completion excerpt", _completion),
]


@pytest.mark.parametrize(("where", "produce"), CUTS, ids=[where for where, _ in CUTS])
def test_a_secret_across_the_cut_leaves_nothing(
    where: str, produce: Callable[[Path, _Server], str], tmp_path: Path, server: _Server
) -> None:
    shown = produce(tmp_path, server)
    assert shown, f"{where}: the path produced nothing to check"
    assert not _leaked(shown), f"{where} leaked {_leaked(shown)} of the secret: {shown!r}"


def test_excerpt_redacts_before_it_cuts_from_either_end() -> None:
    start = excerpt(_head(100), 100)
    assert len(start) == 100 and start.endswith("…") and not _leaked(start)
    end = excerpt(_tail(100), 100, end=True)
    assert len(end) == 100 and end.startswith("…") and not _leaked(end)
    assert excerpt("short", 100) == "short"


def test_excerpt_does_not_leave_half_an_escape() -> None:
    # "\x1b" is shown as the four characters \x1b; a cut after "\x1" would show a different character.
    assert excerpt("ab\x01cdef", 5) == "ab…"
