"""HAProxy (the Debian package) for tests: the state of its servers, read from its stats socket."""

from __future__ import annotations

import socket
from pathlib import Path


def server_states(stats: Path) -> dict[tuple[str, str], str]:
    """Each (backend, server)'s status ("UP", "DOWN", …), from ``show stat`` on the stats socket ``stats``."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(stats))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    columns = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(columns, line.split(","))) for line in lines[1:] if line]
    return {(row["pxname"], row["svname"]): row["status"] for row in rows if row["svname"] not in ("FRONTEND",
                                                                                                   "BACKEND")}
