"""A server's process group dies with its driver, even when the driver is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from pipeline.serving.watchdog import group_alive

DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from pipeline.serving.watchdog import start_watched_group
    # a leader with a child of its own, as vLLM's API server has its engine core
    process, _ = start_watched_group([sys.executable, "-c",
        "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"])
    print(process.pid, flush=True)
    time.sleep(300)
""")


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_the_group_is_killed_within_seconds_of_a_sigkilled_driver():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    group = int(driver.stdout.readline())
    assert wait_until(lambda: len(subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
                                  .stdout.split()) == 2, 10), "leader and child must both be running"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert wait_until(lambda: not group_alive(group), 8), "the server group outlived its driver"


def test_the_group_is_killed_when_the_driver_dies_with_its_children():
    """A Ray worker that is cancelled dies with its direct children (the server's leader too), leaving
    the leader's own children: the watchdog, which is nobody's child, still stops them."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    group = int(driver.stdout.readline())
    assert wait_until(lambda: len(subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
                                  .stdout.split()) == 2, 10), "leader and child must both be running"
    children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(driver.pid)], capture_output=True,
                                                    text=True).stdout.split()]
    assert group in children
    for pid in (driver.pid, *children):
        os.kill(pid, signal.SIGKILL)
    driver.wait()
    assert group_alive(group), "the leader's child outlives the leader"
    assert wait_until(lambda: not group_alive(group), 8), "the server group outlived its driver and its children"


def test_a_living_driver_keeps_its_group():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    group = int(driver.stdout.readline())
    try:
        time.sleep(2)
        assert group_alive(group)
    finally:
        os.killpg(group, signal.SIGKILL)
        driver.kill()
        driver.wait()
