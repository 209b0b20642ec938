"""Read catalog TOML files into validated specs.

Every problem names the file and the entry (and, for TOML syntax, the line) and says what to change.
Nothing here touches the database: `sync` applies a fully validated `CatalogSpec` in one transaction.
"""

from __future__ import annotations

import datetime as dt
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from matrix.arm_table import LAUNCH_TYPES, parse_launch
from matrix.catalog.spec import (
    CHANNELS,
    MARKER_KINDS,
    PROVIDER_KINDS,
    BackendSpec,
    CaseSpec,
    CatalogSpec,
    FixSpec,
    GateSpec,
    MarkerSpec,
    RuntimeSpec,
    WaiverSpec,
)
from matrix.component_sources import derive, parse_changes, variant_label
from matrix.errors import ConfigError
from matrix.launch.options import check_case_options
from matrix.resources import resource_dir
from matrix.traffic_profile import TrafficProfile, TrafficProfileError, parse_traffic
from matrix.versions import component_has_fix, parse_specifier, parse_version, tag_for

T = TypeVar("T")

# TOML table name -> (CatalogSpec attribute, parser)
_SECTIONS = ("backend", "runtime", "marker", "fix", "case", "gate", "waiver")


def default_catalog_files() -> list[Path]:
    """The seed catalog shipped with matrix."""
    return sorted(resource_dir("data").glob("*.toml"))


class _Entry:
    """One `[[kind]]` table with helpers that produce precise error messages."""

    def __init__(self, path: Path, kind: str, index: int, raw: object) -> None:
        self.path, self.kind, self.index = path, kind, index
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: [[{kind}]] entry {index + 1} must be a table")
        self.raw: dict[str, Any] = raw
        self.used: set[str] = set()

    @property
    def where(self) -> str:
        name = self.raw.get("name") or self.raw.get("key") or self.raw.get("version") or self.raw.get("case")
        label = f" {name!r}" if isinstance(name, str) else f" #{self.index + 1}"
        return f"{self.path.name}: [[{self.kind}]]{label}"

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def get(self, key: str, typ: type[T] | tuple[type, ...], default: T | None = None, *, required: bool = False) -> T:
        self.used.add(key)
        if key not in self.raw:
            if required:
                raise self.fail(f"missing required key {key!r}")
            return default  # type: ignore[return-value]
        value = self.raw[key]
        # bool is an int in Python; a TOML `true` where a number is expected is a mistake.
        wrong_bool = isinstance(value, bool) and typ in (int, float, (int, float))
        if wrong_bool or not isinstance(value, typ):
            expected = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            raise self.fail(f"{key!r} must be a {expected}, got {value!r}")
        return value  # type: ignore[return-value]

    def str_list(self, key: str) -> list[str]:
        values = self.get(key, list, [])
        if not all(isinstance(v, str) for v in values):
            raise self.fail(f"{key!r} must be a list of strings, got {values!r}")
        return list(values)

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            raise self.fail(
                f"unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(self.used))}"
            )


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read catalog file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already carries "(at line L, column C)".
        raise ConfigError(f"malformed TOML in {path}: {exc}") from None
    where = _nul_at(data, "")
    if where is not None:
        raise ConfigError(
            f"{path}: {where} contains a NUL character (\\u0000), which no database can store as text; remove it"
        )
    return data


def _nul_at(value: Any, where: str) -> str | None:
    """The dotted path of the first string (or key) holding a NUL, else None."""
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if "\x00" in str(key):
                return repr(path)
            found = _nul_at(item, path)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _nul_at(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


def _backend(e: _Entry) -> BackendSpec:
    from matrix.catalog.template import check_template

    template = e.get("runtime_template", dict, None)
    return BackendSpec(
        name=_name(e),
        description=e.get("description", str, ""),
        runtime_template=check_template(template, e.where) if template is not None else None,
    )


def _name(e: _Entry, key: str = "name") -> str:
    name = e.get(key, str, required=True).strip()
    if not name:
        raise e.fail(f"{key!r} must not be empty")
    return name


def _variant(e: _Entry, backend: str) -> RuntimeSpec:
    """A `base` + `with` entry: resolved against its base once every file is read (`_resolve_variants`)."""
    base = e.get("base", str, required=True)
    raw = e.get("with", dict, {})
    if not raw or not all(isinstance(v, str) for v in raw.values()):
        raise e.fail(
            'a runtime with base needs with = { COMPONENT = "VERSION", ... }, e.g. with = { vllm-rs = "0.30.0" }'
        )
    for key in ("provider", "components"):
        if key in e.raw:
            raise e.fail(f"a runtime with base takes its {key} from the base; drop {key!r} (or drop base)")
    try:
        base = str(parse_version(base))
        changes = parse_changes([f"{k}={v}" for k, v in raw.items()], "with")
        version = parse_version(e.get("version", str, variant_label(base, changes)))
    except ConfigError as exc:
        raise e.fail(str(exc)) from None
    return RuntimeSpec(
        backend=backend, version=str(version), tag=e.get("tag", str, tag_for(version)),
        channel=e.get("channel", str, _default_channel(version.is_prerelease, version.is_devrelease)),
        provider={}, components={}, enabled=e.get("enabled", bool, True), notes=e.get("notes", str, ""),
        base=base, vary=changes,
    )  # fmt: skip


def _resolve_variants(spec: CatalogSpec) -> None:
    """Fill each variant's recipe and components from its base (a non-variant runtime of any file read)."""
    bases = {(r.backend, r.version): r for r in spec.runtimes if not r.base}
    for index, runtime in enumerate(spec.runtimes):
        if not runtime.base:
            continue
        where = f"[[runtime]] {runtime.backend} {runtime.version}"
        base = bases.get((runtime.backend, runtime.base))
        if base is None:
            known = ", ".join(v for b, v in sorted(bases) if b == runtime.backend) or "none"
            raise ConfigError(f"{where}: base {runtime.base} is not a runtime of {runtime.backend} (known: {known})")
        derived = derive(base.backend, base.version, base.provider, base.components, runtime.vary, where)
        notes = runtime.notes or derived.notes
        spec.runtimes[index] = replace(runtime, provider=derived.provider, components=derived.components, notes=notes)


def _runtime(e: _Entry) -> RuntimeSpec:
    backend = _name(e, "backend")
    if "base" in e.raw:
        return _variant(e, backend)
    raw_version = e.get("version", str, required=True)
    try:
        version = parse_version(raw_version)
    except ConfigError as exc:
        raise e.fail(str(exc)) from None
    channel = e.get("channel", str, _default_channel(version.is_prerelease, version.is_devrelease))
    if channel not in CHANNELS:
        raise e.fail(f"channel {channel!r} is not one of {', '.join(CHANNELS)}")
    provider = e.get("provider", dict, {"kind": "host"})
    if provider.get("kind") not in PROVIDER_KINDS:
        raise e.fail(f"provider.kind {provider.get('kind')!r} is not one of {', '.join(PROVIDER_KINDS)}")
    components: dict[str, str] = {}
    for name, value in e.get("components", dict, {}).items():
        if not isinstance(value, str):
            raise e.fail(f"component {name!r} must have a version string, got {value!r}")
        try:
            components[name] = str(parse_version(value))
        except ConfigError as exc:
            raise e.fail(f"component {name!r}: {exc}") from None
    return RuntimeSpec(
        backend=backend,
        version=str(version),
        tag=e.get("tag", str, tag_for(version)),
        channel=channel,
        provider=dict(provider),
        components=components,
        enabled=e.get("enabled", bool, True),
        notes=e.get("notes", str, ""),
    )


def _default_channel(pre: bool, dev: bool) -> str:
    if dev:
        return "dev"
    return "rc" if pre else "release"


def _marker(e: _Entry) -> MarkerSpec:
    name = _name(e)
    if not name.isidentifier():
        raise e.fail(f"marker name {name!r} must be an identifier (letters, digits, underscores)")
    kind = e.get("kind", str, "other")
    if kind not in MARKER_KINDS:
        raise e.fail(f"kind {kind!r} is not one of {', '.join(MARKER_KINDS)}")
    return MarkerSpec(
        name=name,
        kind=kind,
        description=e.get("description", str, ""),
        parametrised=e.get("parametrised", bool, False),
    )


def _fix(e: _Entry) -> FixSpec:
    fixed_in = e.str_list("fixed_in")
    if not fixed_in:
        raise e.fail("'fixed_in' must list at least one version")
    try:
        fixed_in = [str(parse_version(v)) for v in fixed_in]
        component_has_fix(parse_version(fixed_in[0]), fixed_in)  # rejects two entries on one release line
    except ConfigError as exc:
        raise e.fail(str(exc)) from None
    return FixSpec(
        key=_name(e, "key"),
        component=_name(e, "component"),
        fixed_in=fixed_in,
        link=e.get("link", str, ""),
        description=e.get("description", str, ""),
    )


def _case(e: _Entry) -> CaseSpec:
    constraint = e.get("version_constraint", str, "")
    if constraint:
        try:
            parse_specifier(constraint)
        except ConfigError as exc:
            raise e.fail(str(exc)) from None
    source_dir = e.get("source_dir", str, "")
    # Launch scripts of a case resolve against the directory it declares, itself relative to its file.
    resolved_dir = (e.path.parent / source_dir).resolve() if source_dir else e.path.parent.resolve()
    arm, markers, launch = _name(e, "arm"), e.str_list("markers"), dict(e.get("launch", dict, {}))
    try:
        kv_bound = check_case_options(arm, launch, e.get("kv_bound", dict, {}), markers)
    except ConfigError as exc:
        raise e.fail(str(exc)) from None
    traffic = _traffic(e, arm, launch)
    startup = float(e.get("startup_timeout_s", (int, float), 300.0))
    request = float(e.get("request_timeout_s", (int, float), 60.0))
    if startup <= 0 or request <= 0:
        raise e.fail("timeouts must be positive")
    return CaseSpec(
        name=_name(e),
        backend=_name(e, "backend"),
        arm=arm,
        model=_name(e, "model"),
        markers=markers,
        description=e.get("description", str, ""),
        payload=dict(e.get("payload", dict, {})),
        kv_bound=kv_bound,
        startup_timeout_s=startup,
        request_timeout_s=request,
        launch=launch,
        source_dir=str(resolved_dir),
        version_constraint=constraint,
        requires_fixes=e.str_list("requires_fixes"),
        weights_gib=float(e.get("weights_gib", (int, float), 0.0)),
        enabled=e.get("enabled", bool, True),
        traffic=traffic,
    )


def _traffic(e: _Entry, arm: str, launch: dict[str, Any]) -> TrafficProfile | None:
    """The case's `traffic` table typed; its streams are judged by the equivalence oracle's twin, so a case
    with traffic must ask for `launch.equivalence`."""
    raw = e.get("traffic", dict, None)
    if raw is None:
        return None
    try:
        profile = parse_traffic(raw)
    except TrafficProfileError as exc:
        raise e.fail(str(exc)) from None
    # An unknown arm is refused where every case's arm is checked; its launch table has no type to read.
    if arm in LAUNCH_TYPES and not parse_launch(arm, launch).equivalence:
        raise e.fail(
            "traffic needs launch.equivalence (every stream is compared with the aggregated twin's answer to "
            "its own prompt): add equivalence = true to the case's launch table"
        )
    return profile


def _gate(e: _Entry) -> GateSpec:
    return GateSpec(
        name=_name(e),
        expression=e.get("expression", str, required=True),
        description=e.get("description", str, ""),
        rules=dict(e.get("rules", dict, {})),
    )


def _waiver(e: _Entry) -> WaiverSpec:
    expires: dt.date | str | None = e.get("expires", (dt.date, str), None)
    if isinstance(expires, str):
        try:
            expires = dt.date.fromisoformat(expires)
        except ValueError:
            raise e.fail(f"expires {expires!r} must be a date such as 2026-12-31") from None
    if isinstance(expires, dt.datetime):
        expires = expires.date()
    spec = e.get("runtime_spec", str, "")
    if spec:
        try:
            parse_specifier(spec)
        except ConfigError as exc:
            raise e.fail(str(exc)) from None
    return WaiverSpec(
        case=_name(e, "case"),
        reason=_name(e, "reason"),
        runtime_spec=spec,
        link=e.get("link", str, ""),
        expires=expires,
        owner=e.get("owner", str, "").strip(),
    )


_PARSERS: dict[str, tuple[str, Callable[[_Entry], Any]]] = {
    "backend": ("backends", _backend),
    "runtime": ("runtimes", _runtime),
    "marker": ("markers", _marker),
    "fix": ("fixes", _fix),
    "case": ("cases", _case),
    "gate": ("gates", _gate),
    "waiver": ("waivers", _waiver),
}


def load_catalog(paths: Sequence[Path]) -> CatalogSpec:
    """Parse and validate `paths` (each entry alone; cross-references are checked by `sync`)."""
    spec = CatalogSpec()
    if not paths:
        raise ConfigError("no catalog files given")
    first_seen: dict[tuple[str, str], str] = {}  # (kind, natural key) -> where it was defined
    for path in paths:
        doc = _read_toml(path)
        if not doc:
            # Often a truncated copy or a wrong path: syncing "nothing" from it must not pass unnoticed.
            size = path.stat().st_size if path.exists() else 0
            what = "is empty (0 bytes)" if size == 0 else "defines no entries (only comments or blank lines)"
            spec.warnings.append(f"catalog file {path} {what}: nothing is read from it")
        source = source_id(path)
        spec.files.add(source)
        unknown = sorted(set(doc) - set(_SECTIONS))
        if unknown:
            raise ConfigError(
                f"{path.name}: unknown section(s) {', '.join(map(repr, unknown))}; use [[{']], [['.join(_SECTIONS)}]]"
            )
        for kind, items in doc.items():
            if not isinstance(items, list):
                raise ConfigError(f"{path.name}: {kind!r} must be an array of tables: write [[{kind}]]")
            attr, parser = _PARSERS[kind]
            spec.kinds.add(kind)
            for index, raw in enumerate(items):
                entry = _Entry(path, kind, index, raw)
                parsed = parser(entry)
                getattr(spec, attr).append(parsed)
                entry.finish()
                spec.sources[(kind, natural_key(kind, parsed))] = source
                _reject_duplicate(first_seen, kind, parsed, f"{path} ([[{kind}]] #{index + 1})")
    _resolve_variants(spec)
    return spec


def source_id(path: Path) -> str:
    """How a catalog file is recorded on the rows it defines: its file name.

    The name, not the path: a checkout moves (CI work directories differ per run), and a copy of the seed
    catalog edited elsewhere (`cases.toml`) is meant to take over the rows the seed's `cases.toml` defined.
    """
    return path.name


def natural_key(kind: str, entry: Any) -> Any:
    """The key sync matches rows by: a name, (backend, version) of a runtime, (case, spec) of a waiver."""
    if kind == "runtime":
        return (entry.backend, entry.version)
    if kind == "waiver":
        return (entry.case, entry.runtime_spec)
    if kind == "fix":
        return entry.key
    return entry.name


# The natural key of each kind that may be defined only once across the files (waivers may repeat).
_KEYS: dict[str, Callable[[Any], str]] = {
    "backend": lambda b: str(b.name),
    "runtime": lambda r: f"{r.backend} {r.version}",
    "marker": lambda m: str(m.name),
    "fix": lambda f: str(f.key),
    "case": lambda c: str(c.name),
    "gate": lambda g: str(g.name),
}


def _reject_duplicate(first_seen: dict[tuple[str, str], str], kind: str, parsed: Any, where: str) -> None:
    key_of = _KEYS.get(kind)
    if key_of is None:
        return
    key = (kind, key_of(parsed))
    if key in first_seen:
        raise ConfigError(
            f"duplicate {kind} {key[1]}: {where} defines it again after {first_seen[key]}; "
            f"each {kind} may be defined once across the catalog files"
        )
    first_seen[key] = where
