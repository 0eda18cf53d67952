"""Publishing as a Hub job meets it: the real huggingface_hub client over real HTTP against the local
Hub (tests/support/local_hub.py), on a tiny Qwen3.5 run that went through quantize, pair, validate, gate.

Specifies: byte-for-byte round trip, card metadata, idempotency, resume after a kill, refusal of a
failed gate (and --force), dry run, pull requests, several recipes in one job, the drafter never
uploaded, and the token nowhere in output, reports, the card or the run folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, ModelCard, constants, snapshot_download

from pipeline.entrypoints import run_pipeline
from pipeline.hub.upload import publish_plan
from pipeline.recipe import load_recipe
from pipeline.run.hashing import HashCache
from pipeline.stages.publish import plan_publish
from tests.support import local_hub

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]
TOKEN = "hf_publish_test_secret_4b1d9e"
REPO = "local-user/qwen3.5-tiny-mxfp4"



def recipe_text(tiny: Path, repo: str = REPO, gate: str = "") -> str:
    return (f'name = "tiny-publish"\n[target]\npath = "{tiny / "qwen3.5-tiny"}"\n'
            f'[drafter]\npath = "{tiny / "qwen3.5-tiny-dflash"}"\n'
            "[quantization]\nmode = 'in_memory'\n"
            "[validation]\nworkloads = ['gsm8k']\nbudgets = [4]\nmethods = ['ar', 'dflash']\n"
            "backends = ['reference']\nnum_prompts = 3\nmax_tokens = 8\n"
            f"[gate]\nmax_acceptance_length_drop = 1.0\nmax_position_gap = 1.0\non_inconclusive = 'pass'\n{gate}"
            f'[publish]\nrepo_id = "{repo}"\ntag = "v1"\nbase_model = "local-user/qwen3.5-tiny"\n')


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny) -> tuple[Path, Path]:
    """(recipe, run folder) with every stage before publish done."""
    folder = tmp_path_factory.mktemp("publish-run")
    recipe = folder / "recipe.toml"
    recipe.write_text(recipe_text(tiny))
    run_pipeline(load_recipe(recipe), folder / "out", until="gate")
    return recipe, folder / "out"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hub in a subprocess (so tests can kill it); env for the mxspec CLI and the in-test client."""
    url, proc = local_hub.start_local_hub_process(tmp_path / "hub", TOKEN, stderr=subprocess.PIPE)
    env = {"HF_ENDPOINT": url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_OFFLINE": "0"}
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    yield url, env, proc
    proc.kill()
    proc.wait()


def api(url: str) -> HfApi:
    return HfApi(endpoint=url, token=TOKEN)


def commits(url: str, repo: str = REPO) -> list[str]:
    return [c.commit_id for c in api(url).list_repo_commits(repo)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_publish_round_trip_card_and_idempotency(mxspec, run, hub, tmp_path):
    recipe, out = run
    url, env, _ = hub
    first = mxspec("run", recipe, "--out", out, env=env)  # the whole pipeline ends with the gate and the upload
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("up to date (skipped)") == 5 and json.loads((out / "gate" / "verdict.json").read_text())["passed"]
    result = json.loads((out / "publish" / "publish.json").read_text())
    assert result["published"] and result["created_commit"] and result["verified"] == len(result["files"])

    # byte for byte: every local file comes back from the Hub identical
    download = Path(snapshot_download(REPO, endpoint=url, token=TOKEN, cache_dir=tmp_path / "cache"))
    checkpoint = out / "quantize" / "checkpoint"
    for rel, digest in result["files"].items():
        assert sha256(download / rel) == digest, rel
    for path in checkpoint.rglob("*"):
        if path.is_file() and path.name not in ("README.md", ".mxspec-output"):
            assert sha256(download / path.relative_to(checkpoint)) == sha256(path)
    assert not list(download.rglob(".mxspec-output"))  # mxspec's folder mark is bookkeeping, never published
    listed = json.loads((download / "mxspec" / "files.json").read_text())["files"]
    assert set(listed) | {"mxspec/files.json"} == set(result["files"])
    assert (download / "figures" / "acceptance_vs_budget.png").is_file()
    assert (download / "mxspec" / "verdict.json").is_file() and (download / "mxspec" / "pair.json").is_file()

    # the card: Hub metadata conventions, the paired drafter with its hashes, launch commands, versions
    card = ModelCard.load(download / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "local-user/qwen3.5-tiny" and meta["base_model_relation"] == "quantized"
    assert set(meta["tags"]) >= {"mxfp4", "quark", "dflash", "speculative-decoding"}
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    results = meta["model-index"][0]["results"]
    assert results[0]["dataset"]["name"] == "gsm8k" and results[0]["metrics"][0]["type"] == "acceptance_length"
    pair = json.loads((out / "pair" / "pair.json").read_text())
    assert pair["drafter"]["digest"] in card.text and all(sha in card.text for sha in pair["drafter"]["files"].values())
    assert "--speculative-config" in card.text and REPO in card.text and "amd-quark" in card.text
    # the card serves with the drafter's own block, as pair.json does (not the largest validated budget)
    assert f'"num_speculative_tokens": {pair["block_size"] - 1}' in card.text and pair["block_size"] == 16
    assert all(f'"num_speculative_tokens": {pair["block_size"] - 1}' in cmd for cmd in pair["launch_commands"].values())
    assert "## Not measured" in card.text

    # the drafter's bytes are nowhere in the repo
    drafter_shas = set(pair["drafter"]["files"].values())
    remote = api(url).list_repo_tree(REPO, recursive=True)
    assert not drafter_shas & {entry.lfs.sha256 for entry in remote if getattr(entry, "lfs", None)}

    # tag v1 names the published commit; a second publish of the same artifacts makes no commit
    history = commits(url)
    tags = {t.name: t.target_commit for t in api(url).list_repo_refs(REPO).tags}
    assert tags["v1"] == result["revision"] == history[0]
    again = mxspec("publish", f"{recipe}={out}", env=env)
    assert again.returncode == 0, again.stderr
    assert commits(url) == history
    assert not json.loads((out / "publish" / "publish.json").read_text())["created_commit"]
    assert "unchanged" in again.stdout

    # the token is nowhere: CLI output, run folder (reports, card, manifests)
    for text in (first.stdout, first.stderr, again.stdout, again.stderr):
        assert TOKEN not in text
    for path in out.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_publish_resumes_after_a_kill(run, hub, tmp_path):
    recipe, out = run
    url, env, hub_proc = hub
    hub_proc.kill()
    hub_proc.wait()
    # restart the same store with slow LFS uploads, so the publisher is surely mid-upload when killed
    os.environ["LOCAL_HUB_UPLOAD_DELAY_S"] = "3"
    try:
        url, hub_proc = local_hub.start_local_hub_process(tmp_path / "hub", TOKEN, stderr=subprocess.DEVNULL)
    finally:
        del os.environ["LOCAL_HUB_UPLOAD_DELAY_S"]
    env = {**env, "HF_ENDPOINT": url}
    try:
        publisher = subprocess.Popen([str(Path(sys.executable).with_name("mxspec")), "publish", f"{recipe}={out}"],
                                     env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("lfs/objects/batch" in r["path"] for r in _requests(url)):
            time.sleep(0.1)
        assert not any(r["method"] == "PUT" for r in _requests(url)), "no upload may have finished yet"
        time.sleep(0.5)
        os.killpg(publisher.pid, signal.SIGKILL)
        publisher.wait()
        assert commits(url) == commits(url)[-1:], "a killed publish leaves no commit"
        assert not (out / "publish" / "publish.json").exists() or json.loads(
            (out / "publish" / "publish.json").read_text()).get("revision") not in commits(url)
    finally:
        hub_proc.kill()
        hub_proc.wait()
    url, hub_proc = local_hub.start_local_hub_process(tmp_path / "hub", TOKEN)
    try:
        done = subprocess.run([str(Path(sys.executable).with_name("mxspec")), "publish", f"{recipe}={out}"],
                              env={**os.environ, **env, "HF_ENDPOINT": url}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        result = json.loads((out / "publish" / "publish.json").read_text())
        assert result["created_commit"] and len(commits(url)) == 2  # the Hub's initial commit + ours
        assert result["verified"] == len(result["files"])
    finally:
        hub_proc.kill()
        hub_proc.wait()


def _requests(url: str) -> list[dict]:
    """The local Hub's log of answered requests (method, path, status)."""
    with urllib.request.urlopen(f"{url}/_local/requests", timeout=10) as response:
        return json.loads(response.read())["requests"]


def test_a_failed_gate_refuses_to_publish_unless_forced(mxspec, tiny, hub, tmp_path):
    url, env, _ = hub
    # throughput lift required but not measured -> inconclusive; the policy makes that a failure
    strict = tmp_path / "strict.toml"
    strict.write_text(recipe_text(tiny, gate="min_throughput_lift = 0.05\n").replace("on_inconclusive = 'pass'",
                                                                                    "on_inconclusive = 'fail'"))
    strict_out = tmp_path / "strict-out"
    run_pipeline(load_recipe(strict), strict_out, until="gate")
    refused = mxspec("publish", f"{strict}={strict_out}", env=env)
    assert refused.returncode == 1 and "refusing to publish" in refused.stderr and "--force" in refused.stderr
    assert not api(url).repo_exists(REPO)
    forced = mxspec("publish", f"{strict}={strict_out}", "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    result = json.loads((strict_out / "publish" / "publish.json").read_text())
    assert result["forced"] and result["gate_verdict"] == "inconclusive"
    assert "did not pass" in (strict_out / "publish" / "README.md").read_text()


def test_dry_run_changes_nothing_and_pr_leaves_main_alone(mxspec, run, hub):
    recipe, out = run
    url, env, _ = hub
    dry = mxspec("publish", f"{recipe}={out}", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert "would upload" in dry.stdout and "nothing was uploaded" in dry.stdout
    assert not api(url).repo_exists(REPO)
    assert mxspec("publish", f"{recipe}={out}", env=env).returncode == 0
    main_before = commits(url)
    pr = mxspec("publish", f"{recipe}={out}", "--create-pr", env=env)
    assert pr.returncode == 0, pr.stderr
    assert commits(url) == main_before  # nothing changed on main


def test_one_job_publishes_several_recipes_with_a_summary(mxspec, run, hub, tmp_path):
    recipe, out = run
    url, env, _ = hub
    second = tmp_path / "second.toml"
    second.write_text(recipe.read_text().replace(REPO, "local-user/second-copy"))
    job = mxspec("publish", f"{recipe}={out}", f"{second}={out}", env=env)
    assert job.returncode == 0, job.stderr
    assert REPO in job.stdout and "local-user/second-copy" in job.stdout
    assert api(url).repo_exists(REPO) and api(url).repo_exists("local-user/second-copy")


def test_bad_token_and_missing_token_fail_with_one_line(mxspec, run, hub):
    recipe, out = run
    url, env, _ = hub
    wrong = mxspec("publish", f"{recipe}={out}", env={**env, "HF_TOKEN": "hf_wrong_token_zzz"})
    assert wrong.returncode == 3 and "refused the token" in wrong.stderr and "hf_wrong_token_zzz" not in wrong.stderr
    missing = mxspec("publish", f"{recipe}={out}", env={**env, "HF_TOKEN": ""})
    assert missing.returncode == 2 and "HF_TOKEN" in missing.stderr
    assert "Traceback" not in wrong.stderr + missing.stderr


# --- Hub faults ---------------------------------------------------------------------------------

COMMIT, PREUPLOAD, LFS_PUT = r"/commit/", r"/preupload/", r"^/_local/lfs/"
# (name, rules): each fires once (or `times`) on the local Hub; publish must still end verified with one commit.
SURVIVABLE = [
    ("preupload 500", [{"method": "POST", "path": PREUPLOAD, "status": 500}]),
    ("preupload 429 + Retry-After", [{"method": "POST", "path": PREUPLOAD, "status": 429, "retry_after": 1}]),
    ("LFS upload 500", [{"method": "PUT", "path": LFS_PUT, "status": 500}]),
    ("LFS upload 429 + Retry-After", [{"method": "PUT", "path": LFS_PUT, "status": 429, "retry_after": 1}]),
    ("LFS upload dropped mid-body", [{"method": "PUT", "path": LFS_PUT, "drop": True}]),
    ("commit 500", [{"method": "POST", "path": COMMIT, "status": 500}]),
    ("commit 429 + Retry-After", [{"method": "POST", "path": COMMIT, "status": 429, "retry_after": 1}]),
    ("commit dropped", [{"method": "POST", "path": COMMIT, "drop": True}]),
    ("commit lands, answer times out", [{"method": "POST", "path": COMMIT, "answer_after_s": 8}]),
    ("two faults in a row on every step", [{"method": "POST", "path": PREUPLOAD, "status": 503, "times": 2},
                                            {"method": "PUT", "path": LFS_PUT, "status": 502, "times": 2},
                                            {"method": "POST", "path": COMMIT, "status": 500, "times": 2}]),
]


def _set_faults(url: str, rules: list[dict]) -> None:
    request = urllib.request.Request(f"{url}/_local/faults", data=json.dumps(rules).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()


def _faults_left(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/_local/faults", timeout=10) as response:
        return json.loads(response.read())["faults"]


def test_hub_faults_are_retried_without_a_second_commit(mxspec, run, tmp_path, monkeypatch):
    recipe, out = run
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    survived = []
    for i, (name, rules) in enumerate(SURVIVABLE):
        # a fresh Hub each time: LFS objects are shared store-wide, so a second upload of them would be skipped
        url, proc = local_hub.start_local_hub_process(tmp_path / f"hub-{i}", TOKEN, stderr=subprocess.DEVNULL)
        try:
            env = {"HF_ENDPOINT": url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "home"),
                   "HF_HUB_OFFLINE": "0", "MXSPEC_HUB_TIMEOUT_S": "3"}
            _set_faults(url, rules)
            done = mxspec("publish", f"{recipe}={out}", env=env)
            assert _faults_left(url) == [], f"{name}: the fault never fired"
            assert done.returncode == 0, f"{name}: {done.stderr}"
            assert TOKEN not in done.stdout + done.stderr
            assert len(commits(url)) == 2, f"{name}: not exactly one commit besides the Hub's first"
            result = json.loads((out / "publish" / "publish.json").read_text())
            assert result["revision"] == commits(url)[0] and result["verified"] == len(result["files"])
            survived.append(name)
        finally:
            proc.kill()
            proc.wait()
    assert survived == [name for name, _ in SURVIVABLE]


def test_a_hub_that_keeps_failing_ends_in_one_line_and_no_commit(mxspec, run, hub, tmp_path):
    recipe, out = run
    url, env, _ = hub
    job = tmp_path / "down.toml"
    job.write_text(recipe.read_text().replace(REPO, "local-user/down"))
    _set_faults(url, [{"method": "POST", "path": COMMIT, "status": 503, "times": 99}])
    failed = mxspec("publish", f"{job}={out}", env=env)
    assert failed.returncode == 3, failed.stderr
    assert "answered 503" in failed.stderr and "Traceback" not in failed.stderr and TOKEN not in failed.stderr
    assert len(commits(url, "local-user/down")) == 1  # the Hub's own first commit only


def test_a_pull_request_whose_answer_is_lost_is_opened_once(mxspec, run, hub, tmp_path):
    recipe, out = run
    url, env, _ = hub
    _set_faults(url, [{"method": "POST", "path": COMMIT, "answer_after_s": 8}])
    pr = mxspec("publish", f"{recipe}={out}", "--create-pr", env={**env, "MXSPEC_HUB_TIMEOUT_S": "3"})
    assert pr.returncode == 0, pr.stderr
    prs = api(url).list_repo_refs(REPO, include_pull_requests=True).pull_requests
    assert len(prs) == 1 and json.loads((out / "publish" / "publish.json").read_text())["pr_url"].endswith("/1")
    assert _faults_left(url) == [] and len(commits(url)) == 1  # main untouched: the Hub's first commit only


def test_an_unreachable_hub_fails_one_job_and_the_next_still_publishes(mxspec, run, hub, tmp_path):
    recipe, out = run
    url, env, _ = hub
    closed = tmp_path / "closed.toml"  # a port nothing listens on
    closed.write_text(recipe.read_text().replace(REPO, "local-user/nowhere").replace(
        'tag = "v1"', 'tag = "v1"\nendpoint = "http://127.0.0.1:9"'))
    job = mxspec("publish", f"{closed}={out}", f"{recipe}={out}", env=env)
    assert job.returncode == 3, job.stderr
    assert "cannot reach the Hub at http://127.0.0.1:9" in job.stderr and "Traceback" not in job.stderr
    assert api(url).repo_exists(REPO) and len(commits(url)) == 2


def _reshard(checkpoint: Path) -> None:
    """Split model.safetensors into two shards with an index, as an export with a smaller shard size would."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in halves.items():
        save_file({n: tensors[n] for n in members}, checkpoint / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, members in halves.items() for n in members}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (checkpoint / "model.safetensors").unlink()


def remote_tree(url: str, repo: str) -> set[str]:
    return {e.path for e in api(url).list_repo_tree(repo, recursive=True) if getattr(e, "blob_id", None)}


def test_republishing_a_resharded_export_leaves_no_stale_file(run, hub, tmp_path, monkeypatch):
    """The remote repo ends equal to the plan: old shards and index go in the same commit as the new ones.

    The run's quantize stage would redo a checkpoint edited by hand, so the re-sharded copy is planned
    and published through the stage's own two calls (plan_publish, publish_plan)."""
    recipe, out = run
    url, env, _ = hub
    monkeypatch.setenv("HF_ENDPOINT", url)
    repo = "local-user/resharded"
    job = tmp_path / "resharded.toml"
    job.write_text(recipe.read_text().replace(REPO, repo).replace('tag = "v1"\n', ""))
    resharded = tmp_path / "resharded-out"
    shutil.copytree(out, resharded, symlinks=True)
    _reshard(resharded / "quantize" / "checkpoint")
    api(url).create_repo(repo)  # the Hub's first commit holds .gitattributes only

    for step, (run_folder, gone, present) in enumerate(((out, "model-00001-of-00002.safetensors", "model.safetensors"),
                                                       (resharded, "model.safetensors", "model-00002-of-00002.safetensors"),
                                                       (out, "model.safetensors.index.json", "model.safetensors"))):
        before = commits(url, repo)
        card_dir = tmp_path / f"card-{step}"
        card_dir.mkdir()
        plan = plan_publish(load_recipe(job), run_folder, card_dir, HashCache(None))
        result = publish_plan(plan, TOKEN)
        assert len(commits(url, repo)) == len(before) + 1  # additions and deletions in one commit
        tree = remote_tree(url, repo)
        assert tree == set(result.files) | {".gitattributes"}
        assert gone not in tree and present in tree
        assert result.verified == len(plan.files) and (step == 0 or gone in result.deleted)


def test_a_repo_with_files_mxspec_did_not_publish_is_refused(mxspec, run, hub, tmp_path):
    """A stale file mxspec published is deleted; one added by hand is not mxspec's to delete: exit 2."""
    recipe, out = run
    url, env, _ = hub
    first = mxspec("publish", f"{recipe}={out}", env=env)
    assert first.returncode == 0, first.stderr
    api(url).upload_file(path_or_fileobj=b"hand-written notes", path_in_repo="NOTES.md", repo_id=REPO)
    history = commits(url)
    refused = mxspec("publish", f"{recipe}={out}", env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: tiny-publish: {REPO} holds 1 file(s) mxspec did not publish (NOTES.md); remove them on the Hub or set another "
        "[publish] repo_id")
    assert commits(url) == history and "NOTES.md" in remote_tree(url, REPO)


def _listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("case", ["locked", "out-of-date", "absent", "no-repo-id"])
def test_a_dry_run_refuses_exactly_when_the_real_publish_does(mxspec, run, hub, tmp_path, case):
    """Each refusal of `publish --force` against its `--dry-run --force` form: the same exit code and
    the same line, and the run folder's listing as it was (the dry run writes nothing at all)."""
    import fcntl

    recipe, out = run
    _, env, _ = hub
    if case == "out-of-date":  # another validation setting: pair's and validate's fingerprints no longer match
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(run[0].read_text().replace("max_tokens = 8", "max_tokens = 9"))
    elif case == "absent":
        out = tmp_path / "no-run-here"
    elif case == "no-repo-id":
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(run[0].read_text().replace(f'repo_id = "{REPO}"\n', ""))
    lines = {}
    lock = open(out / ".mxspec" / "lock") if case == "locked" else None
    try:
        if lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another mxspec run holds the folder
        for form in (("--force",), ("--dry-run", "--force")):
            before = _listing(out)
            result = mxspec("publish", f"{recipe}={out}", *form, env=env)
            assert result.returncode == 2, (form, result.stdout, result.stderr)
            assert "Traceback" not in result.stderr + result.stdout
            lines[form] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            assert len(lines[form]) == 1, result.stderr
            assert _listing(out) == before, form
    finally:
        if lock:
            lock.close()
    real, dry = lines.values()
    assert real == dry
    expected = {"locked": "is in use by another mxspec run", "out-of-date": "is missing or out of date for this recipe",
                "absent": "holds no mxspec run", "no-repo-id": "repo_id is not set"}[case]
    assert expected in real[0]
