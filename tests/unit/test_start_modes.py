"""`matrix run`'s start modes: which flags make which `Start`, and each option a start mode contradicts
refused with its own message (the command line turns it into a usage error, exit 2)."""

from __future__ import annotations

from typing import Any

import pytest

from matrix.schedule.start import Start, StartConflict


def test_the_flags_make_one_start_each() -> None:
    assert Start.from_flags(None, None, None) == Start() == Start("new", None)
    assert Start.from_flags(3, None, None) == Start("resume", 3)
    assert Start.from_flags(None, 0, None) == Start("rerun-failed", 0)  # `--rerun-failed` alone: the latest
    assert Start.from_flags(None, None, 5) == Start("join", 5)
    assert not Start().continuing and all(Start(m, 1).continuing for m in ("resume", "rerun-failed", "join"))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ((1, 0, None), "use --resume or --rerun-failed, not both"),
        ((1, None, 2), "--join helps with a running campaign"),
        ((None, 0, 2), "--join helps with a running campaign"),
    ],
)
def test_two_start_modes_at_once_are_refused(flags: tuple[int | None, int | None, int | None], needle: str) -> None:
    with pytest.raises(StartConflict, match=needle):
        Start.from_flags(*flags)


def test_each_option_a_continued_campaign_contradicts_has_its_message() -> None:
    join, resume, rerun = Start("join", 1), Start("resume", 1), Start("rerun-failed", None)
    cases: list[tuple[Start, dict[str, Any], str]] = [
        (
            join,
            {"selecting": ["-m", "--backend"]},
            "--join runs the cells the joined campaign selected; drop -m, --backend",
        ),
        (resume, {"cells": True}, "--cell starts a new campaign"),
        (join, {"cells": True}, "--cell starts a new campaign"),
        (rerun, {"new_only": True}, "--new starts a new campaign of never-run runtimes"),
        (resume, {"variants": True}, "--with starts a new campaign of variants"),
        (join, {"variants": True}, "--with starts a new campaign of variants"),
        (rerun, {"repeat": 2}, "--repeat plans the repeats of a new campaign"),
    ]
    for start, given, needle in cases:
        with pytest.raises(StartConflict, match=needle):
            start.check(**given)
    # What a new campaign takes, and what the modes that do not contradict it keep taking.
    Start().check(cells=True, new_only=True, variants=True, repeat=3, selecting=["-m"])
    resume.check(selecting=["-m"])
    rerun.check(variants=True)
