"""File operations for the host agent (root) that no other account can redirect.

The agent writes into directories other accounts own: the worker user's /var/lib/geotrain
(checkpoint roots, its run dir), frr's /etc/frr. A name the agent opens, chowns or
replaces there could be a symlink or a swapped directory planted by that account, and
root would follow it. So every path is resolved here from "/" one component at a time
with openat(O_NOFOLLOW), and:
- a symlink is followed only where it sits in a *trusted* directory (owned by root, or by
  the agent's own uid, which is root on hosts and the tester in unit tests, and writable
  by no one else), with every directory above it trusted too: only root could have put
  it there. Anywhere else a symlink is refused;
- a directory that is not trusted may be passed through only by callers that say so
  (making and re-owning the worker's directories, removing them), and then nothing below
  it is followed;
- a file is written to a fresh O_EXCL temp file in its directory's fd, fchown/fchmod'ed
  on that fd and renamed into place; its directory must be trusted (or owned by the
  account that will own the file: frr's /etc/frr);
- chown and chmod act only on fds opened with O_NOFOLLOW, never on names.
Standard library only: stage one (bootstrap) runs on the host's bare python3.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40
"""Symlinks followed in one path (the kernel's own limit)."""


class UnsafePath(Exception):
    """A path the agent refuses to follow as root (one line: path and why)."""


def trusted(st: os.stat_result) -> bool:
    """Owned by root (or by this process's uid) and writable by no one else."""
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _sticky_owned(st: os.stat_result) -> bool:
    """/tmp-like: others may add entries but cannot rename or remove ours."""
    return st.st_uid in (0, os.geteuid()) and bool(st.st_mode & stat.S_ISVTX)


def _who(st: os.stat_result) -> str:
    return f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def open_dir(
    path: Path | str,
    *,
    create: bool = False,
    strict: bool = True,
    made: list[str] | None = None,
) -> int:
    """An O_DIRECTORY fd of `path` (the caller closes it), resolved component by component.

    strict: every directory on the way must be trusted (or a root-owned sticky one, like
    /tmp); otherwise other accounts' directories may be passed through, never a symlink
    below one. create: missing directories are made (mode 0755, owned by this process)
    and appended to `made`."""
    path = Path(path)
    if not path.is_absolute():
        raise UnsafePath(f"{path}: not an absolute path")
    todo = list(path.parts[1:])
    stack: list[tuple[int, Path, bool]] = [(os.open("/", DIR_FLAGS), Path("/"), True)]
    links = 0
    try:
        while todo:
            name = todo.pop(0)
            fd, here, chain_ok = stack[-1]
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            st = os.fstat(fd)
            ok = trusted(st) or _sticky_owned(st)
            if not ok and strict:
                raise UnsafePath(f"{here} is {_who(st)}: another account can change {path}")
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                if made is not None:
                    made.append(str(here / name))
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                lst = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(lst.st_mode):
                    raise UnsafePath(f"{here / name} is not a directory") from None
                if not (chain_ok and trusted(st)):
                    raise UnsafePath(
                        f"{here / name} is a symlink in {here}, which another account can "
                        "write: refusing to follow it as root"
                    ) from None
                links += 1
                if links > MAX_LINKS:
                    raise UnsafePath(f"{path}: too many levels of symbolic links") from None
                target = os.readlink(name, dir_fd=fd)
                todo = [*Path(target).parts, *todo]
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                    todo = todo[1:]  # the leading "/"
                continue
            stack.append((child, here / name, chain_ok and ok))
        fd = stack.pop()[0]
        return fd
    finally:
        for fd, _, _ in stack:
            os.close(fd)


@contextlib.contextmanager
def parent(
    path: Path | str,
    *,
    create: bool = False,
    strict: bool = True,
    made: list[str] | None = None,
) -> Iterator[tuple[int, str]]:
    """(fd of path's directory, path's last component)."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise UnsafePath(f"{path}: names no file")
    fd = open_dir(path.parent, create=create, strict=strict, made=made)
    try:
        yield fd, path.name
    finally:
        os.close(fd)


def lstat_at(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def lstat(path: Path | str, strict: bool = False) -> os.stat_result | None:
    """lstat of `path` resolved safely; None when it (or its directory) is missing."""
    try:
        with parent(path, strict=strict) as (fd, name):
            return lstat_at(fd, name)
    except FileNotFoundError:
        return None


def read_at(fd: int, name: str, where: Path | None = None) -> tuple[bytes, os.stat_result] | None:
    """A regular file's bytes and stat, None when missing; a symlink or anything but a
    regular file is refused (`where`: the path named in errors)."""
    shown = where or name
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{shown} is a symlink: refusing to read through it") from None
        raise
    with os.fdopen(f, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{shown} is not a regular file")
        return fh.read(), st


def read(path: Path | str, strict: bool = True) -> tuple[bytes, os.stat_result] | None:
    try:
        with parent(path, strict=strict) as (fd, name):
            return read_at(fd, name, Path(path))
    except FileNotFoundError:
        return None


def check_dir_for_write(fd: int, where: Path, owner_uid: int | None) -> None:
    """The directory a file is written in must be trusted, or owned by `owner_uid` (the
    account that will own the file, so it gains nothing) and writable by no one else."""
    st = os.fstat(fd)
    if trusted(st):
        return
    if owner_uid is not None and st.st_uid == owner_uid and not st.st_mode & 0o022:
        return
    raise UnsafePath(f"{where} is {_who(st)}: another account could redirect the write")


def write(
    path: Path | str,
    data: bytes,
    mode: int,
    uid: int = 0,
    gid: int = 0,
    *,
    dir_owner: int | None = None,
    made: list[str] | None = None,
) -> None:
    """Replace `path` atomically with `data` (owner uid:gid, `mode`); parents are made when
    missing. `dir_owner`: an account other than root whose directory may hold the file."""
    path = Path(path)
    with parent(path, create=True, made=made) as (fd, name):
        check_dir_for_write(fd, path.parent, dir_owner)
        write_at(fd, name, data, mode, uid, gid)


def write_at(fd: int, name: str, data: bytes, mode: int, uid: int, gid: int) -> None:
    tmp = f".{name}.geotrain-tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=fd)  # a stale one (an interrupted apply); unlink never follows
    f = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd
    )
    try:
        with os.fdopen(f, "wb") as fh:
            fh.write(data)
            if (uid, gid) != (os.geteuid(), os.getegid()):
                os.fchown(fh.fileno(), uid, gid)
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)
        raise


def unlink(path: Path | str) -> None:
    """Remove a file (a symlink itself, never its target); missing is fine."""
    try:
        with parent(path, strict=False) as (fd, name):
            st = lstat_at(fd, name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass


def rmdir(path: Path | str) -> None:
    """Remove an empty directory; missing, non-empty or not a directory is left alone."""
    with contextlib.suppress(OSError), parent(path, strict=False) as (fd, name):
        os.rmdir(name, dir_fd=fd)


def remove_tree(path: Path | str, keep: list[Path] | tuple[Path, ...] = ()) -> None:
    """rm -r `path` without following any symlink, keeping every directory in `keep` (and
    the parents it needs)."""
    path = Path(path)
    if path in keep:
        return
    try:
        with parent(path, strict=False) as (fd, name):
            _remove_at(fd, name, path, keep)
    except (FileNotFoundError, NotADirectoryError):
        pass


def _remove_at(fd: int, name: str, path: Path, keep: list[Path] | tuple[Path, ...]) -> None:
    st = lstat_at(fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=fd)
        return
    if not any(path in k.parents for k in keep):
        shutil.rmtree(name, dir_fd=fd, ignore_errors=True)  # fd-based: follows no link
        return
    child = os.open(name, DIR_FLAGS, dir_fd=fd)
    try:
        for entry in os.listdir(child):
            if path / entry not in keep:
                _remove_at(child, entry, path / entry, keep)
    finally:
        os.close(child)


def copy_into(src_fd: int, src_name: str, src: Path, dest: Path) -> os.stat_result | None:
    """Copy the regular file `src` (its directory's fd and name; read without following
    links) to `dest`, a trusted place; returns its stat, None when it is missing."""
    got = read_at(src_fd, src_name, src)
    if got is None:
        return None
    data, st = got
    write(dest, data, stat.S_IMODE(st.st_mode) & 0o777)
    return st
