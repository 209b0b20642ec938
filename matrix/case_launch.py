"""A case's `launch` table, typed per arm: one frozen dataclass per arm, checked at `matrix catalog sync`.

Each field is a launch key the arm reads, with the kind of value it takes (`kind` in the field's metadata);
`parse_typed` (for an arm's name: `arm_table.parse_launch`) turns a TOML table into the arm's dataclass or
raises `ConfigError` naming the key and the fix (the caller adds file and entry), so a value of the wrong type
is refused before the database is touched instead of failing, or being misread, when a cell starts. The key
sets `options.LAUNCH_KEYS` are the fields of these classes. A field left None takes the arm's own default at
launch (several defaults differ by engine: `max_model_len` is 512 for vLLM's pair, 2048 under Dynamo, 1024 for
SGLang). Which arm takes which dataclass is its row in the arm table (`matrix.arm_table.LAUNCH_TYPES`). Pure
data: this module imports nothing of the launch machinery, so the catalog may import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

from matrix.errors import ConfigError

# The roles a `role_launch` table may name: the two sides of a disaggregated pair.
OVERRIDE_ROLES = ("prefill", "decode")

# The kinds of value a launch key takes: how the refusal names it, and an example of one.
KINDS = {
    "bool": ("true or false", "true"),
    "int": ("an integer", "1024"),
    "number": ("a number", "0.05"),
    "str": ("a string", '"text"'),
    "strings": ("a list of strings", '["a", "b"]'),
    "args": ("a list of strings or numbers", '["--flag", 1]'),
    "env": ("a table of variables", '{ NAME = "value" }'),
    "role_env": ("a table of variables per role", '{ decode = { NAME = "value" } }'),
    "role_launch": ("a table of launch keys per role", "{ decode = { block_size = 64 } }"),
    "any": ("any value", "..."),
}


def _key(kind: str, default: Any = None) -> Any:
    return field(default=default, metadata={"kind": kind})


def _scalar(value: object) -> bool:
    return isinstance(value, str | int | float)


def _valid(kind: str, value: object) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "strings":
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    if kind == "args":
        return isinstance(value, list | tuple) and all(_scalar(v) for v in value)
    if kind == "env":
        return isinstance(value, Mapping) and all(_scalar(v) for v in value.values())
    if kind == "role_env":
        return isinstance(value, Mapping) and all(_valid("env", v) for v in value.values())
    if kind == "role_launch":
        return isinstance(value, Mapping) and all(isinstance(v, Mapping) for v in value.values())
    return True


@dataclass(frozen=True)
class CommonLaunch:
    """Keys every arm may carry: read by the runner (model_dir, expect_failed_checks, equivalence, which
    `check_equivalence` checks, lifecycle), the scheduler (exclusive_startup) and the container provider
    (shm_gib, engine)."""

    model_dir: str | None = _key("str")
    expect_failed_checks: tuple[str, ...] | None = _key("strings")
    shm_gib: float | None = _key("number")
    engine: str | None = _key("str")
    equivalence: object = _key("any")
    exclusive_startup: bool | None = _key("bool")
    # `false` leaves out the streaming, cancel and orphan checks (timing studies).
    lifecycle: bool | None = _key("bool")
    # A KV fault injected on purpose into one role's engine ([M28]): "CLASS" or "CLASS:ROLE" (matrix.launch.faults;
    # armed by the vllm_native arm). A cell where it never fired is "not exercised" (matrix.check.faults).
    # "none": the healthy twin (the detection table's A/A cells); no fault, and it joins the fault grid.
    kv_fault: str | None = _key("str")


@dataclass(frozen=True)
class ReferenceLaunch(CommonLaunch):
    device: str | None = _key("str")
    faults: tuple[str, ...] | None = _key("strings")
    slow_start_s: float | None = _key("number")
    teardown_grace_s: float | None = _key("number")
    token_delay_ms: float | None = _key("number")
    # xPyD ([M27]): "1p2d" starts one prefill and two decode workers behind the one frontend, which routes
    # round robin across them; None is one of each (`topology_counts`).
    topology: str | None = _key("str")
    # Seconds a worker keeps KV no decode took (the engine's own timeout; the worker's default is 60).
    kv_ttl_s: float | None = _key("number")
    # [M27] peer loss: true, or a table of `PEER_LOSS_DEFAULTS` keys (`peer_loss_options`).
    peer_loss: object = _key("any")


# The most workers of one role a topology may ask for (each is a process of its own on the host).
MAX_TOPOLOGY_WORKERS = 4
_TOPOLOGY = re.compile(r"(\d+)p(\d+)d")


def topology_counts(topology: str | None) -> tuple[int, int]:
    """(prefill workers, decode workers) of a `launch.topology` such as "2p1d"; (1, 1) for None. ConfigError
    for anything else, so a typo is refused at `matrix catalog sync` instead of starting the wrong pair."""
    if topology is None:
        return 1, 1
    match = _TOPOLOGY.fullmatch(topology)
    counts = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not all(1 <= n <= MAX_TOPOLOGY_WORKERS for n in counts):
        raise ConfigError(
            f'launch.topology = {topology!r} is not an xPyD topology: write e.g. topology = "1p2d" '
            f"(1 to {MAX_TOPOLOGY_WORKERS} workers per role)"
        )
    return counts


def table_option(where: str, raw: object, defaults: Mapping[str, object]) -> dict[str, Any] | None:
    """A launch key that is `true` (every default) or a table of `defaults`' keys, with the defaults filled in;
    None when left out or false. ConfigError names a value of the wrong kind or an unknown key."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return dict(defaults)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be true or a table with keys {', '.join(defaults)}")
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}; known: {', '.join(defaults)}")
    return {**defaults, **raw}


# `launch.peer_loss`'s keys and their defaults (`check.specs.PeerLossSpec` says what each means).
PEER_LOSS_DEFAULTS: Mapping[str, object] = {
    "roles": ("prefill", "decode"),
    "streams": 4,
    "stream_tokens": 64,
    "bound_s": 10.0,
    "release_timeout_s": 60.0,
    "rejoin_timeout_s": 60.0,
}
_PEER_LOSS_LIMITS = {"streams": (1, 64), "stream_tokens": (2, 4096)}


def peer_loss_options(value: object) -> dict[str, Any] | None:
    """`launch.peer_loss` with its defaults filled in; None when the case leaves it out (or says false).
    ConfigError names the key and the fix, so a typo is refused at `matrix catalog sync`."""
    options = table_option("launch.peer_loss", value, PEER_LOSS_DEFAULTS)
    if options is None:
        return None
    roles = options["roles"]
    if not isinstance(roles, list | tuple) or not roles or not set(roles) <= set(OVERRIDE_ROLES):
        raise ConfigError(f'launch.peer_loss.roles = {roles!r}: write roles = ["prefill", "decode"] (either or both)')
    options["roles"] = tuple(dict.fromkeys(roles))
    for key in ("streams", "stream_tokens"):
        low, high = _PEER_LOSS_LIMITS[key]
        if not isinstance(options[key], int) or isinstance(options[key], bool) or not low <= options[key] <= high:
            raise ConfigError(f"launch.peer_loss.{key} = {options[key]!r}: write an integer from {low} to {high}")
    for key in ("bound_s", "release_timeout_s", "rejoin_timeout_s"):
        seconds = options[key]
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not 0 < seconds <= 3600:
            raise ConfigError(f"launch.peer_loss.{key} = {seconds!r}: write seconds above 0, at most 3600")
        options[key] = float(seconds)
    return options


@dataclass(frozen=True)
class _ServedLaunch(CommonLaunch):
    """Keys of an arm that starts real engine servers."""

    env: Mapping[str, object] | None = _key("env")
    role_env: Mapping[str, Mapping[str, object]] | None = _key("role_env")
    extra_args: tuple[object, ...] | None = _key("args")
    kv_counters: tuple[str, ...] | None = _key("strings")
    max_model_len: int | None = _key("int")
    teardown_grace_s: float | None = _key("number")


@dataclass(frozen=True)
class VllmNativeLaunch(_ServedLaunch):
    cpu: bool | None = _key("bool")
    decode_without_connector: bool | None = _key("bool")
    gpu_memory_utilization: float | None = _key("number")
    orphan_decode: bool | None = _key("bool")
    # vLLM's `--block-size` (tokens per KV block); the prefill and decode of vllm#42895 disagreed on it.
    # vLLM's CPU attention takes multiples of 32 only, so a CPU case is refused another value at sync.
    block_size: int | None = _key("int")
    # NixlConnector's `kv_connector_extra_config.enforce_handshake_compat`: false lets a peer whose NIXL
    # compatibility hash differs (another vLLM version, another KV layout) through the handshake.
    enforce_handshake_compat: bool | None = _key("bool")
    # Per-role overrides of the keys in ROLE_KEYS: `{ decode = { block_size = 64 } }` runs decode with 64
    # and prefill with the case's value (a skew of launch options instead of versions).
    role_launch: Mapping[str, Mapping[str, object]] | None = _key("role_launch")
    # xPyD ([M27]): "2p1d" starts two prefill and one decode `vllm serve` behind matrix's proxy, which routes
    # round robin across them; None is one of each (`topology_counts`).
    topology: str | None = _key("str")
    # [M27] peer loss: true, or a table of `PEER_LOSS_DEFAULTS` keys (`peer_loss_options`).
    peer_loss: object = _key("any")

    ROLE_KEYS: ClassVar[frozenset[str]] = frozenset({"block_size", "enforce_handshake_compat"})


@dataclass(frozen=True)
class SglangNativeLaunch(_ServedLaunch):
    aggregated_servers: bool | None = _key("bool")
    max_running_requests: int | None = _key("int")
    mem_fraction_static: float | None = _key("number")
    attention_backend: str | None = _key("str")
    sampling_backend: str | None = _key("str")
    disable_cuda_graph: bool | None = _key("bool")
    transfer_backend: str | None = _key("str")


@dataclass(frozen=True)
class DynamoLaunch(_ServedLaunch):
    aggregated: bool | None = _key("bool")
    cpu: bool | None = _key("bool")
    response_stream_host: str | None = _key("str")
    script: str | None = _key("str")
    workspace_script: str | None = _key("str")
    speedup_ratio: float | None = _key("number")
    # Dynamo's vLLM sidecar
    gpu_memory_utilization: float | None = _key("number")
    reasoning_parser: str | None = _key("str")
    tool_call_parser: str | None = _key("str")
    # Dynamo's SGLang sidecar (the SGLang server's keys)
    max_running_requests: int | None = _key("int")
    mem_fraction_static: float | None = _key("number")
    attention_backend: str | None = _key("str")
    sampling_backend: str | None = _key("str")
    disable_cuda_graph: bool | None = _key("bool")
    transfer_backend: str | None = _key("str")
    # xPyD ([M27]) on the mocker engine: "2p2d" registers two prefill and two decode mocker workers behind the
    # one frontend; None is one of each (`topology_counts`).
    topology: str | None = _key("str")
    # [M27] peer loss on the mocker engine: true, or a table of `PEER_LOSS_DEFAULTS` keys (`peer_loss_options`).
    peer_loss: object = _key("any")


def _check_dynamo_workers(launch: DynamoLaunch) -> None:
    """A Dynamo topology or peer loss is valid, and asked of the one plan that runs it: the mocker's own
    workers (a launch script starts its own, an aggregated twin has no roles to multiply or kill)."""
    topology_counts(launch.topology)
    asked = [key for key, value in (("topology", launch.topology),
             ("peer_loss", peer_loss_options(launch.peer_loss))) if value is not None]  # fmt: skip
    elsewhere = launch.engine not in (None, "mocker") or launch.aggregated or launch.script or launch.workspace_script
    if asked and elsewhere:
        raise ConfigError(
            f"launch.{asked[0]} runs on the Dynamo arm's mocker workers only: drop it, or use engine = \"mocker\" "
            "without aggregated, script or workspace_script"
        )


def _check_role_launch(arm: str, launch_type: type[CommonLaunch], table: Mapping[str, Any]) -> None:
    """Each role of a `role_launch` table is a side of the pair and each of its keys one the arm lets a role
    override, of the key's own kind."""
    allowed: frozenset[str] = getattr(launch_type, "ROLE_KEYS", frozenset())
    kinds = {spec.name: spec.metadata["kind"] for spec in fields(launch_type)}
    for role, overrides in table.items():
        if role not in OVERRIDE_ROLES:
            raise ConfigError(
                f"launch.role_launch names role {role!r}; the {arm} arm's roles are {', '.join(OVERRIDE_ROLES)}"
            )
        for key, value in overrides.items():
            if key not in allowed:
                known = ", ".join(sorted(allowed)) or "none"
                raise ConfigError(
                    f"launch.role_launch.{role}.{key} cannot be set per role on the {arm} arm; keys a role may "
                    f"override: {known}"
                )
            if not _valid(kinds[key], value):
                what, example = KINDS[kinds[key]]
                raise ConfigError(
                    f"launch.role_launch.{role}.{key} must be {what}, got {value!r}: write {key} = {example}"
                )


def _check_block_sizes(launch: VllmNativeLaunch) -> None:
    """vLLM's CPU attention refuses a block size that is not a multiple of 32; say so at sync, not at start."""
    if not launch.cpu:
        return
    sizes: dict[str, object] = {"block_size": launch.block_size}
    for role, overrides in (launch.role_launch or {}).items():
        sizes[f"role_launch.{role}.block_size"] = overrides.get("block_size")
    for key, size in sizes.items():
        if isinstance(size, int) and (size <= 0 or size % 32):
            raise ConfigError(
                f"launch.{key} = {size}: vLLM on a CPU takes block sizes that are multiples of 32 only; "
                "write 32, 64, 96 or 128"
            )


_Launch = TypeVar("_Launch", bound="CommonLaunch")


def for_role(launch: _Launch, role: str) -> _Launch:
    """`launch` as `role` runs it: its `role_launch` overrides for that role applied (the same table when the
    arm has none or the role has none)."""
    overrides = (getattr(launch, "role_launch", None) or {}).get(role)
    if not overrides:
        return launch
    return replace(launch, **{str(k): v for k, v in overrides.items()})


def keys_of(launch_type: type[CommonLaunch]) -> frozenset[str]:
    return frozenset(f.name for f in fields(launch_type))


def parse_typed(arm: str, launch_type: type[CommonLaunch], launch: Mapping[str, Any]) -> CommonLaunch:
    """`launch` as `arm`'s typed table `launch_type` (its row's, `arm_table.parse_launch`); ConfigError names
    the first key whose value has the wrong kind. Unknown keys are refused before this
    (`options.check_case_options`, with a did-you-mean)."""
    values: dict[str, Any] = {}
    for spec in fields(launch_type):
        if spec.name not in launch:
            continue
        value, kind = launch[spec.name], spec.metadata["kind"]
        if not _valid(kind, value):
            what, example = KINDS[kind]
            raise ConfigError(
                f"launch.{spec.name} must be {what} for the {arm} arm, got {value!r}: write {spec.name} = {example}"
            )
        values[spec.name] = tuple(value) if isinstance(value, list) else value
    if values.get("role_launch"):
        _check_role_launch(arm, launch_type, values["role_launch"])
    parsed = launch_type(**values)
    if isinstance(parsed, VllmNativeLaunch):
        _check_block_sizes(parsed)
        topology_counts(parsed.topology)
        peer_loss_options(parsed.peer_loss)
    if isinstance(parsed, ReferenceLaunch):
        topology_counts(parsed.topology)
        peer_loss_options(parsed.peer_loss)
    if isinstance(parsed, DynamoLaunch):
        _check_dynamo_workers(parsed)
    return parsed


LaunchT = TypeVar("LaunchT", bound=CommonLaunch)


def launch_as(table: CommonLaunch, launch_type: type[LaunchT]) -> LaunchT:
    """`table` as the arm's own type: a case's table is parsed for its arm, so another type is a bug."""
    if not isinstance(table, launch_type):
        raise TypeError(f"a {type(table).__name__} where a {launch_type.__name__} was expected")
    return table


ValueT = TypeVar("ValueT")


def or_default(value: ValueT | None, default: ValueT) -> ValueT:
    """A launch field's value, else the arm's default where it reads it (None: the case left the key out;
    a value given, even an empty one, is the case's)."""
    return default if value is None else value
