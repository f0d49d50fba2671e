"""The host id: which machine (and boot) a lease holder, state directory or session runs on.

``host_id()`` is ``$REWINDFS_HOST_ID`` when set (``--host-id`` sets it for the process and
its children), else ``<hostname>-<12 hex>`` where the hex is the blake3 of the machine id
(``/etc/machine-id``, systemd's machine-id(5)) and the boot id
(``/proc/sys/kernel/random/boot_id``): stable for one boot of one machine, different after
a reboot (pids are then reused, so a holder of a previous boot is never judged by its pid)
and different between containers of one host that have their own machine ids. A host id
is 1 to 64 characters of ``[A-Za-z0-9._-]`` (it is part of lease holder ids
``host:pid:nonce``); anything else in the variable is a ValueError.
"""

from __future__ import annotations

import functools
import os
import re
import socket

ENV = "REWINDFS_HOST_ID"
_VALID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_host_id(value: str) -> str:
    """Return ``value`` if it is a valid host id, else raise ValueError."""
    if not _VALID.fullmatch(value):
        raise ValueError(f"host id {value!r} is not 1 to 64 characters of [A-Za-z0-9._-]")
    return value


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def _derived() -> str:
    import blake3

    seed = (_read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")) + "/" + \
        _read("/proc/sys/kernel/random/boot_id")
    name = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{name}-{blake3.blake3(seed.encode()).hexdigest()[:12]}"


def host_id() -> str:
    """This process's host id (see the module docstring)."""
    env = os.environ.get(ENV)
    if env:
        return check_host_id(env)
    return _derived()
