"""Checkpoint manifests: what a complete checkpoint holds, so that `--resume` refuses a damaged or partial one.

Every checkpoint folder (`checkpoints/step-N/`) gets `manifest.json` as its last file, just before the folder is
renamed into place: each file's relative path, size and sha256, and the step, engine, world size, ZeRO stage
and rlhfkit version that wrote it. Both engines write it through `seal`; under DeepSpeed every rank hashes its
share of the folder's files (the folder is on a filesystem all ranks share) and rank 0 writes the manifest.

`--resume` checks the checkpoint it loads (`verified_latest`): every file present with its size and sha256
(sizes are free; hashing reads the checkpoint once, shared out over the ranks). A missing, truncated or changed
file is a RunError naming the checkpoint, the file and what is wrong, and the newest earlier checkpoint that
verifies, with the command that points `latest` at it (`rlhfkit checkpoints RUN_DIR --use step-N`). A checkpoint
written before manifests existed loads with a warning line. `rlhfkit checkpoints RUN_DIR` lists and verifies
every checkpoint of a run (`status_rows`) and points `latest` at one (`use_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from pathlib import Path
from typing import Callable, Optional

from rlhfkit import __version__
from rlhfkit.errors import RunError
from rlhfkit.run_files import LATEST_POINTER

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 8 << 20  # bytes read per hashing call

Gather = Callable[[list], list]  # this rank's items -> every rank's (one rank: the identity)


def _one_rank(items: list) -> list:
    return items


# -- writing -------------------------------------------------------------------------------------------------
def checkpoint_files(folder: Path) -> list[str]:
    """The relative paths (posix) of every file under `folder` except the manifest, sorted: the same list on
    every rank of a shared filesystem, so ranks can split it by position."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def describe_file(folder: Path, relative: str, hashes: bool = True) -> dict:
    """{path, size, sha256} of one file; the file is also flushed to disk (fsync), so that what the manifest
    describes is durable before the folder is renamed into place."""
    path = folder / relative
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if hashes:
            for block in iter(lambda: fh.read(CHUNK), b""):
                digest.update(block)
        os.fsync(fh.fileno())
        size = os.fstat(fh.fileno()).st_size
    entry = {"path": relative, "size": size}
    if hashes:
        entry["sha256"] = digest.hexdigest()
    return entry


def seal(folder: Path, info: dict, part: tuple[int, int] = (0, 1), gather: Gather = _one_rank,
         write: bool = True) -> Optional[dict]:
    """Hash this rank's share (`part` = (rank, world size): every world-th file from `rank`) of the files under
    `folder`, gather every rank's entries and, where `write`, write `folder/manifest.json` with `info` (step,
    engine, world_size, zero_stage, ...). Call it after every file of the checkpoint is complete."""
    rank, world = part
    mine = [describe_file(folder, rel) for rel in checkpoint_files(folder)[rank::world]]
    files = sorted(gather(mine), key=lambda e: e["path"])
    if not write:
        return None
    manifest = {"format": FORMAT, "rlhfkit_version": __version__, **info,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    path = folder / MANIFEST
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    return manifest


# -- checking ------------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> Optional[dict]:
    """The manifest of a checkpoint folder; None when it has none (written before manifests existed). A
    manifest that cannot be read is a ValueError saying why."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{MANIFEST}: unreadable ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{MANIFEST}: not a checkpoint manifest (no 'files' list)")
    bad = next((e for e in manifest["files"] if not (isinstance(e, dict) and isinstance(e.get("path"), str)
                                                    and type(e.get("size")) is int)), None)
    if bad is not None:
        raise ValueError(f"{MANIFEST}: not a checkpoint manifest (a 'files' entry without a path and a size: "
                         f"{bad!r:.80})")
    return manifest


def check_files(folder: Path, entries: list[dict], hashes: bool = True) -> list[str]:
    """What is wrong with the files `entries` describe: missing, another size, another sha256 ([] = intact)."""
    problems = []
    for entry in entries:
        path = folder / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']}: missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{entry['path']}: {size} bytes, the manifest says {entry['size']} (truncated or "
                            f"rewritten)" if size < entry["size"] else
                            f"{entry['path']}: {size} bytes, the manifest says {entry['size']}")
            continue
        if hashes and "sha256" in entry:
            digest = describe_file(folder, entry["path"])["sha256"]
            if digest != entry["sha256"]:
                problems.append(f"{entry['path']}: sha256 {digest[:12]}... differs from the manifest's "
                                f"{entry['sha256'][:12]}... (the file changed after it was saved)")
    return problems


def problems_of(folder: Path, hashes: bool = True, part: tuple[int, int] = (0, 1),
                gather: Gather = _one_rank) -> tuple[Optional[dict], list[str]]:
    """(manifest or None, every problem found over all ranks' shares). No manifest is not a problem here."""
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        return None, [str(exc)]
    if manifest is None:
        return None, []
    rank, world = part
    return manifest, sorted(gather(check_files(folder, manifest["files"][rank::world], hashes)))


def step_of(folder: Path) -> Optional[int]:
    name = folder.name.removesuffix(".tmp")
    try:
        return int(name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def checkpoint_folders(folder: Path) -> list[Path]:
    """The complete checkpoint folders (step-N, not step-N.tmp), oldest first."""
    found = [p for p in folder.glob("step-*") if p.is_dir() and not p.name.endswith((".tmp", ".old"))]
    return sorted(found, key=lambda p: (step_of(p) is None, step_of(p) or 0, p.name))


def previous_good(folder: Path, before: Optional[Path], part: tuple[int, int] = (0, 1),
                  gather: Gather = _one_rank) -> Optional[Path]:
    """The newest checkpoint older than `before` (all of them when None) that verifies against its manifest."""
    limit = step_of(before) if before is not None else None
    for candidate in reversed(checkpoint_folders(folder)):
        step = step_of(candidate)
        if candidate == before or (limit is not None and (step is None or step >= limit)):
            continue
        manifest, problems = problems_of(candidate, True, part, gather)
        if manifest is not None and not problems:
            return candidate
    return None


def _how_to_go_back(folder: Path, good: Optional[Path]) -> str:
    if good is None:
        return ("no earlier checkpoint verifies: start the run again without --resume (`rlhfkit checkpoints "
                f"{shlex.quote(str(folder.parent))}` lists them)")
    return (f"the previous good checkpoint is {good.name}: point `latest` at it with `rlhfkit checkpoints "
            f"{shlex.quote(str(folder.parent))} --use {good.name}`, then resume again")


def _incompatible(manifest: dict, expect: dict, any_world_size: bool = False) -> Optional[str]:
    """Why this run cannot load a checkpoint written with another engine, number of ranks or ZeRO stage
    (`any_world_size`: the engine reshards a checkpoint of another number of ranks itself)."""
    keys = ("engine", "zero_stage", "critic_zero_stage") if any_world_size else \
        ("engine", "world_size", "zero_stage", "critic_zero_stage")
    theirs = {k: manifest.get(k) for k in keys if k in manifest}
    if all(theirs[k] == expect.get(k) for k in theirs):
        return None
    same = "engine.backend and engine.zero_stage" if any_world_size else \
        "engine.backend, engine.zero_stage and number of ranks"
    if "critic_zero_stage" in theirs:
        same += " (and the critic's stage, engine.critic_zero_stage)"
    return (f"it was written by {_setup({**manifest, **theirs})} and this run is {_setup(expect)}: resume with "
            f"the same {same}")


def _setup(d: dict) -> str:
    stage = f", ZeRO stage {d['zero_stage']}" if d.get("zero_stage") is not None else ""
    if d.get("critic_zero_stage") is not None:
        stage += f" (critic {d['critic_zero_stage']})"
    return f"the {d.get('engine', '?')} engine on {d.get('world_size', '?')} rank(s){stage}"


def verified_latest(folder: Path, expect: dict, say: Callable[[str], None], part: tuple[int, int] = (0, 1),
                    gather: Gather = _one_rank, any_world_size: bool = False) -> Path:
    """The checkpoint `folder/latest` names, checked against its manifest (sizes and sha256, each rank its
    share of the files): a RunError naming what is wrong and the previous good checkpoint, else its path.
    `expect`: {engine, world_size, zero_stage} of this run; `any_world_size`: accept another world size."""
    pointer = folder / LATEST_POINTER
    if not pointer.is_file():
        raise RunError(f"--resume: no checkpoint in '{folder}' (no 'latest' file)")
    target = folder / pointer.read_text().strip()
    if not target.is_dir():
        good = previous_good(folder, target, part, gather)
        raise RunError(f"--resume: checkpoint '{target}' named by '{pointer}' is missing; "
                       f"{_how_to_go_back(folder, good)}")
    manifest, problems = problems_of(target, True, part, gather)
    if manifest is None and not problems:
        say(f"warning: checkpoint '{target}' has no {MANIFEST} (written by an older rlhfkit): loading it "
            f"unverified")
        return target
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        good = previous_good(folder, target, part, gather)
        raise RunError(f"--resume: checkpoint '{target}' is damaged: {shown}; {_how_to_go_back(folder, good)}")
    why = _incompatible(manifest, expect, any_world_size)
    if why:
        raise RunError(f"--resume: checkpoint '{target}' cannot be loaded by this run: {why}")
    return target


# -- listing and choosing checkpoints (what `rlhfkit checkpoints` shows and does) ---------------------------
def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def status_rows(folder: Path, hashes: bool = True) -> list[dict]:
    """One row per checkpoint folder (and per unfinished step-N.tmp) with its manifest facts and status."""
    rows = []
    for path in checkpoint_folders(folder):
        manifest, problems = problems_of(path, hashes)
        if problems:
            status = "DAMAGED: " + "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else "")
        else:
            status = "OK" if manifest is not None else "unverified (no manifest)"
        m = manifest or {}
        rows.append({"name": path.name, "step": step_of(path), "world_size": m.get("world_size"),
                     "zero_stage": m.get("zero_stage"), "engine": m.get("engine"), "size": _folder_size(path),
                     "ok": not problems, "status": status})
    for path in sorted(folder.glob("step-*.tmp")):
        rows.append({"name": path.name, "step": step_of(path), "world_size": None, "zero_stage": None,
                     "engine": None, "size": _folder_size(path), "ok": True,
                     "status": "incomplete: a save that did not finish (--resume ignores it; the next save "
                               "removes it)"})
    return rows


def _named(folder: Path, name: str) -> Path:
    """`step-00000040`, `40` or a path to the folder -> the checkpoint folder inside `folder`."""
    if name.isdigit():
        return folder / f"step-{int(name):08d}"
    return folder / Path(name).name


def use_checkpoint(folder: Path, name: str) -> str:
    """Point `latest` at a checkpoint that verifies (RunError otherwise); returns the line to print."""
    target = _named(folder, name)
    if not target.is_dir():
        raise RunError(f"no checkpoint '{target.name}' in '{folder}'")
    if target not in checkpoint_folders(folder):  # step-N.tmp (a save that did not finish), step-N.old
        raise RunError(f"'{target.name}' in '{folder}' is not a complete checkpoint (a save that did not finish); "
                       f"choose a step-N folder")
    manifest, problems = problems_of(target)
    if problems:
        raise RunError(f"checkpoint '{target}' is damaged: {'; '.join(problems[:4])}; choose another one")
    pointer = folder / f"{LATEST_POINTER}.tmp"
    pointer.write_text(target.name)
    os.replace(pointer, folder / LATEST_POINTER)
    unverified = "" if manifest is not None else " (it has no manifest: not verified)"
    return f"latest -> {target.name}{unverified}: --resume continues from step {step_of(target)}"
