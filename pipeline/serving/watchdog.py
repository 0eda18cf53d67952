"""A process group that dies with its driver, even when the driver is killed with SIGKILL.

vLLM servers run in their own process group (so stopping one stops its engine workers too). A driver
that exits normally stops them itself; one that is SIGKILLed cannot, and a leftover server holds its
GPU. So each group gets a watchdog: a small process in a session of its own that polls the driver and,
once the driver is gone, sends the group SIGTERM and then SIGKILL. It exits by itself when the group
is gone. Run as `python -m pipeline.serving.watchdog DRIVER_PID GROUP_ID`.

The watchdog detaches (it forks, and the parent exits), so it is not a child of the driver: a Ray
worker that is cancelled or dies has its direct children killed by Ray, the server's leader among them,
and a watchdog killed with it would leave the engine processes running, each holding GBs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["POLL_S", "GRACE_S", "group_alive", "watch", "start_watched_group"]

POLL_S = 0.5
GRACE_S = 5.0


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (so a reused pid is not mistaken for the driver), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(driver: int, group: int) -> None:
    born = _start_time(driver)
    while group_alive(group):
        if born is None or _start_time(driver) != born:
            for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    return
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and group_alive(group):
                    time.sleep(0.1)
            return
        time.sleep(POLL_S)


def start_watched_group(command: list[str], **popen) -> tuple[subprocess.Popen, int]:
    """Start `command` as the leader of a new process group, and its detached watchdog; returns the
    leader and the watchdog's pid."""
    process = subprocess.Popen(command, start_new_session=True, **popen)
    launcher = subprocess.run([sys.executable, "-m", "pipeline.serving.watchdog", str(os.getpid()), str(process.pid)],
                              start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, check=True)
    return process, int(launcher.stdout)


if __name__ == "__main__":
    if pid := os.fork():  # the launcher says who watches, and exits: the watchdog is nobody's child
        print(pid, flush=True)
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # let go of the launcher's pipe, or its reader waits for this process to end
        os.dup2(null, fd)
    watch(int(sys.argv[1]), int(sys.argv[2]))
