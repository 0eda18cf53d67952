"""A small stand-in for the Hugging Face Hub that the real `huggingface_hub` client can publish to and download from.

Why: publishing must be testable without huggingface.co, over real HTTP, against a server that can be killed and
restarted on the same data (to test "resume after kill"). It speaks the part of the Hub protocol that `HfApi` uses
for model repos: `create_repo`, `create_commit` / `upload_folder` (preupload, LFS batch + PUT, NDJSON commit,
`create_pr`, `parent_commit`), `model_info`, `list_repo_tree`, `list_repo_refs`, `list_repo_commits`, `create_tag`
/ `delete_tag`, `whoami`, and downloads through `/resolve` (HEAD and GET). Xet is never advertised: clients must
set `HF_HUB_DISABLE_XET=1` before importing huggingface_hub, which reads it at import time.

Layout under --root; every write is atomic (temp file + rename), so a killed server leaves a consistent store:
    objects/<sha256>                          file contents, content-addressed
    repos/<ns>/<name>/repo.json               {"private": ..., "created_at": ...}, written last on creation
    repos/<ns>/<name>/refs.json               {"heads": {name: sha}, "tags": {...}, "prs": {"1": sha}}
    repos/<ns>/<name>/commits/<sha>.json      commit record (parents, whole tree, title, ...); sha = sha1 of the file

The token is never written to disk nor logged: log lines are "METHOD path status", without query strings.

Faults, for tests of the client's retries: POST /_local/faults with a JSON list of rules, each
    {"method": "POST", "path": "<regex on the path>", "times": 1, "action": ...}
where action is one of
    {"status": 500}                        answer this status (and do nothing)
    {"status": 429, "retry_after": 1}      the same, with a Retry-After header
    {"drop": true}                         read part of the request, then close the connection unanswered
    {"answer_after_s": 10}                 do the work (a commit lands), then wait before answering: a timeout
A rule fires on the next `times` matching requests, then is spent. GET /_local/faults lists what is left.

Usage: python tests/support/local_hub.py --root DIR [--host 127.0.0.1] [--port 0] [--token T | env LOCAL_HUB_TOKEN]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 1 << 20
LFS_THRESHOLD = 10_000_000  # the Hub refuses regular (non-LFS) files from about 10 MB on
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".h5", ".npy", ".npz", ".zip")
GITATTRIBUTES = "".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in LFS_SUFFIXES).encode()
SHA256_RE = r"[0-9a-f]{64}"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
API_RE = re.compile(r"^/api/models/([^/]+)/([^/]+)(?:/([^/]+)(?:/([^/]+)(?:/(.+))?)?)?$")
RESOLVE_RE = re.compile(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")
LFS_BATCH_RE = re.compile(r"^/([^/]+)/([^/]+?)\.git/info/lfs/objects/batch$")
LFS_PUT_RE = re.compile(r"^/_local/lfs/([0-9a-f]{64})$")

Entry = dict[str, Any]  # a file in a commit tree: size, sha256, oid (git blob sha1), lfs, [pointer_size]


class HubError(Exception):
    """An error answered the Hub's way: JSON {"error": ...} plus the X-Error-* headers the client maps to exceptions."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.headers = {"X-Error-Message": message.encode("ascii", "replace").decode(),  # headers are latin-1
                        **({"X-Error-Code": code} if code else {}), **(headers or {})}


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: the Hub's `oid` / `blobId`, compared by the client for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_entry(sha256: str, size: int) -> Entry:
    """An LFS file: git stores a pointer, whose blob sha1 is the file's `oid` and whose length is `pointerSize`."""
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    return {"size": size, "sha256": sha256, "oid": git_blob_sha1(pointer), "lfs": True, "pointer_size": len(pointer)}


def upload_mode(path: str, size: int, sample: bytes) -> str:
    """LFS for large files, known binary formats and anything whose first bytes look binary, like the Hub."""
    return "lfs" if size >= LFS_THRESHOLD or path.endswith(LFS_SUFFIXES) or b"\0" in sample else "regular"


def now_iso() -> str:
    """UTC time in the one format the client parses (`%Y-%m-%dT%H:%M:%S.%fZ`)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temp file and rename, so readers and a restarted server never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Store:
    """Repos, commits, refs and objects under one root. `lock` serialises every read-modify-write of refs."""

    def __init__(self, root: Path):
        self.root, self.repos = root, root / "repos"
        self.lock = threading.RLock()
        (root / "objects").mkdir(parents=True, exist_ok=True)

    def meta(self, repo_id: str) -> dict | None:
        path = self.repos / repo_id / "repo.json"
        return json.loads(path.read_bytes()) if path.is_file() else None

    def refs(self, repo_id: str) -> dict[str, dict[str, str]]:
        return json.loads((self.repos / repo_id / "refs.json").read_bytes())

    def write_refs(self, repo_id: str, refs: dict) -> None:
        write_atomic(self.repos / repo_id / "refs.json", json.dumps(refs, indent=1).encode())

    def commit(self, repo_id: str, sha: str) -> dict:
        return json.loads((self.repos / repo_id / "commits" / f"{sha}.json").read_bytes())

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256

    def create_repo(self, repo_id: str, private: bool, author: str) -> bool:
        """Create a repo whose first commit holds `.gitattributes`, as on the Hub; False if it exists."""
        with self.lock:
            if self.meta(repo_id) is not None:
                return False
            tree = {".gitattributes": self.put_regular(GITATTRIBUTES)}
            sha = self.write_commit(repo_id, [], tree, "initial commit", "", author)
            self.write_refs(repo_id, {"heads": {"main": sha}, "tags": {}, "prs": {}})
            meta = {"private": private, "created_at": now_iso()}
            write_atomic(self.repos / repo_id / "repo.json", json.dumps(meta).encode())
            return True

    def write_commit(self, repo_id: str, parents: list[str], tree: dict[str, Entry], title: str, message: str,
                     author: str) -> str:
        """Store a commit record; its id is the sha1 of the stored bytes, so it can be checked from disk."""
        record = {"parents": parents, "tree": tree, "title": title, "message": message, "authors": [author],
                  "date": now_iso()}
        data = json.dumps(record, sort_keys=True).encode()
        sha = hashlib.sha1(data).hexdigest()
        write_atomic(self.repos / repo_id / "commits" / f"{sha}.json", data)
        return sha

    def resolve(self, repo_id: str, revision: str) -> str:
        """Branch, tag, `refs/heads|tags|pr/...` or (abbreviated) commit sha -> full commit sha."""
        refs = self.refs(repo_id)
        for prefix, kind in (("refs/heads/", "heads"), ("refs/tags/", "tags"), ("refs/pr/", "prs"), ("", "heads"),
                             ("", "tags")):
            if revision.startswith(prefix) and revision[len(prefix):] in refs[kind]:
                return refs[kind][revision[len(prefix):]]
        if re.fullmatch(r"[0-9a-f]{7,40}", revision):
            found = [path.stem for path in (self.repos / repo_id / "commits").glob(f"{revision}*.json")]
            if len(found) == 1:
                return found[0]
        raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")

    def put_regular(self, data: bytes) -> Entry:
        sha256 = hashlib.sha256(data).hexdigest()
        if not self.object_path(sha256).is_file():
            write_atomic(self.object_path(sha256), data)
        return {"size": len(data), "sha256": sha256, "oid": git_blob_sha1(data), "lfs": False}

    def put_stream(self, sha256: str, chunks: Iterator[bytes]) -> None:
        """Store an uploaded LFS object, refusing content whose sha256 is not the announced one."""
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=self.root / "objects", prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
            if digest.hexdigest() != sha256:
                raise HubError(400, f"Uploaded content does not match sha256 {sha256}")
            os.replace(tmp, self.object_path(sha256))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def apply(self, tree: dict[str, Entry], operations: list[dict]) -> dict[str, Entry]:
        """Apply the NDJSON operations of a commit (file, lfsFile, deletedFile, deletedFolder) to a copy of `tree`."""
        tree = dict(tree)
        for op in operations:
            key, path = op["key"], str(op["value"]["path"]).strip("/")
            if key == "file":
                tree[path] = self.put_regular(base64.b64decode(op["value"]["content"]))
            elif key == "lfsFile":
                oid = str(op["value"]["oid"])
                if not (re.fullmatch(SHA256_RE, oid) and self.object_path(oid).is_file()):
                    raise HubError(422, f"LFS file {path} was not uploaded (oid {oid})")
                tree[path] = lfs_entry(oid, self.object_path(oid).stat().st_size)
            elif key == "deletedFile" and path in tree:
                del tree[path]
            elif key == "deletedFolder" and (doomed := [p for p in tree if p.startswith(f"{path}/")]):
                for p in doomed:
                    del tree[p]
            elif key in ("deletedFile", "deletedFolder"):
                raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
            else:
                raise HubError(400, f"Unknown commit operation: {key}")
        return tree


def tree_listing(tree: dict[str, Entry], prefix: str, recursive: bool) -> list[dict]:
    """The `/tree` answer: folders then files under `prefix`, direct children only unless `recursive`."""
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    folders: set[str] = set()
    files = []
    for path, entry in sorted(tree.items()):
        if path.startswith(base):
            parts = path[len(base):].split("/")
            depth = len(parts) if recursive else min(2, len(parts))
            folders.update(base + "/".join(parts[:i]) for i in range(1, depth))
            if recursive or len(parts) == 1:
                files.append(file_json(path, entry))
    if base and not files and not folders:
        raise HubError(404, f"Entry not found: {prefix}", code="EntryNotFound")
    listing = []
    for folder in sorted(folders):
        content = "".join(f"{p} {e['oid']}\n" for p, e in sorted(tree.items()) if p.startswith(f"{folder}/"))
        listing.append({"type": "directory", "oid": hashlib.sha1(content.encode()).hexdigest(), "size": 0,
                        "path": folder})
    return listing + files


def file_json(path: str, entry: Entry, *, sibling: bool = False) -> dict:
    """A file as `/tree` lists it, or as a `siblings` item of the model info: same facts, other key names."""
    lfs = {"size": entry["size"], "pointerSize": entry["pointer_size"]} if entry["lfs"] else None
    if sibling:
        out: dict[str, Any] = {"rfilename": path, "size": entry["size"], "blobId": entry["oid"]}
        return {**out, "lfs": {"sha256": entry["sha256"], **lfs}} if lfs else out
    out = {"type": "file", "path": path, "size": entry["size"], "oid": entry["oid"]}
    return {**out, "lfs": {"oid": entry["sha256"], **lfs}} if lfs else out


class _LateAnswer:
    """A response stream whose first write waits: the request's work is done, its answer arrives too late."""

    def __init__(self, stream: IO[bytes], delay_s: float):
        self.stream, self.delay_s = stream, delay_s

    def write(self, data: bytes) -> int:
        if self.delay_s:
            time.sleep(self.delay_s)
            self.delay_s = 0.0
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class LocalHubServer(ThreadingHTTPServer):
    """The HTTP server: the store, the token, the user name, and an in-memory request log for tests."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], root: Path, token: str, user: str = "local-user",
                 log: IO[str] | None = None):
        super().__init__(address, HubHandler)
        self.store, self.token, self.user, self.log = Store(root), token, user, log
        self.upload_key = secrets.token_bytes(32)  # signs LFS upload URLs, which the client PUTs without auth
        self.requests: list[dict[str, Any]] = []
        self.requests_lock = threading.Lock()
        self.faults: list[dict[str, Any]] = []  # rules still to fire, guarded by requests_lock
        self.url = "http://%s:%d" % self.server_address[:2]


class HubHandler(BaseHTTPRequestHandler):
    """One request: `_dispatch` reads the body and checks the token, `_route` picks the endpoint method."""

    server: LocalHubServer
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every answer carries a Content-Length
    query: dict[str, str]
    body: bytes
    authenticated: bool

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        streamed = self.command == "PUT"  # LFS objects are streamed to disk, not read into memory
        closing = {"Connection": "close"} if streamed else {}  # on error its body may be unread: drop the connection
        fault = None if url.path.startswith("/_local/faults") else self._take_fault(url.path)
        try:
            if fault is not None and (fault.get("drop") or "status" in fault):
                return self._inject(fault, url.path)
            self.body = b"" if streamed else b"".join(self._body_chunks())
            self.authenticated = self._check_token()
            handler, args = self._route(url.path)
            if fault is not None:  # answer_after_s: the work is done, the answer comes too late
                self.wfile = _LateAnswer(self.wfile, float(fault["answer_after_s"]))
            handler(*args)
        except HubError as err:
            self._send_json({"error": err.message}, err.status, {**err.headers, **closing})
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as err:
            self._send_json({"error": f"Bad request: {err!r}"}, 400, closing)

    def _take_fault(self, path: str) -> dict[str, Any] | None:
        """The first armed rule matching this request, counted down; None when no fault is due."""
        with self.server.requests_lock:
            for rule in self.server.faults:
                if rule.get("method", self.command) == self.command and re.search(rule["path"], path):
                    rule["times"] = rule.get("times", 1) - 1
                    self.server.faults = [r for r in self.server.faults if r["times"] > 0]
                    return rule
        return None

    def _inject(self, fault: dict[str, Any], path: str) -> None:
        """Answer an error status without doing the work, or drop the connection part-way through the request."""
        if fault.get("drop"):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(min(length // 2, CHUNK))  # mid-upload: some bytes arrived, then the line went dead
            self.close_connection = True
            with self.server.requests_lock:
                self.server.requests.append({"method": self.command, "path": path, "status": 0})
            self.connection.shutdown(2)
            return
        self.close_connection = True  # the request body is left unread
        headers = {"Connection": "close"}
        if "retry_after" in fault:
            headers["Retry-After"] = str(fault["retry_after"])
        self._send_json({"error": f"injected fault: HTTP {fault['status']}"}, int(fault["status"]), headers)

    def _set_faults(self) -> None:
        rules = json.loads(self.body)
        for rule in rules:
            re.compile(rule["path"])
            if not (rule.get("drop") or "status" in rule or "answer_after_s" in rule):
                raise HubError(400, f"Fault without an action: {rule}")
        with self.server.requests_lock:
            self.server.faults = [{**rule, "times": int(rule.get("times", 1))} for rule in rules]
        self._send_json({"faults": len(rules)})

    def _route(self, path: str) -> tuple[Callable[..., None], tuple]:
        method = self.command
        if (path, method) == ("/_local/faults", "POST"):
            return self._set_faults, ()
        if (path, method) == ("/_local/faults", "GET"):
            with self.server.requests_lock:
                return self._send_json, ({"faults": list(self.server.faults)},)
        if (path, method) == ("/api/whoami-v2", "GET"):
            return self._whoami, ()
        if (path, method) == ("/api/repos/create", "POST"):
            return self._create_repo, ()
        if (path, method) == ("/api/validate-yaml", "POST"):  # the client checks README.md front matter first
            return self._send_json, ({"errors": [], "warnings": []},)
        if (path, method) == ("/_local/requests", "GET"):
            with self.server.requests_lock:
                return self._send_json, ({"requests": list(self.server.requests)},)
        if (m := LFS_PUT_RE.match(path)) and method == "PUT":
            return self._lfs_put, (m[1],)
        if (m := RESOLVE_RE.match(path)) and method in ("GET", "HEAD"):
            return self._resolve, (repo_id(m[1], m[2]), unquote(m[3]), unquote(m[4]))
        if (m := LFS_BATCH_RE.match(path)) and method == "POST":
            return self._lfs_batch, (repo_id(m[1], m[2]),)
        routes: dict[tuple[str, str], Callable[..., None]] = {
            ("GET", ""): self._info, ("GET", "revision"): self._info, ("GET", "tree"): self._tree,
            ("GET", "refs"): self._refs, ("GET", "commits"): self._commits, ("POST", "preupload"): self._preupload,
            ("POST", "commit"): self._commit, ("POST", "tag"): self._tag, ("DELETE", "tag"): self._tag,
        }
        if (m := API_RE.match(path)) and (method, m[3] or "") in routes:
            # The client %2F-quotes revisions and tree paths, so each is one segment: unquote after splitting.
            args = [unquote(arg) for arg in m.groups()[3:] if arg is not None]
            return routes[(method, m[3] or "")], (repo_id(m[1], m[2]), *args)
        raise HubError(404, f"Not found: {method} {path}")

    def _body_chunks(self) -> Iterator[bytes]:
        """The request body; the client always sends a Content-Length (file uploads included)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise HubError(411, "Chunked request bodies are not supported: send a Content-Length")
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            if not (chunk := self.rfile.read(min(remaining, CHUNK))):
                raise HubError(400, "Truncated request body")
            remaining -= len(chunk)
            yield chunk

    def _send_head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send_json(self, payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", **(headers or {}), "Content-Length": str(len(data))}
        self._send_head(status, headers)
        if self.command != "HEAD":
            self.wfile.write(data)

    def _base_url(self) -> str:
        """Absolute URLs in answers use the host the client called, as the Hub's do."""
        return f"http://{self.headers.get('Host') or '%s:%d' % self.server.server_address[:2]}"

    def _repo_url(self, repo: str) -> str:
        return f"{self._base_url()}/{repo}"

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Record method, path and status only: never headers (the token) nor query strings (upload signatures)."""
        path = urlsplit(self.path).path if hasattr(self, "path") else "-"
        with self.server.requests_lock:
            self.server.requests.append({"method": self.command, "path": path, "status": int(code)})
        self.log_message("%s %s %s", self.command, path, int(code))

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log.write(f"{format % args}\n")
            self.server.log.flush()

    def _check_token(self) -> bool:
        """True with the server's token, False without any; any other token is refused outright, as on the Hub."""
        if (header := self.headers.get("Authorization")) is None:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.server.token.encode()):
            return True
        raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo: str, write: bool = False) -> dict:
        """The repo's metadata; 401/404 "RepoNotFound" for a missing repo or a private one without the token."""
        meta = self.server.store.meta(repo)
        if meta is None or (meta["private"] and not self.authenticated):
            raise HubError(404 if self.authenticated else 401, "Repository not found", code="RepoNotFound")
        if write and not self.authenticated:
            raise HubError(401, "You must be authenticated to write to this repo")
        return meta

    # -- endpoints -------------------------------------------------------------------------------------------

    def _whoami(self) -> None:
        if not self.authenticated:
            raise HubError(401, "Invalid username or password.")
        user = self.server.user
        self._send_json({"type": "user", "id": user, "name": user, "fullname": user, "orgs": [],
                         "auth": {"type": "access_token", "accessToken": {"displayName": "local", "role": "write"}}})

    def _create_repo(self) -> None:
        if not self.authenticated:
            raise HubError(401, "You must be authenticated to create a repo")
        body = json.loads(self.body)
        if body.get("type", "model") != "model":
            raise HubError(400, "Only model repos are supported")
        repo = repo_id(body.get("organization") or self.server.user, body["name"])
        if self.server.store.create_repo(repo, private=body.get("visibility") == "private", author=self.server.user):
            self._send_json({"url": self._repo_url(repo), "name": repo, "id": repo})
        else:  # the client reads `url` from this answer as well when exist_ok=True
            message = "You already created this model repo"
            self._send_json({"error": message, "url": self._repo_url(repo)}, 409, {"X-Error-Message": message})

    def _info(self, repo: str, revision: str = "main") -> None:
        meta, store = self._repo(repo), self.server.store
        sha = store.resolve(repo, revision)
        commit = store.commit(repo, sha)
        blobs = self.query.get("blobs", "").lower() in ("true", "1")
        siblings = [file_json(path, entry, sibling=True) if blobs else {"rfilename": path}
                    for path, entry in sorted(commit["tree"].items())]
        self._send_json({"id": repo, "author": repo.split("/")[0], "sha": sha, "private": meta["private"],
                         "lastModified": commit["date"], "createdAt": meta["created_at"], "gated": False, "tags": [],
                         "siblings": siblings})

    def _tree(self, repo: str, revision: str, path: str = "") -> None:
        self._repo(repo)
        tree = self.server.store.commit(repo, self.server.store.resolve(repo, revision))["tree"]
        self._send_json(tree_listing(tree, path, self.query.get("recursive", "").lower() in ("true", "1")))

    def _refs(self, repo: str) -> None:
        self._repo(repo)
        refs = self.server.store.refs(repo)

        def listing(kind: str, prefix: str) -> list[dict]:
            return [{"name": n, "ref": f"{prefix}{n}", "targetCommit": s} for n, s in sorted(refs[kind].items())]

        self._send_json({"branches": listing("heads", "refs/heads/"), "converts": [],
                         "tags": listing("tags", "refs/tags/"), "pullRequests": listing("prs", "refs/pr/")})

    def _commits(self, repo: str, revision: str) -> None:
        self._repo(repo)
        store, history = self.server.store, []
        sha: str | None = store.resolve(repo, revision)
        while sha is not None:  # first-parent history, newest first
            commit = store.commit(repo, sha)
            history.append({"id": sha, "title": commit["title"], "message": commit["message"], "date": commit["date"],
                            "authors": [{"user": a} for a in commit["authors"]]})
            sha = commit["parents"][0] if commit["parents"] else None
        self._send_json(history)

    def _preupload(self, repo: str, revision: str) -> None:
        """Regular or LFS per file, with the remote oid of each: the client then leaves out unchanged files, and makes
        no commit at all when nothing changed. No oids for a PR, so that `create_pr=True` always opens one."""
        self._repo(repo, write=True)
        store = self.server.store
        tree = {} if self.query.get("create_pr") == "1" else store.commit(repo, store.resolve(repo, revision))["tree"]
        files = []
        for f in json.loads(self.body)["files"]:
            mode = upload_mode(f["path"], int(f["size"]), base64.b64decode(f.get("sample", "")))
            remote = tree.get(f["path"])
            oid = None if remote is None else remote["sha256"] if mode == "lfs" else remote["oid"]
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send_json({"files": files})

    def _lfs_batch(self, repo: str) -> None:
        """Git LFS batch API, basic transfer: a signed upload URL per object not stored yet (the PUT checks its
        sha256, so no verify step is offered)."""
        self._repo(repo, write=True)
        body = json.loads(self.body)
        if body.get("operation") != "upload":
            raise HubError(400, "Only the LFS upload operation is supported")
        objects = []
        for obj in body["objects"]:
            oid, size = str(obj["oid"]), int(obj["size"])
            if not re.fullmatch(SHA256_RE, oid):
                raise HubError(400, f"Invalid LFS oid: {oid}")
            entry: dict[str, Any] = {"oid": oid, "size": size}
            if not self.server.store.object_path(oid).is_file():
                signature = hmac.new(self.server.upload_key, oid.encode(), "sha256").hexdigest()
                entry["actions"] = {"upload": {"href": f"{self._base_url()}/_local/lfs/{oid}?signature={signature}"}}
            objects.append(entry)
        self._send_json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                        headers={"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, oid: str) -> None:
        expected = hmac.new(self.server.upload_key, oid.encode(), "sha256").hexdigest()
        if not hmac.compare_digest(self.query.get("signature", ""), expected):
            raise HubError(403, "Invalid upload signature")
        if delay := float(os.environ.get("LOCAL_HUB_UPLOAD_DELAY_S", "0")):  # lets tests kill a publisher mid-upload
            time.sleep(delay)
        self.server.store.put_stream(oid, self._body_chunks())
        self._send_json({}, headers={"ETag": f'"{oid}"'})

    def _commit(self, repo: str, revision: str) -> None:
        """An NDJSON commit onto a branch or an open PR (`refs/pr/N`), or onto a new PR with `create_pr=1`.
        With `parentCommit`, a branch commit is refused (412) unless the branch still points there."""
        self._repo(repo, write=True)
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header = next((line["value"] for line in lines if line["key"] == "header"), None)
        if header is None:
            raise HubError(400, "Missing commit header")
        parent, create_pr = header.get("parentCommit"), self.query.get("create_pr") == "1"
        store = self.server.store
        with store.lock:
            refs = store.refs(repo)
            if create_pr:
                kind, name = "prs", str(max(map(int, refs["prs"]), default=0) + 1)
                base = store.resolve(repo, parent or revision)
            else:
                kind, name = writable_ref(refs, revision)
                base = refs[kind][name]
                if parent and not base.startswith(parent.lower()):
                    raise HubError(412, f"Parent commit {parent} is not the head of {revision} ({base})")
            tree = store.apply(store.commit(repo, base)["tree"], [line for line in lines if line["key"] != "header"])
            sha = store.write_commit(repo, [base], tree, header.get("summary") or "Commit",
                                     header.get("description") or "", self.server.user)
            refs[kind][name] = sha
            store.write_refs(repo, refs)
        url = self._repo_url(repo)
        self._send_json({"success": True, "commitOid": sha, "commitUrl": f"{url}/commit/{sha}", "hookOutput": "",
                         "pullRequestUrl": f"{url}/discussions/{name}" if create_pr else None})

    def _tag(self, repo: str, revision_or_tag: str) -> None:
        """POST .../tag/{revision} {"tag": name} creates a tag (409 if it exists); DELETE .../tag/{name} drops one."""
        self._repo(repo, write=True)
        store = self.server.store
        with store.lock:
            refs = store.refs(repo)
            if self.command == "DELETE" and refs["tags"].pop(revision_or_tag, None) is None:
                raise HubError(404, f"Tag {revision_or_tag} not found", code="RevisionNotFound")
            if self.command == "POST":
                if (tag := str(json.loads(self.body)["tag"])) in refs["tags"]:
                    raise HubError(409, f"Tag {tag} already exists")
                refs["tags"][tag] = store.resolve(repo, revision_or_tag)
            store.write_refs(repo, refs)
        self._send_json({})

    def _resolve(self, repo: str, revision: str, path: str) -> None:
        """A file, with the headers `hf_hub_download` relies on. Range is ignored: on a 200 the client restarts
        an interrupted download from scratch."""
        self._repo(repo)
        store = self.server.store
        sha = store.resolve(repo, revision)
        entry = store.commit(repo, sha)["tree"].get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", headers={"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["sha256"] if entry["lfs"] else entry["oid"]}"',
                   "Content-Type": "application/octet-stream", "Content-Length": str(entry["size"])}
        if entry["lfs"]:  # the client prefers these, as the Hub sends them on its redirect to the LFS storage
            headers |= {"X-Linked-Etag": f'"{entry["sha256"]}"', "X-Linked-Size": str(entry["size"])}
        self._send_head(200, headers)
        if self.command == "GET":
            with store.object_path(entry["sha256"]).open("rb") as f:
                shutil.copyfileobj(f, self.wfile, CHUNK)


def repo_id(namespace: str, name: str) -> str:
    """`ns/name` from URL parts, refusing anything that could escape the root directory."""
    namespace, name = unquote(namespace), unquote(name)
    if not (NAME_RE.match(namespace) and NAME_RE.match(name)) or ".." in namespace + name:
        raise HubError(400, f"Invalid repo id: {namespace}/{name}")
    return f"{namespace}/{name}"


def writable_ref(refs: dict[str, dict[str, str]], revision: str) -> tuple[str, str]:
    """Commits go to a branch (`main`, `refs/heads/main`) or an open PR (`refs/pr/N`), never to a tag or a sha."""
    for prefix, kind in (("refs/heads/", "heads"), ("refs/pr/", "prs"), ("", "heads")):
        if revision.startswith(prefix) and revision[len(prefix):] in refs[kind]:
            return kind, revision[len(prefix):]
    raise HubError(404, f"Invalid rev id: {revision} is not a branch", code="RevisionNotFound")


def start_local_hub(root: Path, token: str, *, user: str = "local-user", log: IO[str] | None = None
                    ) -> tuple[str, Callable[[], None]]:
    """Serve `root` on a free port from a background thread; returns the URL and a function that stops it."""
    server = LocalHubServer(("127.0.0.1", 0), root, token, user, log)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return server.url, stop


CHECKOUT = Path(__file__).resolve().parents[2]  # `python -m tests.support.local_hub` runs from here


def start_local_hub_process(root: Path, token: str, *, port: int = 0, stderr: IO | int | None = None
                            ) -> tuple[str, subprocess.Popen[str]]:
    """Run the server as a subprocess, which a test can kill; the token travels in the environment, not in argv."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.local_hub", "--root", str(root), "--port", str(port)],
        cwd=CHECKOUT, env={**os.environ, "LOCAL_HUB_TOKEN": token}, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    assert proc.stdout is not None
    line, prefix = proc.stdout.readline().strip(), "local hub listening on "
    if not line.startswith(prefix):
        proc.kill()
        raise RuntimeError(f"local hub did not start (exit code {proc.wait()}): {line!r}")
    return line[len(prefix):], proc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="directory holding the repos (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--token", default=None, help="the write token (default: env LOCAL_HUB_TOKEN)")
    parser.add_argument("--user", default="local-user", help="user name returned by whoami")
    args = parser.parse_args(argv)
    token = args.token or os.environ.get("LOCAL_HUB_TOKEN")
    if not token:
        parser.error("a token is required: --token or env LOCAL_HUB_TOKEN")
    with LocalHubServer((args.host, args.port), args.root, token, args.user, log=sys.stderr) as server:
        print(f"local hub listening on {server.url}", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
