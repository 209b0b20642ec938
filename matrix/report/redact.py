"""Hide secrets in text that reports show: log tails, messages, completions.

Reports are shared (CI artifacts, PR comments), and an engine's log can echo its environment or its
command line. What is hidden:

* values of settings whose name ends in ``TOKEN``, ``KEY``, ``SECRET`` or ``PASSWORD``/``PASSWD``
  (case-insensitive), written as ``NAME=value``, ``NAME: value``, ``"NAME": "value"`` or
  ``--name value`` / ``--name=value`` (``HF_TOKEN=hf_x``, ``--api-key sk-x``);
* the password of a URL with credentials (``postgresql://user:secret@host/db``);
* a bearer credential (``Authorization: Bearer abc``).

Redaction keeps the name and replaces only the value with ``***``, so a reader still sees which
setting was present. It errs on the side of hiding: ``prompt_token=5`` loses its value too.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact"]

MASK = "***"

# The end of a secret-looking setting name: HF_TOKEN, OPENAI_API_KEY, aws_secret, DB_PASSWORD, token,
# password. "key" alone is too common in prose ("key: value"), so it counts only as a suffix after "_" or
# "-" (API_KEY, api-key). Patterns are anchored on this ending rather than on the start of the name: only
# the value is replaced, and a match cannot begin at every character of a long word, which keeps
# redaction linear on megabytes of logs.
_END = r"(?:TOKEN|SECRET|PASSWORD|PASSWD|PWD|[_-]KEY)(?![A-Za-z0-9_.-])"
# NAME=value, NAME: value, "NAME": "value", 'NAME'='value'. The value runs to whitespace, a quote, a
# comma, a semicolon or a closing bracket, which ends a value in env dumps, JSON and Python reprs.
_ASSIGNMENT = re.compile(rf"""(?P<name>{_END})(?P<sep>["']?\s*[=:]\s*["']?)(?P<value>[^\s"',;}})\]]+)""", re.IGNORECASE)
# --api-key VALUE or --hf-token=VALUE on a command line.
_OPTION = re.compile(rf"(?P<name>--[A-Za-z0-9_.-]*{_END})(?P<sep>\s+|=)(?P<value>[^\s\"',;]+)", re.IGNORECASE)
# scheme://user:password@host: only the password goes.
_URL_PASSWORD = re.compile(r"(?P<head>://[^\s:/@]*:)(?P<value>[^\s@/]+)(?P<at>@)")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[A-Za-z0-9._~+/=-]+)", re.IGNORECASE)
# Cheap substring tests that skip a pattern when its anchor cannot occur in the (lowercased) text.
_HINTS = ("token", "secret", "passw", "pwd", "key")


def redact(text: str) -> str:
    """`text` with every secret value replaced by ``***`` (see the module docstring for what counts)."""
    if not text:
        return text
    lower = text.lower()
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}{m['at']}", text)
    if any(hint in lower for hint in _HINTS):
        if "--" in text:
            text = _OPTION.sub(lambda m: f"{m['name']}{m['sep']}{MASK}", text)
        text = _ASSIGNMENT.sub(lambda m: f"{m['name']}{m['sep']}{MASK}", text)
    if "bearer" in lower:
        text = _BEARER.sub(lambda m: f"{m['head']}{MASK}", text)
    return text
