"""The database's files are the owner's: checked at start, created private, without a race.

Whoever can write the SQLite file or its side files (`-wal`, `-shm`, `-journal`: SQLite
replays a WAL or a hot journal it finds) decides what Resume runs. With `--db` in a folder
others can write (the system temporary folder, a shared scratch space), another user could
create them first, mode 0666, and rewrite commands. So before SQLite opens anything:

- the folder holding the file must not let others replace files in it (writable by others,
  or by a group other than the user's private one, only with the sticky bit, as /tmp: there
  nobody removes or renames another's file);
- the file, and each side file that exists, must be a regular file owned by this user and
  not writable by group or others; a symlink to it must be this user's own;
- a new file is created 0600 (O_CREAT, then checked by fstat on the same descriptor); the
  WAL and shared-memory files are created here too, 0600 with O_EXCL|O_NOFOLLOW, so that
  there is no moment in which another user could create them before SQLite does. (SQLite
  removes them when its last connection closes; the next start creates them again.)

Anything else is one line naming the file and what is wrong (DatabaseFileError).
The folder of launch logs (`runs.db.launches/`) gets the same treatment: `private_dir`.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

from .errors import DatabaseFileError

CREATED = ("-wal", "-shm")  # created by us before SQLite could
CHECKED = ("-journal",)  # WAL mode never creates it: only checked when present
FIX = "use a --db in a folder only you can write"


def _who(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private(st: os.stat_result, name: str) -> None:
    """A regular file of this user's that only this user can write."""
    if not stat.S_ISREG(st.st_mode):
        raise DatabaseFileError(f"{name}: not a regular file")
    if st.st_uid != os.geteuid():
        raise DatabaseFileError(
            f"{name} is owned by another user, {_who(st.st_uid)}, who could change what the "
            f"dashboard runs: remove it, or {FIX}"
        )
    if st.st_mode & 0o022:
        raise DatabaseFileError(
            f"{name} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
            f"chmod 600 {name}"
        )


def _own_group(gid: int) -> bool:
    """The user's private group (named after the user, no other member): what a umask of
    002 makes every folder writable by, and no one else is in it."""
    try:
        me, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == me and set(group.gr_mem) <= {me}


def check_folder(folder: str) -> None:
    """Others may not replace files in it: not writable by them (its group may write when it
    is the user's private group), or sticky (as /tmp)."""
    st = os.stat(folder)
    others = st.st_mode & 0o002 or (st.st_mode & 0o020 and not _own_group(st.st_gid))
    if others and not st.st_mode & stat.S_ISVTX:
        raise DatabaseFileError(
            f"folder {folder} lets other users replace the database's files (mode "
            f"{stat.S_IMODE(st.st_mode):o}, no sticky bit): {FIX}"
        )


def open_private(path: str) -> int:
    """Open (creating 0600) the database file, checked as above: its descriptor, O_RDWR."""
    try:
        return _open_private(path)
    except OSError as e:
        raise DatabaseFileError(f"--db {path}: cannot open it: {e.strerror}") from None


def _open_private(path: str) -> int:
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        lst = None
    if lst is not None and stat.S_ISLNK(lst.st_mode) and lst.st_uid != os.geteuid():
        raise DatabaseFileError(
            f"--db {path} is a symlink made by another user, {_who(lst.st_uid)}: {FIX}"
        )
    if os.path.isdir(path):
        raise DatabaseFileError(f"--db {path}: is a directory, not a database file")
    check_folder(os.path.dirname(os.path.realpath(path)))
    if lst is not None and stat.S_ISREG(lst.st_mode):
        # before opening: a kernel with protected_regular refuses O_CREAT on another user's
        # file in a sticky folder with a bare EACCES; the fstat below closes the race
        check_private(lst, f"--db {path}")
    # O_NONBLOCK: a FIFO planted in its place must not block the start (fstat refuses it)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        check_private(os.fstat(fd), f"--db {path}")
    except DatabaseFileError:
        os.close(fd)
        raise
    return fd


def prepare_side_files(path: str) -> None:
    """Create the WAL and shared-memory files 0600 if absent, check every side file present
    (opened without following a symlink, checked by fstat)."""
    real = os.path.realpath(path)
    safe = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for suffix in CREATED + CHECKED:
        side = real + suffix
        if suffix in CHECKED:
            if not os.path.lexists(side):
                continue
            fd = _open_existing(side, os.O_RDONLY | safe)
        else:
            try:
                fd = os.open(side, os.O_RDWR | os.O_CREAT | os.O_EXCL | safe, 0o600)
            except FileExistsError:
                fd = _open_existing(side, os.O_RDONLY | safe)
            except OSError as e:
                raise DatabaseFileError(f"{side}: cannot create it: {e.strerror}") from None
        try:
            check_private(os.fstat(fd), side)
        finally:
            os.close(fd)


def _open_existing(side: str, flags: int) -> int:
    try:
        return os.open(side, flags)
    except OSError as e:  # ELOOP: a symlink, which SQLite would follow
        if os.path.islink(side):
            owner = _who(os.lstat(side).st_uid)
            raise DatabaseFileError(f"{side} is a symlink (made by {owner}): {FIX}") from None
        raise DatabaseFileError(f"{side}: cannot open it: {e.strerror}") from None


def private_dir(path: str) -> None:
    """A folder only this user can enter: created 0700; an existing one must be this user's
    (not a symlink) and is made 0700 if it was looser (an earlier release made it 0755)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise DatabaseFileError(f"{path}: cannot create it: {e.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise DatabaseFileError(
            f"{path}: not a folder of this user's ({e.strerror}): remove it, or {FIX}"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise DatabaseFileError(
                f"{path} is owned by another user, {_who(st.st_uid)}, who could read or "
                f"replace the launch logs: remove it, or {FIX}"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
