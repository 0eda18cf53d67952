"""The local Hub stand-in (tests/support/local_hub.py) against the real huggingface_hub client, over real HTTP.

Publishing is tested against this server, so it must answer the client exactly as the Hub does: LFS uploads,
no-op re-commits, tags, pull requests, auth errors, and a restart on the same data after a kill.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

from tests.support import local_hub

TOKEN = "hf_local_test_token_9f2c4e1a7b"
REPO = "local-user/mxfp4-model"

# The client's own LFS upload (`data=fileobj`) triggers this httpx deprecation; nothing to do with the server.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")



@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Xet, online, a private HF_HOME; huggingface_hub reads these at import time, so patch its constants too."""
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(tmp_path: Path):
    url, stop = local_hub.start_local_hub(tmp_path / "hub", TOKEN)
    yield url
    stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder: a 12 MB binary (LFS), a small JSON and a README with YAML front matter (regular)."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "model.safetensors").write_bytes(os.urandom(12 * 1024 * 1024))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization": "mxfp4"}))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- mxfp4\n---\n# MXFP4 model\n")
    return folder


def requests_log(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/_local/requests") as response:
        return json.load(response)["requests"]


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def stop_process(proc: subprocess.Popen[str], *, kill: bool) -> str:
    """Kill (like a crash) or terminate the server process; returns what it wrote to stdout."""
    if kill:
        proc.kill()
    else:
        proc.terminate()
    proc.wait()
    assert proc.stdout is not None
    with proc.stdout:
        return proc.stdout.read()


def test_publish_round_trip_and_identical_recommit(hub: str, model_dir: Path, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub, token=TOKEN)
    assert api.whoami()["name"] == "local-user"
    repo_url = api.create_repo(REPO, private=True, exist_ok=True)
    assert repo_url.repo_id == REPO
    api.create_repo(REPO, private=True, exist_ok=True)  # 409 swallowed by the client
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo(REPO, exist_ok=False)
    assert exc.value.response.status_code == 409

    first = api.upload_folder(repo_id=REPO, folder_path=model_dir, commit_message="Publish MXFP4")
    assert len(first.oid) == 40 and first.pr_url is None

    # Byte-for-byte round trip.
    snapshot = Path(snapshot_download(REPO, endpoint=hub, token=TOKEN, cache_dir=tmp_path / "cache"))
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (snapshot / name).read_bytes() == (model_dir / name).read_bytes()
    assert (snapshot / ".gitattributes").is_file()  # like the Hub, a new repo starts with one
    single = hf_hub_download(REPO, "config.json", endpoint=hub, token=TOKEN, cache_dir=tmp_path / "cache2")
    assert Path(single).read_bytes() == (model_dir / "config.json").read_bytes()

    # Remote tree: sizes, LFS sha256, git blob ids of regular files.
    tree = {f.path: f for f in api.list_repo_tree(REPO, recursive=True)}
    weights = (model_dir / "model.safetensors").read_bytes()
    assert tree["model.safetensors"].size == len(weights)
    assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256(weights).hexdigest()
    assert tree["model.safetensors"].lfs.size == len(weights)
    config = (model_dir / "config.json").read_bytes()
    assert tree["config.json"].lfs is None and tree["config.json"].blob_id == git_blob_sha1(config)
    assert sorted(api.list_repo_files(REPO)) == [".gitattributes", "README.md", "config.json", "model.safetensors"]

    info = api.model_info(REPO, files_metadata=True)
    assert info.sha == first.oid and info.private is True
    siblings = {s.rfilename: s for s in info.siblings}
    assert siblings["model.safetensors"].lfs.sha256 == hashlib.sha256(weights).hexdigest()
    assert api.model_info(REPO, revision=first.oid).sha == first.oid

    meta = get_hf_file_metadata(hf_hub_url(REPO, "model.safetensors", endpoint=hub), token=TOKEN)
    assert meta.commit_hash == first.oid and meta.etag == hashlib.sha256(weights).hexdigest()
    assert meta.size == len(weights)
    assert api.file_exists(REPO, "config.json") and not api.file_exists(REPO, "missing.json")
    assert api.repo_exists(REPO) and not api.repo_exists("local-user/nope")

    # Same folder again: preupload reports the remote oids, the client drops every unchanged file and makes
    # no commit at all, returning the current head; the LFS object is not sent again either.
    puts_before = [r for r in requests_log(hub) if r["method"] == "PUT"]
    second = api.upload_folder(repo_id=REPO, folder_path=model_dir, commit_message="Publish MXFP4 again")
    assert second.oid == first.oid
    assert [c.commit_id for c in api.list_repo_commits(REPO)][0] == first.oid
    assert [r for r in requests_log(hub) if r["method"] == "PUT"] == puts_before
    log = requests_log(hub)
    assert len(puts_before) == 1 and sum(r["path"].endswith("/commit/main") for r in log) == 1
    assert not any("xet" in r["path"] for r in log)

    # A real change makes a commit whose parent is the previous head; deletions work too.
    third = api.upload_file(path_or_fileobj=b'{"v": 2}', path_in_repo="extra/notes.json", repo_id=REPO)
    fourth = api.delete_file("README.md", repo_id=REPO)
    commits = api.list_repo_commits(REPO)
    assert [c.commit_id for c in commits[:3]] == [fourth.oid, third.oid, first.oid]
    assert commits[-1].title == "initial commit"
    assert "README.md" not in api.list_repo_files(REPO)
    folders = [f.path for f in api.list_repo_tree(REPO) if not hasattr(f, "size")]
    assert folders == ["extra"]
    assert [f.path for f in api.list_repo_tree(REPO, path_in_repo="extra")] == ["extra/notes.json"]
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "README.md", endpoint=hub, token=TOKEN, cache_dir=tmp_path / "cache3")


def test_tags_pull_requests_and_parent_commit(hub: str, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub, token=TOKEN)
    api.create_repo(REPO)
    v1 = api.upload_file(path_or_fileobj=b"one", path_in_repo="weights.txt", repo_id=REPO)

    api.create_tag(REPO, tag="v1", revision=v1.oid)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_tag(REPO, tag="v1")
    assert exc.value.response.status_code == 409
    api.create_tag(REPO, tag="v1", exist_ok=True)

    pr = api.upload_file(path_or_fileobj=b"two", path_in_repo="weights.txt", repo_id=REPO, create_pr=True)
    assert pr.pr_revision == "refs/pr/1" and pr.pr_num == 1
    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert {(t.name, t.target_commit) for t in refs.tags} == {("v1", v1.oid)}
    assert {(b.name, b.target_commit) for b in refs.branches} == {("main", v1.oid)}  # main unchanged
    assert [(p.ref, p.target_commit) for p in refs.pull_requests] == [("refs/pr/1", pr.oid)]

    def read(revision: str) -> bytes:
        path = hf_hub_download(REPO, "weights.txt", revision=revision, endpoint=hub, token=TOKEN,
                               cache_dir=tmp_path / "cache")
        return Path(path).read_bytes()

    assert (read("main"), read("v1"), read("refs/pr/1"), read(pr.oid)) == (b"one", b"one", b"two", b"two")

    # Committing on top of a stale parent is refused; on the current head it goes through.
    with pytest.raises(HfHubHTTPError) as exc:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=REPO, parent_commit=pr.oid)
    assert exc.value.response.status_code == 412
    assert api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=REPO, parent_commit=v1.oid).oid

    api.delete_tag(REPO, tag="v1")
    assert api.list_repo_refs(REPO).tags == []


def test_authentication(hub: str) -> None:
    api = HfApi(endpoint=hub, token=TOKEN)
    api.create_repo(REPO, private=True)
    api.create_repo("local-user/public", private=False)
    api.upload_file(path_or_fileobj=b"hi", path_in_repo="a.txt", repo_id="local-user/public")

    wrong = HfApi(endpoint=hub, token="hf_wrong_token")
    for call in (wrong.whoami, lambda: wrong.create_repo("local-user/other"), lambda: wrong.model_info(REPO)):
        with pytest.raises(HfHubHTTPError) as exc:
            call()
        assert exc.value.response.status_code == 401

    anonymous = HfApi(endpoint=hub, token=False)
    with pytest.raises(RepositoryNotFoundError):
        anonymous.model_info(REPO)  # private: hidden without the token
    assert not anonymous.repo_exists(REPO)
    assert anonymous.list_repo_files("local-user/public") == [".gitattributes", "a.txt"]
    with pytest.raises(HfHubHTTPError) as exc:
        anonymous.upload_file(path_or_fileobj=b"no", path_in_repo="b.txt", repo_id="local-user/public")
    assert exc.value.response.status_code == 401


def test_restart_after_kill_serves_the_same_repos(tmp_path: Path) -> None:
    root = tmp_path / "hub"
    weights = os.urandom(1024 * 1024)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(weights)
    (tmp_path / "model" / "config.json").write_text("{}")
    stderr_path = tmp_path / "server.stderr"

    with stderr_path.open("w") as stderr:
        url, proc = local_hub.start_local_hub_process(root, TOKEN, stderr=stderr)
        try:
            api = HfApi(endpoint=url, token=TOKEN)
            api.create_repo(REPO, private=True)
            commit = api.upload_folder(repo_id=REPO, folder_path=tmp_path / "model")
            api.create_tag(REPO, tag="v1")
        finally:
            stdout = stop_process(proc, kill=True)

        url, proc = local_hub.start_local_hub_process(root, TOKEN, stderr=stderr)
        try:
            api = HfApi(endpoint=url, token=TOKEN)
            assert api.model_info(REPO, revision="v1").sha == commit.oid
            assert [c.commit_id for c in api.list_repo_commits(REPO)][0] == commit.oid
            snapshot = Path(snapshot_download(REPO, endpoint=url, token=TOKEN, cache_dir=tmp_path / "cache"))
            assert (snapshot / "model.safetensors").read_bytes() == weights
            # Publishing the same folder again after the restart is a no-op: the state survived the kill.
            assert api.upload_folder(repo_id=REPO, folder_path=tmp_path / "model").oid == commit.oid
        finally:
            stdout += stop_process(proc, kill=False)

    server_output = stdout + stderr_path.read_text()
    assert "POST /api/models/local-user/mxfp4-model/commit/main 200" in server_output
    assert TOKEN not in server_output and "Authorization" not in server_output
    assert not [p for p in root.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]


def test_an_injected_fault_fires_once_then_the_hub_answers_again(hub):
    request = urllib.request.Request(f"{hub}/_local/faults", method="POST",
                                     data=json.dumps([{"method": "GET", "path": "whoami", "status": 503}]).encode())
    urllib.request.urlopen(request).read()
    client = HfApi(endpoint=hub, token=TOKEN)
    with pytest.raises(HfHubHTTPError) as failed:
        client.whoami()
    assert failed.value.response.status_code == 503
    assert client.whoami()["name"] == "local-user"
    assert [r["status"] for r in requests_log(hub) if "whoami" in r["path"]] == [503, 200]
