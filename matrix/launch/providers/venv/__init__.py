"""The `venv` provider: one virtual environment per recipe, built once and shared by every runner.

Layout under ``<data dir>/envs``::

    <name>/                 a complete environment (its env.json is written before it gets this name)
    <name>.lock             flock()ed while the environment is built or removed
    <name>.failed.json      why the last build failed (cells on the runtime are skipped with it)
    .tmp-<name>-<pid>-<r>/  a build in progress; one whose lock nobody holds is stale (see `prune`)

`<name>` is the start of the sha256 of the recipe's canonical JSON, the interpreter's major.minor, the
platform and the installer, so an edited recipe gets a new environment and an unchanged one is reused.

A build happens in a temporary directory next to its final place and is renamed into place in one
`rename(2)`: a crash at any point leaves no half environment under the final name (`relocate` makes it
correct at its final path first).

Modules, after tox 4's split: `target` (a recipe resolved for this host, its key and place, what a cell
gets), `installer` (the commands of uv or pip, and the user's pip configuration), `build` (the steps),
`relocate`, `provisioning` (build once under the lock, rename into place), `variant` (a variant made from its
base environment by hard links; `provisioning` calls it) and `locks`. What other modules
use is re-exported here.
"""

from matrix.launch.providers.venv.build import HOST_SITE_PTH, STEP_TIMEOUT_S, Builder, Echo, build_env
from matrix.launch.providers.venv.installer import INSTALLER_VARIABLE, Installer, choose_installer, uv_path
from matrix.launch.providers.venv.locks import locked
from matrix.launch.providers.venv.provisioning import (
    HOST_CANNOT_BUILD,
    Provisioned,
    ensure_provisioned,
    provision,
    provision_target,
)
from matrix.launch.providers.venv.relocate import relocate
from matrix.launch.providers.venv.target import (
    INFO_NAME,
    LOG_NAME,
    NAME_LENGTH,
    TMP_PREFIX,
    TRASH_PREFIX,
    HostCannotBuild,
    ProvisionError,
    Target,
    check_recorded,
    complete_info,
    envs_dir,
    host_platform,
    not_provisioned,
    prepare_venv,
    python_version_of,
    read_info,
    discard,
    remove_tree,
    resolve_target,
    targets_of,
    tree_size,
    venv_environment,
)

__all__ = [
    "HOST_CANNOT_BUILD",
    "HOST_SITE_PTH",
    "INFO_NAME",
    "INSTALLER_VARIABLE",
    "LOG_NAME",
    "NAME_LENGTH",
    "STEP_TIMEOUT_S",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "Builder",
    "Echo",
    "HostCannotBuild",
    "Installer",
    "ProvisionError",
    "Provisioned",
    "Target",
    "build_env",
    "check_recorded",
    "choose_installer",
    "complete_info",
    "ensure_provisioned",
    "envs_dir",
    "host_platform",
    "locked",
    "not_provisioned",
    "prepare_venv",
    "provision",
    "provision_target",
    "python_version_of",
    "read_info",
    "relocate",
    "discard",
    "remove_tree",
    "resolve_target",
    "targets_of",
    "tree_size",
    "uv_path",
    "venv_environment",
]
