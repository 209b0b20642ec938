"""How a `matrix run` starts: a new campaign, or a recorded one continued.

- `new`: plan the selection (or `--cell`, `--new`, `--with`, `--repeat`) into a new campaign.
- `resume`: the cells of a stopped campaign that have no finished attempt (`--resume N`).
- `rerun-failed`: the cells whose latest attempt failed, as new attempts (`--rerun-failed [N]`; no N: the
  latest campaign).
- `join`: the pending cells of a campaign that another runner is running (`--join N`).

Which other options a start mode contradicts is decided here alone (`Start.from_flags`, `Start.check`), one
message each, raised as `StartConflict` (exit 2) before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from matrix.errors import ConfigError

Mode = Literal["new", "resume", "rerun-failed", "join"]


class StartConflict(ConfigError):
    """`matrix run` was given options that contradict its start mode."""


@dataclass(frozen=True)
class Start:
    mode: Mode = "new"
    # The campaign continued (resume, rerun-failed, join); 0 or None: the latest one (resume, rerun-failed).
    campaign: int | None = None

    @classmethod
    def from_flags(cls, resume: int | None, rerun_failed: int | None, join: int | None) -> Start:
        """The start `--resume`, `--rerun-failed` and `--join` ask for (none of them: a new campaign)."""
        if resume is not None and rerun_failed is not None:
            raise StartConflict("use --resume or --rerun-failed, not both")
        if join is not None and (resume is not None or rerun_failed is not None):
            raise StartConflict(
                "--join helps with a running campaign; --resume/--rerun-failed restart a stopped one: use one of them"
            )
        if join is not None:
            return cls("join", join)
        if resume is not None:
            return cls("resume", resume)
        if rerun_failed is not None:
            return cls("rerun-failed", rerun_failed)
        return cls()

    @property
    def continuing(self) -> bool:
        """Whether the run continues a recorded campaign instead of planning a new one."""
        return self.mode != "new"

    def check(
        self,
        *,
        cells: bool = False,
        new_only: bool = False,
        variants: bool = False,
        repeat: int = 1,
        selecting: Sequence[str] = (),
    ) -> None:
        """Raise `StartConflict` for the first option given that this start contradicts: `cells` (`--cell`),
        `new_only` (`--new`), `variants` (`--with`), `repeat` (`--repeat N`), and `selecting`, the selection
        flags given (`-m`, `--backend`...), which `--join` takes from the joined campaign."""
        if self.mode == "join" and selecting:
            raise StartConflict(f"--join runs the cells the joined campaign selected; drop {', '.join(selecting)}")
        if cells and self.continuing:
            raise StartConflict(
                "--cell starts a new campaign; it cannot be combined with --resume, --rerun-failed or --join"
            )
        if new_only and self.continuing:
            raise StartConflict(
                "--new starts a new campaign of never-run runtimes; drop --resume/--rerun-failed/--join"
            )
        # `--rerun-failed` still takes `--with`, as it always has (the run's report then covers the variants).
        if variants and self.mode in ("resume", "join"):
            raise StartConflict("--with starts a new campaign of variants; drop --resume/--join")
        if repeat > 1 and self.continuing:
            raise StartConflict(
                "--repeat plans the repeats of a new campaign; --resume/--rerun-failed/--join run the "
                "attempts a campaign already has: drop --repeat"
            )
