"""Carry a wheelhouse to a GPU host that only takes uploads of a bounded size.

    python tests/gpu/kit.py split WHEELHOUSE CHUNKS_DIR [--chunk-mib 60]
        cut WHEELHOUSE (made by `matrix runtime wheelhouse`, plus any extra wheels in it) into folders
        CHUNKS_DIR/c000, c001... of at most --chunk-mib each; a file larger than that is cut into parts
        NAME.part000, NAME.part001...; index-<CHUNKS_DIR's name>.json (also in the first chunk) lists every
        file with its size and sha256. Several chunk sets (e.g. one per engine version, sent as the device
        time allows) land in one staging folder side by side.
    python tests/gpu/kit.py merge OUT WHEELHOUSE... [--extra DIR]
        here, before `split`: put several wheelhouses (e.g. one per engine family, made by separate
        `matrix runtime wheelhouse --out` commands) into one directory OUT, so that the wheels they share
        (torch, triton, NCCL...) travel once. A file name present in two of them must be the same file
        (size and sha256, else it stops); files are hard-linked where the file system allows. The
        manifests (wheelhouse.json) are merged the way `matrix runtime wheelhouse` adds runtimes to an
        existing --out directory (one target; every runtime's lock and command kept), so the GPU host
        provisions every family from OUT. --extra DIR adds plain wheels without a manifest (matrix's own
        needs the host lacks).
    python tests/gpu/kit.py join STAGING WHEELHOUSE
        on the GPU host, after chunk folders were copied into STAGING: put each file of every complete set
        back together, check its size and sha256 against its index, and write it into WHEELHOUSE.

Upload one chunk folder per call and copy it into one staging folder there; `join` says which files are
still missing, so an interrupted upload is resumed by sending only the chunks it names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

PART = ".part"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split(wheelhouse: Path, chunks: Path, chunk_bytes: int) -> int:
    files = sorted(p for p in wheelhouse.iterdir() if p.is_file())
    index: dict[str, dict[str, object]] = {}
    pieces: list[tuple[str, Path, int, int]] = []  # (name in staging, source, offset, length)
    for path in files:
        size = path.stat().st_size
        index[path.name] = {"size": size, "sha256": _sha256(path), "parts": max(1, -(-size // chunk_bytes))}
        if size <= chunk_bytes:
            pieces.append((path.name, path, 0, size))
        else:
            for number, offset in enumerate(range(0, size, chunk_bytes)):
                pieces.append((f"{path.name}{PART}{number:03d}", path, offset, min(chunk_bytes, size - offset)))
    # First fit, largest first: few chunks, each close to the limit.
    bins: list[list[tuple[str, Path, int, int]]] = []
    loads: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[3]):
        for number, load in enumerate(loads):
            if load + piece[3] <= chunk_bytes:
                bins[number].append(piece)
                loads[number] += piece[3]
                break
        else:
            bins.append([piece])
            loads.append(piece[3])
    shutil.rmtree(chunks, ignore_errors=True)
    chunks.mkdir(parents=True)
    for number, content in enumerate(bins):
        folder = chunks / f"c{number:03d}"
        folder.mkdir()
        for name, source, offset, length in content:
            with source.open("rb") as handle:
                handle.seek(offset)
                (folder / name).write_bytes(handle.read(length))
    index_name = f"index-{chunks.name}.json"
    (chunks / index_name).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    shutil.copy(chunks / index_name, chunks / "c000" / index_name)
    total = sum(loads)
    print(f"{len(files)} files, {total / 2**20:.0f} MiB in {len(bins)} chunks of at most {chunk_bytes / 2**20:.0f} MiB")
    return 0


def join(staging: Path, wheelhouse: Path) -> int:
    index: dict[str, dict[str, int | str]] = {}
    for path in sorted(staging.glob("index-*.json")):
        index.update(json.loads(path.read_text()))
    wheelhouse.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []
    for name, entry in sorted(index.items()):
        target = wheelhouse / name
        if target.is_file() and target.stat().st_size == entry["size"]:
            continue
        count = int(entry["parts"])
        parts = [staging / name] if count == 1 else [staging / f"{name}{PART}{n:03d}" for n in range(count)]
        absent = [p.name for p in parts if not p.is_file()]
        if absent:
            missing += absent
            continue
        with target.open("wb") as out:
            for part in parts:
                with part.open("rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 20)
        if target.stat().st_size != entry["size"] or _sha256(target) != entry["sha256"]:
            target.unlink()
            print(f"checksum mismatch: {name}", file=sys.stderr)
            return 1
        for part in parts:
            part.unlink()
    if missing:
        print(f"{len(missing)} pieces missing: {' '.join(missing)}", file=sys.stderr)
        return 1
    print(f"{len(index)} files complete in {wheelhouse}")
    return 0


def merge(out: Path, wheelhouses: list[Path], extras: list[Path]) -> int:
    from matrix.launch.providers.wheelhouse import MANIFEST_NAME, read_manifest, write_manifest

    out.mkdir(parents=True, exist_ok=True)
    merged = read_manifest(out)
    shared = 0
    for source in [*wheelhouses, *extras]:
        for path in sorted(p for p in source.iterdir() if p.is_file() and p.name != MANIFEST_NAME):
            target = out / path.name
            if target.exists():
                same = target.stat().st_size == path.stat().st_size and _sha256(target) == _sha256(path)
                if not same:
                    print(f"{path.name}: {source} and {out} hold different files of that name", file=sys.stderr)
                    return 1
                shared += 1
                continue
            try:
                target.hardlink_to(path)
            except OSError:
                shutil.copy2(path, target)
    for source in wheelhouses:
        manifest = read_manifest(source)
        if manifest is None:
            print(f"{source} has no {MANIFEST_NAME}", file=sys.stderr)
            return 1
        merged = manifest if merged is None else merged.merged(manifest)
    if merged is not None:
        write_manifest(out, merged)
    files = sum(1 for p in out.iterdir() if p.is_file())
    runtimes = ", ".join(sorted(merged.runtimes)) if merged else "none"
    print(f"{files} files in {out} ({shared} shared, identical); runtimes: {runtimes}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split")
    cut.add_argument("wheelhouse", type=Path)
    cut.add_argument("chunks", type=Path)
    cut.add_argument("--chunk-mib", type=int, default=60)
    union = commands.add_parser("merge")
    union.add_argument("out", type=Path)
    union.add_argument("wheelhouses", type=Path, nargs="+")
    union.add_argument("--extra", type=Path, action="append", default=[])
    glue = commands.add_parser("join")
    glue.add_argument("staging", type=Path)
    glue.add_argument("wheelhouse", type=Path)
    args = parser.parse_args()
    if args.command == "split":
        return split(args.wheelhouse, args.chunks, args.chunk_mib * 2**20)
    if args.command == "merge":
        return merge(args.out, args.wheelhouses, args.extra)
    return join(args.staging, args.wheelhouse)


if __name__ == "__main__":
    sys.exit(main())
