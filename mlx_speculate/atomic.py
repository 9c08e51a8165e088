"""Atomic writes of folders and files: build beside the destination, rename into place.

A staging folder `.NAME.tmp-XXXX` (and `.NAME.old-XXXX`, where a replaced destination waits to
be deleted) holds a marker naming its writer (host and pid) until the rename. A writer killed
outright (`kill -9`, power loss) leaves it behind: the next write to the same destination
removes such leftovers, but only marked ones whose writer is gone; unmarked folders, live
writers and writers on other hosts (whose pids cannot be checked) are left alone. A reused pid
keeps a leftover: the safe direction.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

MARKER = ".mlx_speculate-writer"


def staging_folder(dst: Path) -> Path:
    """A new empty folder beside `dst`, marked as this process's, with the usual permissions
    (mkdtemp makes it private); dead writers' leftovers for `dst` are removed first."""
    remove_leftovers(dst)
    tmp = _marked_folder(dst, "tmp")
    tmp.chmod(0o777 & ~_umask())
    return tmp


def move_into_place(tmp: Path, dst: Path) -> None:
    """Renames the staging folder `tmp` to `dst`; an existing `dst` is moved aside first and
    removed after, so `dst` is at every moment either the old or the new folder."""
    (tmp / MARKER).unlink(missing_ok=True)
    old = None
    if dst.exists() or dst.is_symlink():
        old = _marked_folder(dst, "old") / "old"
        dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        if old is not None:
            old.rename(dst)
            shutil.rmtree(old.parent, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


def install_file(staged: Path, dst: Path) -> None:
    """Moves the file `staged` (inside a staging folder) to `dst` in one rename and removes
    the staging folder."""
    os.replace(staged, dst)
    shutil.rmtree(staged.parent, ignore_errors=True)


def check_writable(dst: Path) -> None:
    """Fails at once, not after the work, when `dst` cannot be created: an ancestor is a
    file, or the nearest existing folder is not writable (read-only, no permission)."""
    existing = next(p for p in dst.parents if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot create {dst}: {existing} is a file, not a folder")
    try:
        Path(tempfile.mkdtemp(prefix=".mlx_speculate-probe-", dir=existing)).rmdir()
    except OSError as e:
        raise OSError(f"cannot write in {existing}: {e.strerror or e}") from None


def check_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise OSError(f"{folder} has {free / 1e6:.0f} MB free; {needed / 1e6:.0f} MB are needed")


def carry_over(old: Path, new: Path, skip: Sequence[str] = ()) -> None:
    """Copies the entries of `old` that `new` lacks into it, but for names matching `skip`."""
    for entry in old.iterdir():
        if (new / entry.name).exists() or any(fnmatch.fnmatch(entry.name, p) for p in skip):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)


def remove_leftovers(dst: Path) -> list[Path]:
    """Removes the staging folders of `dst` whose writer is gone; returns them. A replaced
    folder still waiting aside goes back into place if `dst` itself is missing."""
    removed = []
    for kind in ("tmp", "old"):
        for folder in sorted(dst.parent.glob(f".{dst.name}.{kind}-*")):
            marker = folder / MARKER
            if not folder.is_dir() or not marker.is_file() or _writer_alive(marker):
                continue
            if kind == "old" and (folder / "old").exists() and not dst.exists():
                (folder / "old").rename(dst)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _marked_folder(dst: Path, kind: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{kind}-", dir=dst.parent))
    writer = {"host": socket.gethostname(), "pid": os.getpid()}
    (folder / MARKER).write_text(json.dumps(writer) + "\n")
    return folder


def _writer_alive(marker: Path) -> bool:
    try:
        writer = json.loads(marker.read_text())
        host, pid = writer["host"], int(writer["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return True  # not a marker we can read: leave the folder alone
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
