"""Atomic writes of folders and files: build beside the destination, rename into place.

A staging folder `.NAME.tmp-XXXX` (and `.NAME.old-XXXX`, where a replaced destination waits to
be deleted) holds a marker naming its writer (host and pid) until the rename. A writer killed
outright (`kill -9`, power loss) leaves it behind: the next write to the same destination
removes such leftovers, but only marked ones whose writer is gone; unmarked folders, live
writers and writers on other hosts (whose pids cannot be checked) are left alone. A reused pid
keeps a leftover: the safe direction.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import fnmatch
import json
import os
import platform
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

MARKER = ".mlx_speculate-writer"


def staging_folder(dst: Path) -> Path:
    """A new empty folder beside `dst`, marked as this process's, with the usual permissions
    (mkdtemp makes it private); dead writers' leftovers for `dst` are removed first."""
    remove_leftovers(dst)
    tmp = _marked_folder(dst, "tmp")
    tmp.chmod(0o777 & ~_umask())
    return tmp


def move_into_place(tmp: Path, dst: Path, replace: bool = True) -> None:
    """Renames the staging folder `tmp` to `dst`; an existing `dst` is moved aside first and
    removed after, so `dst` is at every moment either the old or the new folder. Without
    `replace`, a `dst` that exists by now (another writer's, even an empty folder) is a
    FileExistsError and stays as it is: a check made before the work cannot see a writer that
    finished in the meantime, only the rename itself can."""
    (tmp / MARKER).unlink(missing_ok=True)
    if not replace:
        rename_no_replace(tmp, dst)
        return
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


def rename_no_replace(src: Path, dst: Path) -> None:
    """Renames `src` to `dst` in one step that fails with FileExistsError when `dst` exists:
    `renameat2(RENAME_NOREPLACE)` on Linux, `renamex_np(RENAME_EXCL)` on macOS. Where neither
    is there (another system, a file system without it), an exclusive lock on the parent
    folder around a check and `os.rename` keeps this package's writers apart."""
    done = _native_no_replace(src, dst)
    if done is None:
        with _locked(dst.parent):
            if dst.exists() or dst.is_symlink():
                done = errno.EEXIST
            else:
                os.rename(src, dst)
                done = 0
    if done == errno.EEXIST:
        raise FileExistsError(f"{dst} already exists")
    if done != 0:
        raise OSError(f"cannot rename {src} to {dst}: {os.strerror(done)}")


def _native_no_replace(src: Path, dst: Path) -> int | None:
    """0 once renamed, else the errno; None where no native call can do it."""
    system = platform.system()
    if system not in _NO_REPLACE:
        return None
    name, flag = _NO_REPLACE[system]
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        call = getattr(libc, name)
    except AttributeError:  # an older C library
        return None
    paths = [os.fsencode(src), os.fsencode(dst)]
    if name == "renameat2":
        result = call(_AT_FDCWD, paths[0], _AT_FDCWD, paths[1], ctypes.c_uint(flag))
    else:
        result = call(paths[0], paths[1], ctypes.c_uint(flag))
    if result == 0:
        return 0
    error = ctypes.get_errno()
    return None if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP) else error


_AT_FDCWD = -100
# system -> (C function, its no-replace flag)
_NO_REPLACE = {"Linux": ("renameat2", 1), "Darwin": ("renamex_np", 0x4)}


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


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
