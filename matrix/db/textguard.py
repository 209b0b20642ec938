"""No NUL byte reaches the database: PostgreSQL refuses it in text and JSON, SQLite would keep it.

What processes produce (messages, log tails, component versions) is cleaned before it is stored
(`matrix.text.store_text`); this guard is the net under every other write. Before each flush it
looks at the string values of new and changed rows (JSON values too): in the execution record
(`campaign`, `cell_run`) a NUL becomes the visible escape ``\\x00``, because evidence must be kept; in the
catalog, which a person wrote, it is an error naming the table and column (exit 2, nothing written).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, inspect
from sqlalchemy.orm import Session, sessionmaker

from matrix.errors import ConfigError

NUL = "\x00"
_EVIDENCE_TABLES = frozenset({"campaign", "cell_run"})


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return NUL in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(NUL, "\\x00")
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    return value


def _check(session: Session, _context: Any, _instances: Any) -> None:
    for row in (*session.new, *session.dirty):
        mapper = inspect(row).mapper
        table = mapper.local_table.name
        for column in mapper.column_attrs:
            value = getattr(row, column.key, None)
            if not _has_nul(value):
                continue
            if table in _EVIDENCE_TABLES:
                setattr(row, column.key, _escaped(value))
                continue
            raise ConfigError(
                f"{table}.{column.key} contains a NUL byte (\\x00), which a database cannot store as text: "
                "remove it from the catalog file or the command's arguments; nothing was written"
            )


def install(factory: sessionmaker[Session]) -> sessionmaker[Session]:
    """Guard every session `factory` makes."""
    event.listen(factory, "before_flush", _check)
    return factory
