"""A backend's `runtime_template`: how a version found on a package index becomes a runtime.

Declared in the catalog next to the backend, e.g.::

    [[backend]]
    name = "dynamo"
    runtime_template = { package = "ai-dynamo", provider = { kind = "venv", steps = [["ai-dynamo=={version}"]] },
                         components = { ai-dynamo = "{version}" } }

Every string of `provider` and `components` may hold `{version}`, replaced by the discovered version; no
other brace expression is allowed, so a typo fails at catalog load, not at discovery.
"""

from __future__ import annotations

import re
from typing import Any

from matrix.errors import ConfigError

TEMPLATE_KEYS = frozenset({"package", "provider", "components", "notes"})
_FIELD = re.compile(r"\{([^{}]*)\}")


def _substitute(value: Any, version: str, where: str) -> Any:
    if isinstance(value, str):
        for name in _FIELD.findall(value):
            if name != "version":
                raise ConfigError(f"{where}: unknown placeholder {{{name}}} in {value!r}; only {{version}} is known")
        return value.replace("{version}", version)
    if isinstance(value, list):
        return [_substitute(v, version, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _substitute(v, version, f"{where}.{k}") for k, v in value.items()}
    return value


def check_template(template: Any, where: str) -> dict[str, Any]:
    """The template as stored, or a `ConfigError` naming what is wrong (rendered once with a sample version)."""
    if not isinstance(template, dict):
        raise ConfigError(f"{where}: 'runtime_template' must be a table, got {template!r}")
    unknown = sorted(set(template) - TEMPLATE_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} in 'runtime_template'; "
            f"known: {', '.join(sorted(TEMPLATE_KEYS))}"
        )
    if "provider" not in template or not isinstance(template["provider"], dict):
        raise ConfigError(
            f"{where}: 'runtime_template' needs a provider table, e.g. provider = {{ kind = \"venv\", ... }}"
        )
    if not isinstance(template.get("package", ""), str) or not isinstance(template.get("notes", ""), str):
        raise ConfigError(f"{where}: 'runtime_template' package and notes must be strings")
    components = template.get("components", {})
    if not isinstance(components, dict) or not all(isinstance(v, str) for v in components.values()):
        raise ConfigError(f"{where}: 'runtime_template' components must map names to version strings")
    render(template, "0.0.1", where)
    return dict(template)


def render(template: dict[str, Any], version: str, where: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """(provider, components, notes) of the runtime for `version`; the provider is checked like the catalog's."""
    from matrix.launch.providers.recipe import check_provider

    provider = _substitute(template["provider"], version, f"{where}: runtime_template.provider")
    components = _substitute(template.get("components", {}), version, f"{where}: runtime_template.components")
    check_provider(provider, f"{where}: runtime_template for {version}")
    return provider, components, str(template.get("notes", ""))
