"""The environment a child process is started with: always an explicit copy.

Why not inherit (``env=None``): on Linux, CPython's ``subprocess`` starts a child with
``vfork()`` when it can (``_posixsubprocess``, Python 3.10+). The child shares the
parent's memory until it has exec'd, and with ``env=None`` it execs with ``execv()``,
which reads the C library's global ``environ`` array. glibc's ``setenv()`` (what every
``os.environ[k] = v`` of a new name calls, from any thread: vLLM and torch do it while an
engine starts) reallocates that array and frees the old one; it is documented MT-Unsafe
(``const:env``). A child that execs in that window hands the kernel a freed array and
exec fails with ``EFAULT`` ("OSError: [Errno 14] Bad address: '.../python'"). Seen
when a reference run was spawned from a worker thread while the main thread started
an engine; ``tests/unit/test_spawn.py`` reproduces it (about half the spawns fail
under a thread that churns the environment).

With an explicit ``env``, ``subprocess`` builds the child's ``envp`` from this dict in
the calling thread's own memory, which that thread keeps alive until the child has
exec'd, so no other thread can free it. The same race in the dlang runtime:
dlang/phobos#10574.

Every product module that starts a process passes ``env=child_env(...)``
(``tests/unit/test_layering.py`` checks it), and so do the tests' spawns from worker threads.
Turning vfork off instead (``subprocess._USE_VFORK = False``) is no answer here: with fork, grpcio's
fork handlers run in the child, whose descriptors ``close_fds`` has closed, and abort it before it
execs (grpc/grpc#43055; seen in the multihost tests' client processes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A snapshot of this process's environment with ``extra`` over it, for ``env=`` of
    ``subprocess.Popen``/``run``. ``list(os.environ)`` copies the keys under the GIL, so a
    concurrent writer cannot change the mapping mid-copy; a variable removed between the
    copy of the keys and the read of its value is skipped."""
    env: dict[str, str] = {}
    for key in list(os.environ):
        value = os.environ.get(key)
        if value is not None:
            env[key] = value
    if extra:
        env.update(extra)
    return env
