"""How `make test` shares the suite between its two pytest workers (tests/conftest.py): a module's tests
on one worker, every test marked `ray` on one worker, those first. Checked on a small suite of its own,
run as the Makefile runs the real one."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, cli_env

MODULES = {
    "test_on_ray.py": "pytestmark = pytest.mark.ray\n" + "".join(f"def test_{n}(): record()\n" for n in range(3)),
    "test_partly_on_ray.py": "@pytest.mark.ray\ndef test_on_ray(): record()\ndef test_here(): record()\n",
    "test_slow.py": "pytestmark = pytest.mark.slow\n" + "".join(f"def test_{n}(): record()\n" for n in range(3)),
    "test_fast.py": "".join(f"def test_{n}(): record()\n" for n in range(3)),
}
HEADER = '''import os, time, pytest
def record():
    time.sleep(0.3)
    with open(os.environ["SHARING_LOG"], "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {os.environ['PYTEST_CURRENT_TEST'].split()[0]}\\n")
'''


def test_modules_stay_on_one_worker_and_the_ray_tests_share_one_and_start_first(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems, "
                                       "pytest_xdist_make_scheduler\n")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    ray: x\n    slow: x\n")
    for name, body in MODULES.items():
        (suite / name).write_text(HEADER + body)
    log = tmp_path / "sharing.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--no-loadscope-reorder", str(suite)], cwd=ROOT,
                          env={**cli_env(), "SHARING_LOG": str(log)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [line.split() for line in log.read_text().splitlines()]
    assert len(ran) == 11 and {worker for worker, _ in ran} == {"gw0", "gw1"}

    def workers(picked) -> set[str]:
        return {worker for worker, test in ran if picked(test)}

    def on_ray(test: str) -> bool:
        return "test_on_ray.py" in test or test.endswith("::test_on_ray")

    assert len(workers(on_ray)) == 1
    for name in ("test_partly_on_ray.py::test_here", "test_slow.py", "test_fast.py"):
        assert len(workers(lambda test: name in test)) == 1, name
    first = {worker: test for worker, test in reversed(ran)}  # each worker's first test
    assert on_ray(first[workers(on_ray).pop()])
    assert "test_slow.py" in first[({"gw0", "gw1"} - workers(on_ray)).pop()]  # then the slow module
