"""Hide secrets in text that leaves matrix: messages, log tails, completions, catalog values.

This is the one redaction policy. It is applied before an outcome is stored (`matrix.results`), when a
shard results file is written or imported, and again at every exit that prints or renders text (`matrix
show`, the live view, the pages, the exports), so text stored by an older matrix is covered too.
`docs/security.md` lists the exits and what is not covered.

Reports are shared (CI artifacts, PR comments), and an engine's log can echo its environment or its
command line. What is hidden:

* by name: the value of a setting whose name contains ``SECRET``, ``PASSWORD``/``PASSWD``, ``TOKEN``
  or ``CREDENTIAL``, or ends in ``KEY`` after ``_``/``-`` (``API_KEY``, ``api-key``) or ``PWD``
  (case-insensitive), written as ``NAME=value``, ``NAME: value``, ``"NAME": "value"`` or
  ``--name value`` / ``--name=value`` (``HF_TOKEN=hf_x``, ``MY_SECRET_VALUE=x``, ``--api-key sk-x``).
  A whole number after a ``TOKEN`` name is a count (``max_tokens=16``), not a secret, and stays;
* by shape, wherever they appear: Hugging Face (``hf_…``), GitHub (``ghp_…``, ``gho_…``, ``ghu_…``,
  ``ghs_…``, ``ghr_…``, ``github_pat_…``), OpenAI-style (``sk-…``), AWS access key ids (``AKIA…``,
  ``ASIA…``) and Slack (``xox?-…``) tokens;
* the credential of an ``Authorization`` header of any scheme (``Basic``, ``Bearer``, ``Token``...) and
  any ``Bearer`` credential;
* the password of a URL with credentials (``postgresql://user:secret@host/db``).

Redaction keeps the name (and a token's well-known prefix) and replaces only the value with ``***``, so
a reader still sees which setting was present. It errs on the side of hiding: ``prompt_token=abc``
loses its value too.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact", "redact_pair", "secret_name"]

MASK = "***"

# A secret-looking setting name. The words may sit anywhere in the name (MY_SECRET_VALUE, HF_TOKEN_2);
# "key" alone is too common in prose ("key: value"), so it counts only as a suffix after "_" or "-".
# Patterns start at the secret word rather than at the start of the name, and the rest of the name is
# bounded, so a match cannot begin at every character of a long word: redaction stays linear on
# megabytes of logs.
_WORD = r"(?:TOKEN(?!IZ)|SECRET|PASSWORD|PASSWD|CREDENTIAL|[_-]KEY|APIKEY|PWD)"
_REST = r"[A-Za-z0-9_.-]{0,64}?"
_NAME_END = r"(?![A-Za-z0-9_.-])"
# NAME=value, NAME: value, "NAME": "value", 'NAME'='value'. The value runs to whitespace, a quote, a
# comma, a semicolon or a closing bracket, which ends a value in env dumps, JSON and Python reprs.
_ASSIGNMENT = re.compile(
    rf"""(?P<name>{_WORD}{_REST}){_NAME_END}(?P<sep>["']?\s*[=:]\s*["']?)(?P<value>[^\s"',;}})\]]+)""", re.IGNORECASE
)
# --api-key VALUE or --hf-token=VALUE on a command line.
_OPTION = re.compile(
    rf"(?P<name>--[A-Za-z0-9_.-]{{0,64}}?{_WORD}{_REST}){_NAME_END}(?P<sep>\s+|=)(?P<value>[^\s\"',;]+)", re.IGNORECASE
)
_SECRET_NAME = re.compile(rf"{_WORD}", re.IGNORECASE)
_COUNT = re.compile(r"[0-9]+")
# scheme://user:password@host: only the password goes.
_URL_PASSWORD = re.compile(r"(?P<head>://[^\s:/@]*:)(?P<value>[^\s@/]+)(?P<at>@)")
# Authorization: <scheme> <credential>, in a header dump, a curl line or a Python dict.
_SCHEMES = r"(?:Basic|Bearer|Token|Digest|Negotiate|ApiKey|AWS4-HMAC-SHA256)"
_AUTHORIZATION = re.compile(
    rf"""(?P<head>\bauthorization["']?\s*[:=]\s*["']?(?:{_SCHEMES}\s+)?)(?P<value>[^\s"',;]+)""", re.IGNORECASE
)
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[A-Za-z0-9._~+/=-]+)", re.IGNORECASE)
# Well-known token formats: the prefix stays (it says what leaked), the rest goes.
_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?P<prefix>hf_|gh[opusr]_|github_pat_|sk-(?:proj-|ant-)?|xox[abposr]-)"
    r"(?P<value>[A-Za-z0-9_-]{8,})"
    r"|(?<![A-Za-z0-9])(?P<aws>(?:AKIA|ASIA)[A-Z0-9]{16})(?![A-Za-z0-9])"
)
# Cheap substring tests that skip a pattern when its anchor cannot occur in the (lowercased) text.
_HINTS = ("token", "secret", "passw", "pwd", "key", "credential")
_SHAPE_HINTS = ("hf_", "gh", "sk-", "xox", "akia", "asia")


def _name_value(match: re.Match[str]) -> str:
    name, value = match["name"], match["value"]
    if _COUNT.fullmatch(value) and not re.search(r"SECRET|PASSW|PWD|KEY|CREDENTIAL", name, re.IGNORECASE):
        return match.group()  # max_tokens=16: a count
    return f"{name}{match['sep']}{MASK}"


def _shape(match: re.Match[str]) -> str:
    if match["aws"]:
        return match["aws"][:4] + MASK
    return match["prefix"] + MASK


def redact(text: str) -> str:
    """`text` with every secret value replaced by ``***`` (see the module docstring for what counts)."""
    if not text:
        return text
    lower = text.lower()
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}{m['at']}", text)
    if "authorization" in lower:
        text = _AUTHORIZATION.sub(lambda m: f"{m['head']}{MASK}", text)
    if any(hint in lower for hint in _HINTS):
        if "--" in text:
            text = _OPTION.sub(_name_value, text)
        text = _ASSIGNMENT.sub(_name_value, text)
    if "bearer" in lower:
        text = _BEARER.sub(lambda m: f"{m['head']}{MASK}", text)
    if any(hint in lower for hint in _SHAPE_HINTS):
        text = _SHAPES.sub(_shape, text)
    return text


def secret_name(name: str) -> bool:
    """Whether a setting called `name` holds a secret (``env.HF_TOKEN``, ``password``, ``api_key``)."""
    return bool(_SECRET_NAME.search(name))


def redact_pair(name: str, value: str) -> str:
    """The value of setting `name` as it may be shown: all of it hidden when the name says it is a secret.

    Names and values shown apart (a table of `provider.env`) never form ``NAME=value``, so the name rule
    is applied here; the value rules apply either way.
    """
    if value and secret_name(name.rsplit(".", 1)[-1]) and not _COUNT.fullmatch(value):
        return MASK
    return redact(value)
