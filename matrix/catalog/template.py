"""A backend's `runtime_template`: how a version found on a package index becomes a runtime.

Declared in the catalog next to the backend, e.g.::

    [[backend]]
    name = "dynamo"
    runtime_template = { package = "ai-dynamo", provider = { kind = "venv", steps = [["ai-dynamo=={version}"]] },
                         components = { ai-dynamo = "{version}" } }

Every string of `provider` and `components` may hold `{version}`, replaced by the discovered version; no
other brace expression is allowed, so a typo fails at catalog load, not at discovery.

A release that needs another pin than the template's (vLLM 0.33.0 refuses to start with NIXL below 1.5.0, a
requirement its wheel does not declare) gets it from `pins`, checked at catalog load::

    pins = [{ since = "0.33.0", set = ["nixl==1.5.0", "nixl-cu13==1.5.0"] }]

From `since` on (PEP 440 order), every requirement of the steps that names a package of `set` becomes that
pin, and so does the component of that name. Rules apply oldest `since` first, so a later rule overrides an
earlier one for the same package. A `set` entry must be `name==version` and name a package the steps
already install: a pin that would change nothing is a typo, not a rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from matrix.errors import ConfigError

TEMPLATE_KEYS = frozenset({"package", "provider", "components", "notes", "pins"})
PIN_KEYS = frozenset({"since", "set"})
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
    pins = _pins(template, where)
    render(template, "0.0.1", where)
    for pin in pins:
        render(template, str(pin.since), where)
    return dict(template)


@dataclass(frozen=True)
class Pin:
    """One `pins` rule: from `since` on, these packages (canonical name -> `name==version`) are pinned so."""

    since: Version
    requirements: dict[str, str]


def _exact(text: Any, where: str) -> tuple[str, str]:
    """(canonical name, version) of a `name==version` pin; a `ConfigError` for anything else."""
    try:
        requirement = Requirement(text) if isinstance(text, str) else None
    except InvalidRequirement:
        requirement = None
    specs = list(requirement.specifier) if requirement is not None else []
    if requirement is None or len(specs) != 1 or specs[0].operator != "==" or requirement.marker or requirement.extras:
        raise ConfigError(f"{where}: pin {text!r} must be name==version (e.g. \"nixl==1.5.0\")")
    return canonicalize_name(requirement.name), specs[0].version


def _step_names(value: Any) -> set[str]:
    """The canonical names of every requirement string in the provider's steps (flags and paths are not)."""
    if isinstance(value, str):
        name = _requirement_name(value)
        return {name} if name else set()
    if isinstance(value, list):
        return set().union(*(_step_names(v) for v in value)) if value else set()
    if isinstance(value, dict):
        return set().union(*(_step_names(v) for v in value.values())) if value else set()
    return set()


def _requirement_name(text: str) -> str | None:
    if text.startswith("-") or "/" in text:
        return None
    try:
        return canonicalize_name(Requirement(text.replace("{version}", "0")).name)
    except InvalidRequirement:
        return None


def _pins(template: dict[str, Any], where: str) -> list[Pin]:
    """The template's `pins`, oldest `since` first, each checked (see the module's docstring)."""
    raw = template.get("pins", [])
    at = f"{where}: runtime_template.pins"
    if not isinstance(raw, list):
        raise ConfigError(f"{at} must be a list of tables, e.g. [{{ since = \"0.33.0\", set = [\"nixl==1.5.0\"] }}]")
    installed = _step_names(template["provider"].get("steps", []))
    pins: list[Pin] = []
    for i, rule in enumerate(raw):
        here = f"{at}[{i}]"
        if not isinstance(rule, dict):
            raise ConfigError(f"{here} must be a table {{ since = \"VERSION\", set = [\"name==version\", ...] }}")
        unknown = sorted(set(rule) - PIN_KEYS)
        missing = sorted(PIN_KEYS - set(rule))
        if unknown or missing:
            what = f"unknown key(s) {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
            raise ConfigError(f"{here}: {what}; a pin has exactly since and set")
        try:
            since = Version(str(rule["since"]))
        except InvalidVersion:
            raise ConfigError(f"{here}: since = {rule['since']!r} is not a PEP 440 version") from None
        if not isinstance(rule["set"], list) or not rule["set"]:
            raise ConfigError(f"{here}: set must be a non-empty list of name==version pins")
        requirements: dict[str, str] = {}
        for text in rule["set"]:
            name, _version = _exact(text, here)
            if name not in installed:
                raise ConfigError(
                    f"{here}: {text!r} pins {name}, which no step of the template installs; "
                    f"pin one of: {', '.join(sorted(installed)) or 'none'}"
                )
            requirements[name] = str(text)
        pins.append(Pin(since, requirements))
    if len({p.since for p in pins}) != len(pins):
        raise ConfigError(f"{at}: two rules have the same since; merge them into one")
    return sorted(pins, key=lambda p: p.since)


def _pinned(value: Any, pins: dict[str, str]) -> Any:
    """`value` with every requirement string naming a pinned package replaced by its pin."""
    if isinstance(value, str):
        name = _requirement_name(value)
        return pins.get(name, value) if name else value
    if isinstance(value, list):
        return [_pinned(v, pins) for v in value]
    if isinstance(value, dict):
        return {k: _pinned(v, pins) for k, v in value.items()}
    return value


def pins_for(template: dict[str, Any], version: str, where: str) -> dict[str, str]:
    """The pins (canonical name -> `name==version`) that apply to `version`, later rules winning."""
    from matrix.versions import parse_version

    chosen: dict[str, str] = {}
    wanted = parse_version(version)
    for pin in _pins(template, where):
        if wanted >= pin.since:
            chosen.update(pin.requirements)
    return chosen


def render(template: dict[str, Any], version: str, where: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """(provider, components, notes) of the runtime for `version`; the provider is checked like the catalog's."""
    from matrix.launch.providers.recipe import check_provider

    provider = _substitute(template["provider"], version, f"{where}: runtime_template.provider")
    components = _substitute(template.get("components", {}), version, f"{where}: runtime_template.components")
    pins = pins_for(template, version, where)
    if pins:
        provider = {**provider, "steps": _pinned(provider.get("steps", []), pins)}
        by_name: dict[str, str] = {canonicalize_name(name): name for name in components}
        for name, text in pins.items():
            if name in by_name:
                components[by_name[name]] = _exact(text, where)[1]
    check_provider(provider, f"{where}: runtime_template for {version}")
    return provider, components, str(template.get("notes", ""))
