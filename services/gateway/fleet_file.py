"""The gateway's ``--fleet-file``: the encoder and LM addresses of a fleet whose members come and go on one
host (``epd up``'s autoscaler and its add/remove), read again whenever the file changes.

The file is JSON, ``{"encoders": ["host:port", ...], "lms": ["host:port", ...]}`` (as Prometheus'
``file_sd``: the writer replaces it atomically, by a rename, so a reader never sees half of it). A role the
file lists is that pool's whole set of entries (host names resolve as ``--encoders``/``--lms``' do); a role
it leaves out keeps the command line's. An address that leaves the file leaves the pool (calls in flight on
it go on; ``InstancePool.set_entries``); one that joins it is checked in the same health round and routed
to once admitted. A file that is missing or does not parse keeps the last good set (logged once per
change), so a writer's mistake never empties a fleet.

Owner: ``Fleet`` makes one ``FleetFile`` and hands each pool a reader of its role (``entries``); the pools'
health loops call it once per round, on the gateway's event loop. Nothing here holds the file open.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

ROLES = {"encoder": "encoders", "lm": "lms"}
"""The file's key for each pool's role."""


def write_fleet_file(path: str, encoders: list[str] | None, lms: list[str]) -> None:
    """Replaces ``path`` atomically (a temporary file beside it, then a rename) with this fleet; ``encoders``
    None leaves the key out (no encoder pool: the LMs encode media themselves)."""
    doc: dict[str, list[str]] = {"lms": list(lms)}
    if encoders is not None:
        doc["encoders"] = list(encoders)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FleetFile:
    """Reads ``path`` when its stat (inode, size, mtime) changed since the last read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stat: tuple[int, int, int] | None = None
        self._doc: dict[str, list[str]] = {}
        self._problem = ""
        self.read()

    def read(self) -> dict[str, list[str]]:
        """The last good document (re-read when the file changed)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._complain(f"cannot read it ({e.strerror}); keeping the last fleet")
            return self._doc
        stat = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stat == self._stat:
            return self._doc
        try:
            with open(self.path) as f:
                doc = json.load(f)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            parsed = {}
            for key in ROLES.values():
                if key in doc:
                    if not isinstance(doc[key], list) or not all(isinstance(a, str) for a in doc[key]):
                        raise ValueError(f"{key!r} is not a list of host:port strings")
                    parsed[key] = [a.strip() for a in doc[key] if a.strip()]
        except (OSError, ValueError) as e:
            self._complain(f"does not parse ({e}); keeping the last fleet")
            return self._doc
        self._stat, self._doc, self._problem = stat, parsed, ""
        return self._doc

    def has(self, role: str) -> bool:
        """Whether the file lists ``role`` ("encoder" or "lm")."""
        return ROLES[role] in self.read()

    def entries(self, role: str) -> list[str] | None:
        """``role``'s addresses in the file now; None when the file does not list that role."""
        return self.read().get(ROLES[role])

    def _complain(self, problem: str) -> None:
        if problem != self._problem:
            logger.warning("--fleet-file %s %s", self.path, problem)
            self._problem = problem
