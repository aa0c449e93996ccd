"""Resolving a path a trainer gave: bounded work, never an exception, and a key to find it by.

Any ingester chooses these paths, so resolving one is hostile input: a symlink loop makes
`Path.resolve()` raise, and `os.path.realpath` checks every component of a path even after
one is missing, with each check walking the whole prefix again: a 4 KB path of 2,000
components costs ~8 ms, and the writer used to do that for every stored checkpoint on every
resume. Here a path is resolved component by component with one `lstat` each, stopping at the
first component that does not exist (nothing under it can be a symlink), and at most
MAX_STEPS components (symlink targets included) are looked at. A loop, a path too long or too
deep, a component we may not look at: `None`, which callers treat as "not found".

A checkpoint's key (the hash of its resolved path) is computed once, when its message is
stored, so a resume finds its parent by an indexed lookup instead of a scan.
"""

from __future__ import annotations

import hashlib
import os
import stat

MAX_STEPS = 48  # components looked at (real checkpoint paths have ~10; symlinks add theirs)
MAX_LINKS = 40  # symlinks followed, as the kernel's own limit
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux


def absolute(path: str, cwd: str | None) -> str:
    """`path` with `~` expanded, relative to the trainer's cwd (else the server's)."""
    p = os.path.expanduser(path)
    if not os.path.isabs(p):
        p = os.path.join(cwd or os.getcwd(), p)
    return p


def real_path(path: str, cwd: str | None = None) -> str | None:
    """The absolute, symlink-free form of `path`; None when it cannot be resolved (a loop,
    too long or deep, a NUL byte, a component we may not look at)."""
    try:
        p = absolute(path, cwd)
        if len(p.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES or "\x00" in p:
            return None
        return _walk(p)
    except (OSError, ValueError, RuntimeError):  # EACCES, ENAMETOOLONG, ELOOP, bad text
        return None


def _walk(path: str) -> str | None:
    todo = path.split("/")[::-1]  # a stack: the next component last
    done, steps, links = "/", 0, 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        steps += 1
        if steps > MAX_STEPS:
            return None
        if name == "..":
            done = os.path.dirname(done)
            continue
        nxt = os.path.join(done, name)
        try:
            st = os.lstat(nxt)
        except (FileNotFoundError, NotADirectoryError):  # the rest does not exist: as written
            return os.path.normpath("/".join([nxt, *todo[::-1]]))
        if not stat.S_ISLNK(st.st_mode):
            done = nxt
            continue
        links += 1
        if links > MAX_LINKS:
            return None  # a loop, or a chain no one means
        target = os.readlink(nxt)
        if target.startswith("/"):
            done = "/"
        todo.extend(target.split("/")[::-1])
    return done


def path_key(real: str | None) -> str | None:
    """The index key of a resolved path: fixed size (a 4 KB path does not fit PostgreSQL's
    btree rows), None for a path that did not resolve (it matches nothing)."""
    if real is None:
        return None
    return hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()


def key_of(path: str | None, cwd: str | None) -> str | None:
    """The key of a trainer-given path, resolved now; None if absent or unresolvable."""
    return path_key(real_path(path, cwd)) if path else None


def is_inside(path: str, root: str, cwd: str | None) -> bool:
    """Whether `path` resolves inside `root` (both relative to `cwd`); False if either does
    not resolve."""
    real, base = real_path(path, cwd), real_path(root, cwd)
    if real is None or base is None:
        return False
    return real == base or real.startswith(base.rstrip("/") + "/")
