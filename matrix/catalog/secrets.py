"""The catalog's own secrets: values of provider `env` settings whose names say they are secret.

A runtime's provider may carry `env = { MY_API_KEY = "...", DB_PASSWORD = "$DB_PASSWORD" }`. Its processes
see those values, and one that prints a value bare ("auth failed for <value>", a probe's stderr) gives it
away where no name says it is secret. So every command hands these values to the redaction, which then
hides them by value at every exit (`matrix.redact.remember_secrets`; `docs/security.md`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Runtime

__all__ = ["catalog_secrets", "provider_secrets"]

# The names `matrix.redact.secret_name` calls secret (kept apart from the redaction; a test keeps
# the two in step).
SECRET_NAME = re.compile(r"TOKEN(?!IZ)|SECRET|PASSWORD|PASSWD|CREDENTIAL|[_-]KEY|APIKEY|PWD", re.IGNORECASE)


def provider_secrets(providers: Iterable[Mapping[str, Any] | None]) -> set[str]:
    """The values under secret names in these providers' `env`, as written and as `$VAR`s expand here."""
    values: set[str] = set()
    for provider in providers:
        env = provider.get("env") if isinstance(provider, Mapping) else None
        if not isinstance(env, Mapping):
            continue
        for name, value in env.items():
            if isinstance(value, str) and value and SECRET_NAME.search(str(name)):
                values.add(value)
                values.add(os.path.expandvars(value))  # "$MY_API_KEY": what the processes really see
    return values


def catalog_secrets(session: Session) -> set[str]:
    """`provider_secrets` of every runtime (retired ones too) and every backend's runtime template."""
    providers: list[Mapping[str, Any] | None] = list(session.scalars(select(Runtime.provider)))
    for template in session.scalars(select(Backend.runtime_template)):
        if isinstance(template, Mapping):
            providers.append(template.get("provider"))
    return provider_secrets(providers)
