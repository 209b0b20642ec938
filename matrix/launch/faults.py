"""Launch side of the KV fault injector ([M28]): put matrix's vLLM fault plugin into ONE role's engine.

A case (or variant) says `kv_fault = "CLASS"` or `"CLASS:ROLE"` in its launch table; the role defaults to
the side the class acts on (`lost_notification`: prefill, every other class: decode). The plugin is not
installed into the runtime's environment: the cell's directory gets a small site directory holding the
module and a `.dist-info` whose `entry_points.txt` declares the `vllm.general_plugins` entry point, and only
the faulted role's PYTHONPATH names it. `importlib.metadata` finds distributions on every `sys.path` entry,
so vLLM loads the plugin in each process of that engine (engine core and worker included), while the other
role, the oracle's aggregated baseline and every cell without a fault run the environment untouched.

`model_revision` is no plugin class: the faulted role is launched on another revision of the case's model
under the same `--model` name (`revision_model`); matrix writes the injection's event itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from matrix.check.faults import events_path
from matrix.errors import ConfigError
from matrix.kv_faults import LAUNCH_CLASSES, MODEL_REVISION, parse
from matrix.model_files import TINY_RANDOM, WEIGHTS_FILE, ensure_tiny_model
from matrix.paths import staging_path

PLUGIN_MODULE = "matrix_vllm_kv_faults"
PLUGIN_SOURCE = Path(__file__).resolve().parent.parent / "tools" / "vllm_kv_faults" / f"{PLUGIN_MODULE}.py"
DIST = "matrix_vllm_kv_faults-0.1.0.dist-info"
SITE_DIR = "kv-fault-plugin"


def install_site(work_dir: Path) -> Path:
    """A site directory in the cell's directory: the plugin module plus its entry-point metadata."""
    site = work_dir / SITE_DIR
    info = site / DIST
    info.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLUGIN_SOURCE, site / f"{PLUGIN_MODULE}.py")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: matrix-vllm-kv-faults\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nmatrix_kv_faults = {PLUGIN_MODULE}:register\n")
    (info / "top_level.txt").write_text(PLUGIN_MODULE + "\n")
    return site


def role_env(spec: str | None, role: str, work_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables that arm the fault in `role`'s engine (none when the case has no fault or it is the
    other role's). `env` is the role's environment so far: its PYTHONPATH is kept behind the plugin's."""
    if not spec:
        return {}
    fault = parse(spec)
    if fault.role != role or fault.fault in LAUNCH_CLASSES:  # the other role's, `none`, or no plugin's
        return {}
    site = install_site(work_dir)
    inherited = env.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(site) + (f":{inherited}" if inherited else ""),
        "MATRIX_KV_FAULT": fault.fault,
        "MATRIX_KV_FAULT_EVENTS": str(events_path(work_dir)),
    }


def control_env(control: Path, work_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables that load the plugin into an engine shared by several cells: it arms every class and
    reads the one in force from `control` on every transfer (`write_control`), so the cells of a fault
    grid switch the class between them without a new engine. Events go to the engine's `work_dir`."""
    site = install_site(work_dir)
    inherited = env.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(site) + (f":{inherited}" if inherited else ""),
        "MATRIX_KV_FAULT_CONTROL": str(control),
        "MATRIX_KV_FAULT_EVENTS": str(events_path(work_dir)),
    }


def write_control(control: Path, fault: str | None) -> None:
    """Put `fault` (a class, or None: no fault) in force for the engine reading `control`. Replaced whole,
    so the plugin, which reads the file at every transfer, never sees half a name."""
    staged = staging_path(control)
    staged.write_text(fault or "", encoding="utf-8")
    os.replace(staged, control)


# The other revision `model_revision` gives its role: the tiny random model's weights from this seed.
OTHER_REVISION = 1


@dataclass(frozen=True)
class RoleModel:
    """What one worker of a `model_revision` cell loads: `--model NAME`, relative to its own directory `cwd`."""

    name: str
    cwd: Path


def revision_model(
    spec: str | None, worker: str, role: str, model_dir: str | None, python: str, work_dir: Path
) -> RoleModel | None:
    """Each worker's model in a `model_revision` cell (None in any other cell): every worker says the same
    `--model NAME`, relative to a directory of its own in which NAME links to the case's model, or for the
    faulted role to its other revision. vLLM's NIXL handshake hashes the `--model` string, not the weights,
    so a revision under another path is refused there, while the same path holding other weights (another
    host's copy, a checkpoint replaced in place: vllm #55776) passes it; this is that case. The faulted
    worker's injection is written to the cell's events file: both revisions' weight digests, effective when
    they differ. Only the generated random model has a revision matrix can make."""
    if not spec:
        return None
    fault = parse(spec)
    if fault.fault != MODEL_REVISION:
        return None
    if model_dir != TINY_RANDOM:
        raise ConfigError(f"kv_fault {spec!r} needs launch.model_dir = {TINY_RANDOM!r}: matrix makes the other "
                          f"revision of its generated model, not of {model_dir or 'a hub model'!r}")  # fmt: skip
    case_model = ensure_tiny_model(weights_python=python)
    faulted = role == fault.role
    loaded = ensure_tiny_model(weights_python=python, revision=OTHER_REVISION) if faulted else case_model
    root = work_dir / f"model-{worker}"
    root.mkdir(parents=True, exist_ok=True)  # the plan is made before the cell's directory (as install_site)
    link = root / case_model.name
    if not link.is_symlink():
        link.symlink_to(loaded, target_is_directory=True)
    if faulted:
        digests = {name: _digest(path / WEIGHTS_FILE) for name, path in (("case", case_model), ("loaded", loaded))}
        event = {"event": "injected", "class": MODEL_REVISION, "role": role, "request_id": f"{worker} engine",
                 "model": case_model.name, "loaded": loaded.name, "weights_sha256": digests,
                 "effective": digests["case"] != digests["loaded"]}  # fmt: skip
        with events_path(work_dir).open("a", encoding="utf-8") as events:
            events.write(json.dumps(event) + "\n")
    return RoleModel(case_model.name, root)


def _digest(path: Path) -> str:
    with path.open("rb") as weights:
        return hashlib.file_digest(weights, "sha256").hexdigest()
