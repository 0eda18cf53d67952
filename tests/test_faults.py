"""Fault campaigns: `mxspec run` killed with SIGKILL at points spread over its stages, and a full disk.

Every kill is followed by a rerun that must end with the artifacts of a clean run in the same folder,
byte for byte except the fields the schemas declare volatile (`pipeline.run.artifacts.volatile_fields`:
timings, measurements, the Hub's commit id). A kill point names the stage the run starts at (later
stages not done yet, as in a first run) and when to kill: some time after the run announces the
stage, or exactly at a system call, where strace injects the SIGKILL: the run's n-th rename(2) (before
a manifest lands, between a complete stage folder and its rename into place, or between moving the
old folder aside and renaming the new one in), or the n-th write(2) to one file of the stage's
unfinished folder (a checkpoint half written). Publishing is killed against a fresh local Hub each time, with
slow LFS uploads, and once after its commit landed but before the answer came back: the rerun must
not commit again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.run.artifacts import PublishResult, StageManifest, volatile_fields
from pipeline.run.atomic import TMP_MARK
from pipeline.run.layout import MANIFEST, RunLayout
from pipeline.run.runner import read_manifest
from tests.support import local_hub

pytestmark = pytest.mark.slow
TOKEN = "hf_fault_campaign_secret_77d1"
REPO = "local-user/qwen3.5-tiny-faults"
STAGES = ("resolve", "quantize", "pair", "validate", "gate", "publish")
VOLATILE_FILES = {"publish/publish.json": volatile_fields(PublishResult)}


@dataclass(frozen=True)
class KillPoint:
    stage: str  # the run starts with this stage and the later ones not done
    after_s: float | None = None  # kill this long after the run announces the stage ...
    rename: int | None = None  # ... or at the run's n-th rename(2), before it happens
    write: tuple[str, int] | None = None  # ... or at the n-th write(2) to this file of the unfinished stage
    commit_landed: bool = False  # ... or (publish) as soon as the Hub's main branch moved
    force: bool = False  # the stage's earlier output stays, and is replaced (`--force STAGE`)
    alone: bool = False  # only this stage is not done; the later ones are (a deleted checkpoint, say)

    def __str__(self) -> str:
        when = (f"+{self.after_s:g}s" if self.after_s is not None else f"at rename #{self.rename}" if self.rename
                else f"at write #{self.write[1]} to {self.write[0]}" if self.write else "after the commit landed")
        return f"{self.stage} {when}" + (" (replacing)" if self.force else " (alone)" if self.alone else "")


def recipe_text(tiny: Path, mode: str, publish: bool) -> str:
    text = (f'name = "tiny-faults-{mode}"\n[target]\npath = "{tiny / "qwen3.5-tiny"}"\n'
            f'[drafter]\npath = "{tiny / "qwen3.5-tiny-dflash"}"\n'
            f"[quantization]\nmode = '{mode}'\n"
            "[validation]\nworkloads = ['gsm8k']\nbudgets = [4]\nmethods = ['ar', 'dflash']\n"
            "backends = ['reference']\nnum_prompts = 3\nmax_tokens = 8\n"
            "[gate]\nmax_acceptance_length_drop = 1.0\nmax_position_gap = 1.0\non_inconclusive = 'pass'\n")
    return text + (f'[publish]\nrepo_id = "{REPO}"\ntag = "v1"\n' if publish else "")


def normalized(out: Path) -> dict[str, object]:
    """Every artifact of the run: sha256 of its bytes, or for JSON with volatile fields the JSON without them."""
    found: dict[str, object] = {}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if not path.is_file() or rel.startswith(".mxspec/"):
            continue
        if rel in VOLATILE_FILES:
            found[rel] = {k: v for k, v in json.loads(path.read_text()).items() if k not in VOLATILE_FILES[rel]}
        elif path.name == MANIFEST:
            manifest = json.loads(path.read_text())
            stage = manifest["stage"]
            found[rel] = {**{k: v for k, v in manifest.items() if k not in volatile_fields(StageManifest)},
                          "outputs": {k: v for k, v in manifest["outputs"].items() if f"{stage}/{k}" not in VOLATILE_FILES}}
        else:
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


class Hub:
    """The local Hub on one fixed port, restartable on a fresh store (the endpoint, hence the recipe, stays)."""

    def __init__(self, root: Path):
        self.root, self.runs, self.proc = root, 0, None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    def restart(self, upload_delay_s: float = 0.0) -> str:
        self.stop()
        self.runs += 1
        env = {**os.environ, "LOCAL_HUB_UPLOAD_DELAY_S": str(upload_delay_s)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.local_hub", "--root", str(self.root / str(self.runs)),
             "--port", str(self.port)], cwd=local_hub.CHECKOUT, env={**env, "LOCAL_HUB_TOKEN": TOKEN},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert "listening" in self.proc.stdout.readline()
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    def main_commits(self) -> list[str]:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.url, token=TOKEN)
        return [c.commit_id for c in api.list_repo_commits(REPO)] if api.repo_exists(REPO) else []

    def set_faults(self, rules: list[dict]) -> None:
        import urllib.request

        request = urllib.request.Request(f"{self.url}/_local/faults", data=json.dumps(rules).encode(), method="POST")
        urllib.request.urlopen(request, timeout=10).read()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class Campaign:
    """One run folder and recipe: a clean run first (the expected artifacts), then kill-and-rerun points."""

    def __init__(self, mxspec, recipe: Path, out: Path, env: dict[str, str], hub: Hub | None = None,
                 until: str = STAGES[-1]):
        self.mxspec, self.recipe, self.out, self.env, self.hub = mxspec, recipe, out, env, hub
        self.stages = STAGES[: STAGES.index(until) + 1]
        done = mxspec("run", recipe, "--out", out, "--until", until, env=env)
        assert done.returncode == 0, done.stderr
        self.expected = normalized(out)
        self.sizes = {path.relative_to(out).as_posix(): path.stat().st_size for path in out.rglob("*") if path.is_file()}
        self.landed: list[tuple[str, str]] = []  # (kill point, stage the run was in when killed)

    def kill_and_rerun(self, point: KillPoint) -> None:
        later = self.stages[self.stages.index(point.stage):]
        for stage in [] if point.force else later[:1] if point.alone else later:
            shutil.rmtree(self.out / stage, ignore_errors=True)
        if point.stage == "validate" and not point.force:  # and its kept cells: the kill lands while it measures
            shutil.rmtree(RunLayout(self.out).cells, ignore_errors=True)
        if point.stage == "publish":  # a fresh Hub: the upload happens again, slowly enough to be cut
            self.hub.restart(upload_delay_s=1.5)
            if point.commit_landed:  # the commit lands; its answer would come long after the kill
                self.hub.set_faults([{"method": "POST", "path": "/commit/", "answer_after_s": 60}])
        command = [str(self.mxspec.exe), "run", str(self.recipe), "--out", str(self.out), "--until", self.stages[-1]]
        command += ["--force", point.stage] if point.force else []
        if point.rename:
            command = [*kill_at_syscall("rename", point.rename), *command]
        proc = subprocess.Popen(command, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        killed = self._wait_and_kill(proc, point, lines)
        reader.join(timeout=10)  # the run is gone: its last lines are in
        assert killed, f"{point}: the run ended before the kill\n{''.join(lines)[-2000:]}"
        self.landed.append((str(point), _stage_at_the_end(lines)))
        self._check_after_kill(proc, point)
        rerun = self.mxspec("run", self.recipe, "--out", self.out, "--until", self.stages[-1], env=self.env)
        assert rerun.returncode == 0, f"{point}: rerun failed\n{rerun.stderr[-3000:]}"
        if point.alone:  # identical outputs redo nothing after them
            assert all(f"{stage}: up to date (skipped)" in rerun.stderr for stage in self.stages[2:-1]), rerun.stderr
        found = normalized(self.out)
        differ = sorted(k for k in found.keys() | self.expected.keys() if found.get(k) != self.expected.get(k))
        assert not differ, f"{point}: the rerun's artifacts differ from a clean run's: {differ}"
        if point.stage == "publish":
            commits = self.hub.main_commits()
            assert len(commits) == 2, f"{point}: {len(commits) - 1} commits besides the Hub's first"
            assert json.loads((self.out / "publish" / "publish.json").read_text())["revision"] == commits[0]

    def _wait_and_kill(self, proc: subprocess.Popen, point: KillPoint, lines: list[str]) -> bool:
        """Kill the run's process group at the point; False when the run ended first."""
        if point.rename:  # strace kills the run itself at that rename
            return proc.wait(timeout=300) == -signal.SIGKILL
        deadline = time.monotonic() + 300
        announced = f"→ {point.stage}"
        while not any(line.startswith(announced) for line in list(lines)):
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        if point.write:
            return self._kill_at_write(proc, point)
        if point.after_s is not None:
            time.sleep(point.after_s)
        while point.commit_landed and proc.poll() is None and len(self.hub.main_commits()) < 2:
            time.sleep(0.05)
        if proc.poll() is not None:
            return False
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True

    def _kill_at_write(self, proc: subprocess.Popen, point: KillPoint) -> bool:
        """strace, attached once the stage's unfinished folder exists (its name is random), kills the run
        at that write(2), which leaves the file shorter than in the clean run; False when the run ended first."""
        while (unfinished := next(self.out.glob(f".{point.stage}{TMP_MARK}*"), None)) is None:
            if proc.poll() is not None:
                return False
            time.sleep(0.005)
        name, nth = point.write
        tracer = subprocess.Popen([*kill_at_syscall("write", nth), "-p", str(proc.pid), "-P", str(unfinished / name)])
        try:
            if proc.wait(timeout=300) != -signal.SIGKILL:
                return False
        finally:
            tracer.wait(timeout=30)
        cut, clean = (unfinished / name).stat().st_size, self.sizes[f"{point.stage}/{name}"]
        assert cut < clean, f"{point}: {name} has {cut} bytes, as many as the clean run's {clean}: not cut short"
        return True

    def _check_after_kill(self, proc: subprocess.Popen, point: KillPoint) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # nothing of the killed run is left running
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"{point}: processes of the killed run are still alive")
        for stage in STAGES:  # a stage folder is complete (a manifest) or absent: never half-written
            if (self.out / stage).exists():
                assert read_manifest(self.out / stage) is not None, f"{point}: {stage} left without a manifest"


def kill_at_syscall(call: str, nth: int) -> list[str]:
    """strace, tracing the run and its children, SIGKILLs it at its n-th `call` (before the call happens).
    Not --seccomp-bpf: strace 6.1 then injects nothing."""
    return ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={call}", "-e", f"inject={call}:signal=KILL:when={nth}"]


def _stage_at_the_end(lines: list[str]) -> str:
    """The stage a run's output shows it in when it stopped: announced ("→ S") and not done ("✓ S:")."""
    started = [line.split()[1] for line in lines if line.startswith("→ ")]
    finished = {line.split()[1].rstrip(":") for line in lines if line.startswith("✓ ")}
    return next((stage for stage in reversed(started) if stage not in finished), "between stages")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("hubs"))
    hub.restart()
    yield hub
    hub.stop()


def hub_env(hub: Hub, home: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "0", "MXSPEC_HUB_TIMEOUT_S": "120"}


# Kills at a system call wherever the point is a state of the run (a file half written, a rename not
# yet made), so the kill lands there however loaded the machine is; timed kills only where any moment
# of a long stretch will do (validate measuring its cells for about 20 s, uploads of 1.5 s each).
IN_MEMORY_POINTS = [
    # Quark's export has begun (the checkpoint's config is being written, its weights not yet); the
    # rerun quantizes again, to the same bytes, and every later stage stays up to date
    KillPoint("quantize", write=("checkpoint/config.json", 1), alone=True),
    KillPoint("validate", after_s=14),  # while it measures its cells
    KillPoint("gate", rename=1),  # the verdict is written, its manifest not yet in place
    KillPoint("gate", rename=2),  # the stage folder is complete, not yet renamed into place
    KillPoint("gate", rename=3, force=True),  # the old folder moved aside, the new one not yet in
    KillPoint("publish", after_s=0.3),  # creating the repo, listing the remote
    KillPoint("publish", after_s=1.5),  # uploading (LFS uploads take 1.5 s each here)
    KillPoint("publish", commit_landed=True),  # the commit is made, its answer never arrives
    KillPoint("publish", rename=1),  # uploaded and verified, publish.json's manifest not yet in place
    KillPoint("publish", rename=3, force=True),
]
FILE_TO_FILE_POINTS = [
    KillPoint("quantize", write=("checkpoint/model.safetensors", 3)),  # its header and first tensor written
    KillPoint("quantize", write=("mxspec-quantize.json", 1)),  # the checkpoint verified, its summary not written
]


def test_killed_runs_resume_to_the_same_artifacts(mxspec, tiny, hub, tmp_path):
    in_memory = tmp_path / "in_memory.toml"
    in_memory.write_text(recipe_text(tiny, "in_memory", publish=True))
    file_to_file = tmp_path / "file_to_file.toml"
    file_to_file.write_text(recipe_text(tiny, "file_to_file", publish=False))  # quantize only: the rest is as above
    env = hub_env(hub, tmp_path / "hf-home")
    campaigns = [(Campaign(mxspec, in_memory, tmp_path / "in-memory", env, hub), IN_MEMORY_POINTS),
                 (Campaign(mxspec, file_to_file, tmp_path / "file-to-file", env, until="quantize"), FILE_TO_FILE_POINTS)]
    resumed = 0
    for campaign, points in campaigns:
        for point in points:
            campaign.kill_and_rerun(point)
            resumed += 1
    landed = [stage for campaign, _ in campaigns for _, stage in campaign.landed]
    print(f"kill points resumed: {resumed}/{len(IN_MEMORY_POINTS) + len(FILE_TO_FILE_POINTS)}; "
          f"landed in: { {s: landed.count(s) for s in dict.fromkeys(landed)} }")
    assert resumed == len(IN_MEMORY_POINTS) + len(FILE_TO_FILE_POINTS) == 12
    # spread as intended: no kill before the stage it aimed at (a faster machine may finish a stage
    # before a timed kill), and every stage of the campaign hit at least once
    for campaign, points in campaigns:
        for (name, stage), point in zip(campaign.landed, points):
            assert stage in (*STAGES[STAGES.index(point.stage):], "between stages"), (name, stage)
    assert {stage for _, stage in campaigns[0][0].landed} >= {"quantize", "validate", "gate", "publish"}
    assert "quantize" in {stage for _, stage in campaigns[1][0].landed}


# --- a full disk ----------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: room for the resolve stage, not for the quantized checkpoint (about 8 MB)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("mode", ["in_memory", "file_to_file"])
def test_a_full_disk_during_quantize_fails_cleanly(mxspec, tiny, small_disk, tmp_path, mode):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_text(tiny, mode, publish=False))
    out = small_disk / "run"
    full = mxspec("run", recipe, "--out", out)
    assert full.returncode == 3, full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}: no space left on the device while writing stage 'quantize'"), last
    assert "Traceback" not in full.stderr
    assert sorted(p.name for p in out.iterdir()) == [".mxspec", "resolve"]  # no temp folder, nothing half-written
    manifest = read_manifest(out / "resolve")
    for name, digest in manifest.outputs.items():  # the earlier stage is intact
        assert hashlib.sha256((out / "resolve" / name).read_bytes()).hexdigest() == digest
