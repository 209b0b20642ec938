"""Make untrusted text (logs, messages, completions) safe to show: printable, redacted and bounded.

Escaping for HTML or XML is the templates' and serialisers' job; this module makes sure that what they
escape is readable: terminal colour codes are dropped, other control characters become visible
``\\xNN`` escapes (XML 1.0 cannot carry them at all), and logs are read from their end with a cap on
bytes and lines, because a log can be a megabyte of anything.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrix.redact import redact

__all__ = [
    "COMPLETION_EXCERPT_CHARS", "LogTail", "clean", "clean_data", "completion_excerpt", "excerpt", "log_tails",
    "printable", "read_tail", "shorten", "store_text",
]  # fmt: skip

TAIL_LINES = 200
TAIL_BYTES = 64 * 1024

# ANSI escape sequences: CSI (colours, cursor moves), OSC (window titles, hyperlinks) and the
# two-character forms. They carry no information a report reader needs.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
# Characters that reorder or hide text: the bidi embeddings, overrides and isolates (U+202A-U+202E,
# U+2066-U+2069; "Trojan Source": a U+202E makes "exe.txt" read "txt.exe"), the marks U+200E/U+200F/U+061C
# and the zero-width characters (U+200B-U+200D, U+2060, U+FEFF), which a reader cannot see at all.
_INVISIBLE = "\u061c\u200b-\u200f\u202a-\u202e\u2060\u2066-\u2069\ufeff"
# Characters XML 1.0 forbids or a browser would show as nothing: C0 controls except tab and newline,
# DEL, C1 controls, lone surrogates and the two non-characters U+FFFE/U+FFFF; and the invisible ones.
_UNPRINTABLE = re.compile(f"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff{_INVISIBLE}]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


# Anything printable() would change: the common case (plain text) is one scan that finds nothing.
_NEEDS_WORK = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff{_INVISIBLE}]")


def printable(text: str) -> str:
    """`text` without terminal escape codes, with carriage returns as newlines and other control
    characters, bidi overrides and zero-width characters written as visible escapes (``\\u202e``). The
    result is valid in XML 1.0 and reads in a page as it is stored."""
    if not _NEEDS_WORK.search(text):
        return text
    text = _ANSI.sub("", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _UNPRINTABLE.sub(_escape_char, text)


def clean(text: str | None) -> str:
    """Redacted and printable: what every printed or rendered piece of untrusted text goes through.

    Escape codes go first, so one inside a secret (``HF_TOKEN=\\x1b[0mhf_...``) cannot shield it.
    """
    if not text:
        return ""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    return printable(redact(text))


def clean_data(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with every string and key `clean`ed."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {clean(str(k)): clean_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_data(v) for v in value]
    return value


def store_text(text: str | None) -> str:
    """What the database keeps of text a process produced: `clean`, so no secret and no control byte is
    ever stored (PostgreSQL refuses NUL in text and JSON; the rest would reach terminals later)."""
    return clean(text)


def shorten(text: str, limit: int) -> str:
    """At most `limit` characters, ending in an ellipsis when something was cut."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"


# An escape that `printable` wrote, cut in half at the end of an excerpt: "\\x1" would read as
# a different character, so the fragment goes with the rest of what was cut.
_HALF_ESCAPE_END = re.compile(r"\\(?:x[0-9a-f]?|u[0-9a-f]{0,3})?$")


def excerpt(text: str | None, limit: int, *, end: bool = False) -> str:
    """At most `limit` characters of untrusted text (a body, a log line, a probe's stderr) to show or store:
    the start of it, or with `end` its end, marked with an ellipsis where something was cut.

    The WHOLE text is `clean`ed (redacted, made printable) before the cut. Cutting first would leave the
    half of a secret on the kept side of the cut (``hf_AbCdEf`` of ``hf_AbCdEfGh...``), and no redaction
    rule recognises a half token. Every place that cuts untrusted text goes through here.
    """
    whole = clean(text)
    if len(whole) <= limit:
        return whole
    if limit <= 1:
        return "…"[:limit]
    if end:
        return "…" + whole[len(whole) - (limit - 1) :]
    return _HALF_ESCAPE_END.sub("", whole[: limit - 1]) + "…"


# What an attempt keeps of the answer's text.
COMPLETION_EXCERPT_CHARS = 200


def completion_excerpt(text: str | None) -> str:
    """The start of a completion as it is stored: redacted first, then cut, so a token that straddles the
    cut is hidden whole instead of keeping the few characters before the cut that no rule recognises."""
    return excerpt(text, COMPLETION_EXCERPT_CHARS)


@dataclass(frozen=True)
class LogTail:
    """The end of one process log, ready to show."""

    name: str
    text: str
    size: int
    truncated: bool
    lines: int


def read_tail(path: Path, *, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> LogTail | None:
    """The last `max_lines` lines within the last `max_bytes` bytes of `path`, cleaned; None if unreadable.

    Only the tail is read from disk, so a huge log costs `max_bytes` of memory, not its size.
    """
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            start = max(0, size - max_bytes)
            handle.seek(start)
            data = handle.read(max_bytes)
    except OSError:
        return None
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line was cut by the byte cap: drop it rather than show half
    truncated = start > 0 or len(lines) > max_lines
    kept = lines[-max_lines:] if max_lines > 0 else []
    return LogTail(path.stem, clean("\n".join(kept)), size, truncated, len(kept))


def log_tails(log_dir: str, *, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> list[LogTail]:
    """Tails of every ``*.log`` file of an attempt's log directory, by name; empty when there is none."""
    if not log_dir:
        return []
    directory = Path(log_dir)
    try:
        paths = sorted(p for p in directory.glob("*.log") if p.is_file())
    except OSError:
        return []
    tails = (read_tail(p, max_lines=max_lines, max_bytes=max_bytes) for p in paths)
    return [t for t in tails if t is not None]
