"""Launch side of the KV fault injector ([M28]): put matrix's vLLM fault plugin into ONE role's engine.

A case (or variant) says `kv_fault = "CLASS"` or `"CLASS:ROLE"` in its launch table; the role defaults to
the side the class acts on (`lost_notification`: prefill, every other class: decode). The plugin is not
installed into the runtime's environment: the cell's directory gets a small site directory holding the
module and a `.dist-info` whose `entry_points.txt` declares the `vllm.general_plugins` entry point, and only
the faulted role's PYTHONPATH names it. `importlib.metadata` finds distributions on every `sys.path` entry,
so vLLM loads the plugin in each process of that engine (engine core and worker included), while the other
role, the oracle's aggregated baseline and every cell without a fault run the environment untouched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from matrix.check.faults import events_path
from matrix.kv_faults import parse
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
    if fault.role != role:  # the other role's fault, or `none` (on no role)
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
