"""Fault `hostile-output`: what an engine's log and answer can carry that must never leave matrix as is.

Every well-known token format, secrets in settings, headers and URLs, terminal escape sequences (colours,
window titles, hyperlinks, screen clearing), C0/C1 control characters and NUL. The prefill worker writes
`LOG_LINES` to its log at start, and the bare values of its secret-named environment variables
(`echoed_values`); the frontend answers with `COMPLETION`. `SECRETS` are the values a test
must never find in anything matrix shows, stores or exports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Built from pieces so that no scanner mistakes this test data for a leaked credential.
_HF = "hf_" + "Q" * 6 + "hostileHuggingFace01"
_GHP = "ghp_" + "R" * 6 + "hostileGitHubClassic0123"
_PAT = "github_pat_" + "11" + "S" * 6 + "_hostileFineGrained0123456"
_SK = "sk-" + "proj-" + "T" * 6 + "hostileOpenAiKey01"
_AKIA = "AKIA" + "HOSTILE0EXAMPLE1"
_BASIC = "aG9zdGlsZTpiYXNpYy1wYXNzd29yZA=="
_BEARER = "eyJhbGciOi.hostileBearerPayload.sig"
_NAMED = "hostile-named-secret-value"
_PASSWORD = "hostile-db-password"  # noqa: S105 - test data that must be hidden
_URL_PASSWORD = "hostileUrlPassword"  # noqa: S105 - test data that must be hidden
_OPTION = "hostile-cli-api-key"
# Straddles the 200-character cut of the completion excerpt: a cut before redaction kept "ghp_ZqXcut7".
_CUT = "ghp_" + "ZqXcut7" + "hostileStraddlesTheCut0123"

SECRETS: tuple[str, ...] = (
    _HF, _GHP, _PAT, _SK, _AKIA, _BASIC, _BEARER, _NAMED, _PASSWORD, _URL_PASSWORD, _OPTION,
    # The parts after a prefix matrix keeps, so a half-hidden token is caught too.
    _HF[3:], _GHP[4:], _PAT[11:], _SK[8:], _AKIA[4:], _CUT[4:11],
)  # fmt: skip

LOG_LINES: tuple[str, ...] = (
    f"HF_TOKEN={_HF} loading model",
    f"bare token in a traceback: {_GHP} and {_PAT}",
    f"openai client configured with {_SK}",
    f"aws access key id {_AKIA} in region us-east-1",
    f"sending header Authorization: Basic {_BASIC}",
    f"curl -H 'Authorization: Bearer {_BEARER}' http://127.0.0.1/v1/models",
    f"MY_SECRET_VALUE={_NAMED} DB_PASSWORD={_PASSWORD}",
    f"connecting to postgresql://matrix:{_URL_PASSWORD}@db.internal:5432/matrix",
    f"argv: serve --api-key {_OPTION} --port 8000",
    "title: \x1b]0;pwned window title\x07 colour: \x1b[31mred\x1b[0m clear: \x1b[2J\x1b[H",
    "hyperlink: \x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\ bell\x07 backspace\x08 del\x7f",
    "nul:\x00 c1-csi:\x9b31m vertical-tab:\x0b form-feed:\x0c escape-only:\x1b",
    "bidi: rlo\u202egnp.exe lri\u2066x\u2069 pdf\u202c zero-width: a\u200bb\u200dc\u2060d\ufeffe",
    "carriage return overwrites\rERROR: hostile-output fault wrote every hostile format",
)

COMPLETION = ("The answer starts with ordinary prose. " * 5)[:188] + " " + _CUT + " | " + " | ".join(LOG_LINES)
# Names whose values an engine that echoes its configuration prints bare, without the name.
_SECRET_NAME = re.compile(r"KEY|PASSWORD|SECRET|TOKEN|CREDENTIAL", re.IGNORECASE)


def echoed_values(environ: Mapping[str, str]) -> list[str]:
    """Lines that print the bare values of the process's secret-named variables, as an engine echoing its
    configuration would: no name next to them, so only their value can give them away. Only test data
    (values that start with ``hostile-``) is echoed: a real credential of the host is never written."""
    names = sorted(n for n in environ if _SECRET_NAME.search(n) and environ[n].startswith("hostile-"))
    return [f"configuration value {index}: {environ[name]}" for index, name in enumerate(names)]
