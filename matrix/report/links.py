"""File names and anchors of report pages, and which links may be followed.

Every page lives flat in the output directory so that relative links work from `file://` and from any
static host. Names are built from catalog names and versions, reduced to characters that need no
quoting in a URL or a file system (PEP 440's ``+`` of local versions becomes ``_``).
"""

from __future__ import annotations

import functools
import re
from urllib.parse import urlsplit

__all__ = [
    "DETECTION",
    "EPISODES",
    "EVIDENCE",
    "INDEX",
    "QUARANTINE",
    "SINCE_LAST",
    "campaign_page",
    "cell_anchor",
    "cell_href",
    "compare_page",
    "external_url",
    "gate_page",
    "runtime_page",
    "slug",
]

INDEX = "index.html"
# The newest campaign against the one before it (`matrix.report.diff`), rewritten on every refresh.
SINCE_LAST = "since-last.html"
# Every quarantine, in force or ended, with its entry and exit (`matrix.report.muted`).
QUARANTINE = "quarantine.html"
# Per gate policy, the age of each required cell's latest evidence (`matrix.report.evidence`).
EVIDENCE = "evidence.html"
# Failure episodes, open ones first (`matrix.report.episodes`).
EPISODES = "episodes.html"
# Per KV fault class, what the checks caught (`matrix.report.detection`).
DETECTION = "detection.html"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@functools.lru_cache(maxsize=4096)  # a report asks for the same case names and versions many times
def slug(text: str) -> str:
    """`text` with every run of characters outside ``[A-Za-z0-9._-]`` replaced by ``_``."""
    return _UNSAFE.sub("_", text).strip(".") or "_"


def runtime_page(backend: str, version: str) -> str:
    return f"runtime-{slug(backend)}-{slug(version)}.html"


def gate_page(backend: str, version: str, policy: str) -> str:
    return f"gate-{slug(backend)}-{slug(version)}-{slug(policy)}.html"


def campaign_page(campaign_id: int) -> str:
    return f"campaign-{campaign_id}.html"


def compare_page(a: str, b: str) -> str:
    return f"compare-{slug(a)}-vs-{slug(b)}.html"


def cell_anchor(case_name: str) -> str:
    return f"cell-{slug(case_name)}"


def cell_href(backend: str, version: str, case_name: str) -> str:
    """Link to one cell: its section on its runtime's page."""
    return f"{runtime_page(backend, version)}#{cell_anchor(case_name)}"


def external_url(link: str | None) -> str | None:
    """`link` if it is an http(s) URL, else None: catalog links become hrefs only when harmless.

    Autoescaping stops markup, not ``javascript:`` or ``data:`` URLs in an href; those are shown as
    text instead.
    """
    if not link:
        return None
    try:
        parts = urlsplit(link.strip())
    except ValueError:
        return None
    if parts.scheme.lower() in ("http", "https") and parts.netloc:
        return link.strip()
    return None
