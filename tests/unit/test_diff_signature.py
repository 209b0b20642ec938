"""[M30] item 5: a failure's signature is the same for every cell failing for one reason, and different for
different reasons (`matrix.report.diff.normalise` and `signature`)."""

from __future__ import annotations

import pytest

from matrix.report.diff import latest_pair, normalise, signature


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("connect to 127.0.0.1:8123 refused after 12.5s", "connect to <host>:<port> refused after <n>s"),
        ("GET http://localhost:40123/v1/chat/completions -> 502",
         "GET http://<host>:<port>/v1/chat/completions -> <n>"),
        ("GET https://[::1]:9000/health", "GET https://<host>:<port>/health"),
        ("ssh node-17.cluster.local:2222 failed", "ssh <host>:<port> failed"),
        ("worker 3f2a9c1d-0b4e-4c1a-9F3E-2b7d8e9a0c11 died (pid 4242)", "worker <id> died (pid <n>)"),
        ("log at /tmp/pytest-of-x/pytest-12/logs/decode.log line 3", "log at <path> line <n>"),
        ("see ~/x/y and ./logs/a.log and ../up/b", "see <path> and <path> and <path>"),
        ("C:\\Users\\x\\a.log missing", "<path> missing"),
        ("port 8000 busy; ports=9001, Port: 7", "port <port> busy; ports=<port>, Port: <port>"),
        ("container a3f9b2c81d4e exited with 0x1F", "container <id> exited with <id>"),
        ("NIXL >= 1.5.0 is required, but nixl==1.4.1 is installed",
         "NIXL >= <n> is required, but nixl==<n> is installed"),
        ("ratio -3.5e-4 and 1e10", "ratio -<n> and <n>"),
        ("\x1b[31mred 42\x1b[0m", "red <n>"),
        ("  spaced \t out  7 ", "spaced out <n>"),
    ],
)
def test_what_varies_between_cells_becomes_a_placeholder(line: str, expected: str) -> None:
    assert normalise(line) == expected


@pytest.mark.parametrize(
    "line",
    [
        "h100 e2e sm90 gpu_1 fp8",  # numbers inside names are the names
        "decade facade accede beef",  # hex-looking words without a digit
        "tokens/s prefill/decode",  # one slash is not a path
        "finish_reason 'abort'",
        "",
    ],
)
def test_words_that_only_look_variable_stay(line: str) -> None:
    assert normalise(line) == line


def test_one_reason_one_signature_two_reasons_two() -> None:
    one = signature("failed", "startup", "worker exited with code 1 on 127.0.0.1:40001 (pid 123)\nlog tail...")
    two = signature("failed", "startup", "worker exited with code 1 on 127.0.0.1:51234 (pid 98765)\nother tail")
    other = signature("failed", "health", "worker exited with code 1 on 127.0.0.1:51234 (pid 98765)")
    assert one == two == "startup: worker exited with code <n> on <host>:<port> (pid <n>)"
    assert other != one  # the kind is part of it


def test_the_signature_falls_back_to_failed_checks_then_the_status() -> None:
    checks = [{"name": "usage_object"}, {"name": "content_nonblank"}, {"name": "usage_object"}, "junk"]
    assert signature("failed", "validation", "\n  \n", checks) == "validation: content_nonblank, usage_object"
    assert signature("timeout", None, "") == "timeout"


def test_hostile_text_stays_text_and_is_bounded() -> None:
    sig = signature("failed", "request", "<script>alert(1)</script> \x00\x1b]0;title\x07 " + "x" * 1000)
    assert sig.startswith("request: <script>alert(<n>)</script>")
    assert "\x00" not in sig and "\x1b" not in sig and "\x07" not in sig
    assert len(sig) <= 200


def test_the_last_pair_is_the_newest_two() -> None:
    assert latest_pair([3, 1, 7, 3]) == (3, 7)
    assert latest_pair([5]) is None
