"""A tiny Hugging Face hub on localhost, for download tests that never touch the real one.

It answers what huggingface_hub's snapshot_download asks: the model info of a revision
(`/api/models/{repo}/revision/{rev}`: its commit `sha` and `siblings`), the file tree
(`/api/models/{repo}/tree/{rev}`) and HEAD/GET of `/{repo}/resolve/{rev}/{file}` with
the headers it checks (X-Repo-Commit, ETag, Content-Length); refusals carry the hub's
X-Error-Code. Every request is recorded in `requests` as (method, path).
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    branches: dict[str, str] = field(default_factory=dict)            # name -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> files
    gated: bool = False   # model info is public, files answer 401 GatedRepo (as the hub)
    token: str | None = None   # a gated repo's files are served to this bearer token


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main",
            gated: bool = False, token: str | None = None) -> str:
        """Commits `files` to `branch` of `repo_id`; -> the commit hash. A gated repo
        serves its files only to `token`."""
        repo = self.repos.setdefault(repo_id, FakeRepo())
        repo.gated, repo.token = repo.gated or gated, token or repo.token
        commit = hashlib.sha1(json.dumps(
            [repo_id, branch, sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())]
        ).encode()).hexdigest()
        repo.commits[commit] = dict(files)
        repo.branches[branch] = commit
        return commit

    def add_dir(self, repo_id: str, directory: str | Path, *, branch: str = "main",
                extra: dict[str, bytes] | None = None) -> str:
        """Commits every file under `directory` (and `extra`) to `branch` of `repo_id`."""
        root = Path(directory)
        files = {p.relative_to(root).as_posix(): p.read_bytes()
                 for p in root.rglob("*") if p.is_file()}
        return self.add(repo_id, {**files, **(extra or {})}, branch=branch)

    def fetched(self, repo_id: str) -> set[str]:
        """The files of `repo_id` whose contents were downloaded (GETs of resolve URLs)."""
        prefix = f"/{repo_id}/resolve/"
        return {unquote(path[len(prefix):]).split("/", 1)[1]
                for method, path in self.requests if method == "GET" and path.startswith(prefix)}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:   # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._answer()

        def do_GET(self) -> None:
            self._answer()

        def _answer(self) -> None:
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path))
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]))
            else:
                self._send(404, b"", {"X-Error-Code": "EntryNotFound"})

        def _resolve(self, repo_id: str, rev: str) -> tuple[FakeRepo, str] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._send(404, b"Repository not found",
                           {"X-Error-Code": "RepoNotFound",
                            "X-Error-Message": "Repository not found"})
                return None
            commit = repo.branches.get(rev, rev)
            if commit not in repo.commits:
                self._send(404, b"Invalid rev id", {"X-Error-Code": "RevisionNotFound",
                                                    "X-Error-Message": "Invalid rev id"})
                return None
            return repo, commit

        def _api(self, repo_id: str, rest: list[str]) -> None:
            rev = rest[1] if len(rest) >= 2 else "main"     # revision/<rev> or tree/<rev>
            found = self._resolve(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            files = repo.commits[commit]
            if rest and rest[0] == "tree":
                listing = [{"type": "file", "path": name, "size": len(data),
                            "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()]
                self._json(listing)
            else:
                self._json({"id": repo_id, "sha": commit, "private": False,
                            "gated": "manual" if repo.gated else False,
                            "siblings": [{"rfilename": name} for name in files]})

        def _file(self, repo_id: str, rev: str, name: str) -> None:
            found = self._resolve(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            if repo.gated and (repo.token is None or
                               self.headers.get("Authorization") != f"Bearer {repo.token}"):
                self._send(401, b"Access to this model is restricted",
                           {"X-Error-Code": "GatedRepo",
                            "X-Error-Message": "Access to this model is restricted"})
                return
            data = repo.commits[commit].get(name)
            if data is None:
                self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound",
                                                     "X-Repo-Commit": commit})
                return
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            self._send(200, data, headers)

        def _json(self, value) -> None:
            self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
            """A HEAD gets the headers of the GET (its Content-Length too), no body."""
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
    return Handler
