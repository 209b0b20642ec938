"""Every socket a cell's processes listen on, by role: evidence of what the cell exposed to the network.

Engines open more than the ports matrix gives them (event-plane publishers, NIXL/UCX side channels), and
some bind every interface or the host's external address: on a shared CI host that is an open door.
Before teardown the runner records, for every process carrying the cell's `MATRIX_CELL_ID`, each TCP
socket in LISTEN and each bound UDP socket (address, port, protocol) under the role of the process matrix
started it from. `matrix.outcome.beyond_loopback` says which of them another host could reach.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from typing import Any

import psutil

__all__ = ["listening_sockets"]


def _role_of(proc: psutil.Process, roots: Mapping[int, str]) -> str:
    """The role of the process matrix started that `proc` is (or descends from); "?" when none."""
    try:
        if proc.pid in roots:
            return roots[proc.pid]
        for parent in proc.parents():
            if parent.pid in roots:
                return roots[parent.pid]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return "?"


def listening_sockets(processes: Iterable[psutil.Process], roles: Mapping[str, int]) -> list[dict[str, Any]]:
    """[{role, proto, address, port}] of every listening TCP and bound UDP socket of `processes`, sorted.

    `roles` maps each role to the pid matrix started it as; a child process counts under its ancestor.
    """
    roots = {pid: role for role, pid in roles.items()}
    found: set[tuple[str, str, str, int]] = set()
    for proc in processes:
        try:
            sockets = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        role = _role_of(proc, roots)
        for sock in sockets:
            if not sock.laddr:
                continue
            tcp = sock.type == socket.SOCK_STREAM
            if (tcp and sock.status != psutil.CONN_LISTEN) or (not tcp and sock.raddr):
                continue  # an outgoing or accepted TCP connection, or a connected UDP socket
            found.add((role, "tcp" if tcp else "udp", str(sock.laddr.ip), int(sock.laddr.port)))
    return [
        {"role": role, "proto": proto, "address": address, "port": port}
        for role, proto, address, port in sorted(found)
    ]
