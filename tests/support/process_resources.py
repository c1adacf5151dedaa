"""What a set of processes holds: shared-memory segments, unix socket files."""

from __future__ import annotations

from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")


def shm_segments_of(procs: list[psutil.Process]) -> set[str]:
    """/dev/shm entries the processes hold open or mapped."""
    found: set[str] = set()
    for p in procs:
        try:
            paths = [m.path for m in p.memory_maps(grouped=True)]
            paths += [f.path for f in p.open_files()]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found.update(x.split(" (deleted)")[0] for x in paths if x.startswith(str(SHM_DIR) + "/"))
    return found


def unix_socket_files_of(procs: list[psutil.Process]) -> set[str]:
    """Filesystem paths of the unix sockets (ZMQ ipc://) the processes hold."""
    found: set[str] = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="unix")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found.update(c.laddr for c in conns if isinstance(c.laddr, str) and c.laddr.startswith("/"))
    return found
