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
  ``ghs_…``, ``ghr_…``, ``github_pat_…``), OpenAI-style (``sk-…``), Stripe (``sk_live_…``, ``rk_test_…``),
  GitLab (``glpat-…``), npm (``npm_…``), AWS access key ids (``AKIA…``, ``ASIA…``) and Slack (``xox?-…``,
  ``xapp-…``) tokens, and JSON Web Tokens (``eyJ….eyJ….…``);
* a value after the word ``password``/``passwd``/``passphrase`` and after a ``-p`` option (``mysql -p x``),
  unless it is a prose word ("password is wrong") or a port (``-p 8080:80``);
* the credential of an ``Authorization`` header of any scheme (``Basic``, ``Bearer``, ``Token``...) and
  any ``Bearer`` credential;
* the password of a URL with credentials (``postgresql://user:secret@host/db``), also one with an
  unencoded ``/`` or ``@`` in it.

A setting name that ends in a file extension (``unknown-key.toml: [[cases]]``) is a file named in a
message, not a setting, and keeps its text.

Besides the shapes, the catalog's own secret values (provider `env` values under secret names,
`remember_secrets`) are hidden by value wherever they appear, so a process that prints one bare (a probe's
stderr, a log line) gives nothing away.

Redaction keeps the name (and a token's well-known prefix) and replaces only the value with ``***``, so
a reader still sees which setting was present. It errs on the side of hiding: ``prompt_token=abc``
loses its value too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MASK", "redact", "redact_pair", "remember_secrets", "secret_name"]

MASK = "***"

# A secret-looking setting name. The words may sit anywhere in the name (MY_SECRET_VALUE, HF_TOKEN_2);
# "key" alone is too common in prose ("key: value"), so it counts only as a suffix after "_" or "-".
# Patterns start at the secret word rather than at the start of the name, and the rest of the name is
# bounded, so a match cannot begin at every character of a long word: redaction stays linear on
# megabytes of logs.
_WORD = r"(?:TOKEN(?!IZ)|SECRET|PASSWORD|PASSWD|CREDENTIAL|[_-]KEY|APIKEY|PWD)"
_REST = r"[A-Za-z0-9_.-]{0,64}?"
_NAME_END = r"(?![A-Za-z0-9_.-])"
# A name that ends in a file extension is a file, not a setting: `unknown-key.toml: [[cases]] ...` in an
# error message keeps its text.
_FILE_NAME = re.compile(
    r"\.(?:toml|json|ya?ml|py|txt|log|cfg|ini|conf|md|html?|csv|lock|whl|gz|zip|tar|sh|pem|crt)$", re.IGNORECASE
)
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
# scheme://user:password@host: only the password goes. A password may carry an unencoded "/" or "@"
# (`user:pa/ss@host`, `user:p@ss@host`): the value runs to the last "@" that a host follows.
_URL_PASSWORD = re.compile(
    r"(?P<head>://[^\s:/@]*:)(?P<value>[^\s]+)(?P<at>@)(?=[A-Za-z0-9.\[\]-]+(?::[0-9]+)?(?:[/?#\s\"'<>),;]|$))"
)
# host:8080/path?a@b is a port and a path, not a password.
_PORT = re.compile(r"[0-9]+(?:[/?#].*)?")
# `password VALUE` (a prompt answer, a config line without "=") and `-p VALUE` (mysql, sshpass). Prose
# words after "password" ("password is wrong") and port-like values after -p (`-p 8080:80`) stay.
_PASSWORD_WORD = re.compile(
    r"""(?P<name>\b(?:password|passwd|passphrase))(?P<sep>\s+["']?)(?P<value>[^\s"',;]+)""", re.IGNORECASE
)
_PROSE_WORDS = (
    "is was are were for of and or the to in on not no must required missing expired incorrect invalid wrong "
    "too file from with field has have had will can could should reset change changed set hash policy "
    "authentication auth prompt manager length protected based login a an if when that this it be by as "
    "unchanged given needed needs empty"
)
_PROSE = frozenset(_PROSE_WORDS.split())
_DASH_P = re.compile(r"""(?<!\S)(?P<name>-p)(?P<sep>\s+["']?)(?P<value>[^\s"',;]+)""")
_PORTISH = re.compile(r"[0-9.:\[\]]+(?:/(?:tcp|udp))?|-.*")
# Authorization: <scheme> <credential>, in a header dump, a curl line or a Python dict.
_SCHEMES = r"(?:Basic|Bearer|Token|Digest|Negotiate|ApiKey|AWS4-HMAC-SHA256)"
_AUTHORIZATION = re.compile(
    rf"""(?P<head>\bauthorization["']?\s*[:=]\s*["']?(?:{_SCHEMES}\s+)?)(?P<value>[^\s"',;]+)""", re.IGNORECASE
)
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[A-Za-z0-9._~+/=-]+)", re.IGNORECASE)
# Well-known token formats: the prefix stays (it says what leaked), the rest goes.
_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?P<prefix>hf_|gh[opusr]_|github_pat_|sk-(?:proj-|ant-)?|xox[abposr]-|xapp-"
    r"|[sr]k_(?:live|test)_|glpat-|npm_)"
    r"(?P<value>[A-Za-z0-9_-]{8,})"
    r"|(?<![A-Za-z0-9])(?P<aws>(?:AKIA|ASIA)[A-Z0-9]{16})(?![A-Za-z0-9])"
    # A JSON Web Token: base64url header and payload, both JSON objects (so both start "eyJ"), and a signature.
    r"|(?<![A-Za-z0-9_-])(?P<jwt>eyJ)[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]+"
)
# Cheap substring tests that skip a pattern when its anchor cannot occur in the (lowercased) text.
_HINTS = ("token", "secret", "passw", "pwd", "key", "credential")
_SHAPE_HINTS = ("hf_", "gh", "sk-", "sk_", "rk_", "xox", "xapp-", "glpat-", "npm_", "eyj", "akia", "asia")


# Values hidden wherever they appear, whatever stands around them: the catalog's own secrets (provider
# `env` values under secret names), which a process may print bare ("auth failed for <value>"). Longest
# first, so a value that contains another is hidden whole. Replaced as a whole tuple: readers in other
# threads see the old set or the new one.
_KNOWN: tuple[str, ...] = ()
# Shorter values, whole numbers and the usual flag words would hide ordinary text ("16", "true").
_MIN_SECRET_CHARS = 4
_NOT_SECRETS = frozenset({"true", "false", "none", "null", "auto", "unset"})


def remember_secrets(values: Iterable[str]) -> None:
    """Hide these values, by value, in everything `redact` sees from now on in this process."""
    global _KNOWN
    fresh = {
        value
        for value in values
        if len(value) >= _MIN_SECRET_CHARS and not _COUNT.fullmatch(value) and value.lower() not in _NOT_SECRETS
        and value != MASK
    }
    if not fresh <= set(_KNOWN):
        _KNOWN = tuple(sorted(fresh | set(_KNOWN), key=lambda v: (-len(v), v)))


def _name_value(match: re.Match[str]) -> str:
    name, value = match["name"], match["value"]
    if _FILE_NAME.search(name):
        return match.group()  # unknown-key.toml: a file named in a message
    if _COUNT.fullmatch(value) and not re.search(r"SECRET|PASSW|PWD|KEY|CREDENTIAL", name, re.IGNORECASE):
        return match.group()  # max_tokens=16: a count
    return f"{name}{match['sep']}{MASK}"


def _shape(match: re.Match[str]) -> str:
    if match["jwt"]:
        return match["jwt"] + MASK
    if match["aws"]:
        return match["aws"][:4] + MASK
    return match["prefix"] + MASK


def _url_password(match: re.Match[str]) -> str:
    if _PORT.fullmatch(match["value"]):
        return match.group()  # host:8080/path?a@b
    return f"{match['head']}{MASK}{match['at']}"


def _password_word(match: re.Match[str]) -> str:
    if match["value"].lower() in _PROSE or match["value"] == MASK:
        return match.group()
    return f"{match['name']}{match['sep']}{MASK}"


def _dash_p(match: re.Match[str]) -> str:
    value = match["value"]
    if _PORTISH.fullmatch(value) or value.lower() in _PROSE or value == MASK:
        return match.group()  # -p 8080:80, -p 127.0.0.1:8000:8000, -p --next-option
    return f"{match['name']}{match['sep']}{MASK}"


def redact(text: str) -> str:
    """`text` with every secret value replaced by ``***`` (see the module docstring for what counts)."""
    if not text:
        return text
    for value in _KNOWN:
        if value in text:
            text = text.replace(value, MASK)
    lower = text.lower()
    if "://" in text:
        text = _URL_PASSWORD.sub(_url_password, text)
    if "authorization" in lower:
        text = _AUTHORIZATION.sub(lambda m: f"{m['head']}{MASK}", text)
    if any(hint in lower for hint in _HINTS):
        if "--" in text:
            text = _OPTION.sub(_name_value, text)
        text = _ASSIGNMENT.sub(_name_value, text)
    if "pass" in lower:
        text = _PASSWORD_WORD.sub(_password_word, text)
    if "-p" in text:
        text = _DASH_P.sub(_dash_p, text)
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
