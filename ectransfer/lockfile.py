"""Files whose owner shows it is alive by holding a lock on them: a shared ``flock`` taken at creation
(``create_held``) and kept until the owner removes the file. The kernel drops the lock when the owner
dies, even by ``kill -9``, so ``sweep`` can remove what a dead owner left: the files of a directory whose
name has a given form and that nobody holds. The lock, not a pid in the name, decides: containers that
share the directory but not a PID namespace must not remove each other's live files.

``sweep`` looks only at regular files, opened without blocking or following links, and skips with a
warning whatever it cannot open, lock or unlink: the directory (/dev/shm) is shared with other users and
containers, and a foreign entry must not stop a service starting.

Used by ``ectransfer.shm`` (the services' segments) and by the gateway's parse helper (the bodies it is
handed as files). Standard library only: the gateway, which loads no torch, imports it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat


def open_regular(path: str, flags: int) -> int:
    """Opens ``path`` without following a link and without blocking (a FIFO would block an O_RDONLY open
    until a writer comes), and only if it is a regular file (what shm_open makes); raises OSError
    otherwise."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_held(path: str, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path`` (0600, ``O_EXCL``), its shared lock taken before anything else (a ``sweep``
    at this moment must see it as alive): the caller owns the returned descriptor and keeps it open for
    as long as the file lives; it removes the file, then closes it."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def owner_alive(path: str, log: logging.Logger) -> bool:
    """Whether someone holds ``path``'s lock; also True for what is not ours to judge (gone, a link, a
    FIFO or anything but a regular file). Raises OSError only when the lock itself cannot be tried
    (``sweep`` then leaves the entry alone)."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return True  # gone already: nothing to do
    except OSError as e:
        log.warning("leaving %s alone: not a regular file (%s)", path, e.strerror or e)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # the owner still holds its lock
    finally:
        os.close(fd)  # closing drops our lock too
    return False


def sweep(directory: str, pattern: re.Pattern, log: logging.Logger, what: str) -> list[str]:
    """Unlinks the files in ``directory`` whose whole name matches ``pattern`` and whose owner no longer
    holds them (it died), and returns their names; ``what`` names them in the log. Never raises OSError:
    an entry it cannot judge or remove (permission denied, a directory, a lock it cannot take) is skipped
    with a warning."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    except OSError as e:
        log.warning("not cleaning orphaned %s: cannot list %s (%s)", what, directory, e.strerror or e)
        return removed
    for name in names:
        if pattern.fullmatch(name) is None:
            continue
        path = os.path.join(directory, name)
        try:
            if owner_alive(path, log):
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue  # another sweep got there first
        except OSError as e:
            log.warning("leaving %s alone: cannot check or remove it (%s)", path, e.strerror or e)
            continue
        removed.append(name)
    if removed:
        log.warning("removed %d orphaned %s: %s", len(removed), what, ", ".join(removed))
    return removed
