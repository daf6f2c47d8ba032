"""A stand-in for the Hugging Face Hub on 127.0.0.1: serves local model directories in the hub's URL layout so
that huggingface_hub's `snapshot_download` and `hf_hub_download` download them for real, over loopback.

It answers only what huggingface_hub 2.4 asks while downloading a model repo:
  GET  /api/models/{org}/{name}[/revision/{rev}]        repo_info: {"id", "sha", "siblings"}; "sha" is the commit
  GET  /api/models/{org}/{name}/tree/{rev}[/{dir}]      list_repo_tree: every file, in one page (no Link header)
  HEAD /{org}/{name}/resolve/{rev}/{path}               file metadata: X-Repo-Commit, ETag, Content-Length
  GET  /{org}/{name}/resolve/{rev}/{path}               the bytes
`rev` is "main" or the commit hash. Errors are 404s carrying the X-Error-Code the client maps to its exceptions:
RepoNotFound -> RepositoryNotFoundError, RevisionNotFound -> RevisionNotFoundError, EntryNotFound ->
RemoteEntryNotFoundError. Every file is served the way the hub serves a small git file: 200 on HEAD with the git
blob sha1 as ETag, no LFS redirect, and never an X-Xet-Hash header or a "xetHash" tree field, which would send the
client (hf_xet is installed) to a Xet CAS server instead of the plain HTTP GET. No auth, uploads or Range requests.
Any other path is a bare 404, which is all the client wants for the one it asks besides (GET /api/agent-harnesses,
its once-per-process, best-effort look-up for the User-Agent; it shows up in `requests`).

huggingface_hub reads HF_ENDPOINT (and HF_HOME, HF_HUB_OFFLINE) into its constants when it is first imported, so
setting os.environ in a process that has already imported it changes nothing: put HF_ENDPOINT=hub.url, a fresh
HF_HOME and no HF_HUB_OFFLINE in the environment of the subprocess that downloads (e.g. `torchrun ... -m autotp
generate --model org/name`).

`SilentHub` is the other kind of hub: one that accepts connections and never answers (a broken proxy).

As a script, for a test that wants the hub in its own process: `python tests/standin_hub.py --repo
org/name=/path/to/dir [--delay 10]` prints the URL as its first stdout line and serves until killed.
"""

import argparse
import hashlib
import json
import math
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = r"([^/]+/[^/]+)"
INFO_RE = re.compile(rf"/api/models/{REPO}(?:/revision/([^/]+))?")
TREE_RE = re.compile(rf"/api/models/{REPO}/tree/([^/]+)(?:/(.*))?")
RESOLVE_RE = re.compile(rf"/{REPO}/resolve/([^/]+)/(.+)")
# Longest pause between two pieces of a delayed body: the client gives up on a read that waits
# HF_HUB_DOWNLOAD_TIMEOUT (10 s by default), so a slow download has to trickle, not stall.
MAX_PAUSE_S = 0.5


class Repo:
    """One served directory, read once: repo path -> (local file, git blob sha1), and a commit hash made from them."""

    def __init__(self, directory: Path):
        self.files = {}
        for f in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
            data = f.read_bytes()
            oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # what `git hash-object` prints
            self.files[f.relative_to(directory).as_posix()] = (f, oid)
        listing = json.dumps([(path, oid) for path, (_, oid) in self.files.items()])
        self.commit = hashlib.sha1(listing.encode()).hexdigest()  # 40 hex digits, as the client checks


class StandinHub:
    """Serves `repos` (repo id "org/name" -> local directory, as it is at construction) at `url` from a daemon
    thread. `delay_s` stretches each file body GET over that many seconds; `fail_status` makes every request
    answer that status with an empty body (500: the hub is down). `requests` lists "METHOD /path" (unquoted,
    without the query) of every request, e.g. to count how often a file was downloaded; `sent_whole` lists
    "org/name/path" of every file body sent to its last byte (after its delay_s)."""

    def __init__(self, repos: dict[str, Path], delay_s: float = 0.0, fail_status: int | None = None):
        self.repos = {repo_id: Repo(d) for repo_id, d in repos.items()}
        self.delay_s = delay_s
        self.fail_status = fail_status
        self.requests: list[str] = []
        self.sent_whole: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def close(self):
        if self._thread.is_alive():  # shutdown() waits for a serve_forever() that never started otherwise
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class SilentHub:
    """Accepts every connection on 127.0.0.1 at `url` and never reads or answers, holding each open until close():
    what a client sees behind a proxy that takes connections and then stalls. `connections` counts them."""

    def __init__(self):
        self._server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def connections(self) -> int:
        return len(self._held)

    def _accept(self):
        while True:
            try:
                self._held.append(self._server.accept()[0])
            except OSError:  # closed
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.close()
        for conn in self._held:
            conn.close()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self._answer(body=True)

    def do_HEAD(self):
        self._answer(body=False)

    def log_message(self, *args):
        pass  # the request log is hub.requests; stderr stays for the test's own output

    def _answer(self, body: bool):
        hub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        hub.requests.append(f"{self.command} {path}")
        if hub.fail_status is not None:
            return self._send(hub.fail_status, {}, b"")
        if m := INFO_RE.fullmatch(path):
            repo = self._repo(hub, *m.groups())
            if repo:
                siblings = [{"rfilename": p} for p in repo.files]
                self._json({"id": m[1], "sha": repo.commit, "private": False, "siblings": siblings}, repo)
        elif m := TREE_RE.fullmatch(path):
            repo = self._repo(hub, m[1], m[2])
            if repo:
                prefix = f"{m[3].rstrip('/')}/" if m[3] else ""
                self._json([{"type": "file", "path": p, "size": f.stat().st_size, "oid": oid}
                            for p, (f, oid) in repo.files.items() if p.startswith(prefix)], repo)
        elif m := RESOLVE_RE.fullmatch(path):
            repo = self._repo(hub, m[1], m[2])
            if repo and m[3] not in repo.files:
                self._error("EntryNotFound", repo)
            elif repo:
                self._file(*repo.files[m[3]], repo, hub.delay_s if body else None)
                if body and self.sent:
                    hub.sent_whole.append(f"{m[1]}/{m[3]}")
        else:
            self._send(404, {}, b"")

    def _repo(self, hub, repo_id: str, rev: str | None) -> Repo | None:
        """The repo, or None after answering the 404 the hub gives for an unknown repo or revision."""
        repo = hub.repos.get(repo_id)
        if repo is None:
            self._error("RepoNotFound", None)
        elif rev not in (None, "main", repo.commit):
            self._error("RevisionNotFound", repo)
        else:
            return repo
        return None

    def _error(self, code: str, repo: Repo | None):
        headers = {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"}
        if repo is not None:
            headers["X-Repo-Commit"] = repo.commit  # lets the client cache a missing file as .no_exist/<commit>
        self._send(404, headers, json.dumps({"error": code}).encode(), body=self.command != "HEAD")

    def _json(self, payload, repo: Repo):
        headers = {"Content-Type": "application/json", "X-Repo-Commit": repo.commit}
        self._send(200, headers, json.dumps(payload).encode(), body=self.command != "HEAD")

    def _file(self, local: Path, oid: str, repo: Repo, delay_s: float | None):
        """HEAD when delay_s is None; otherwise GET, the body in pieces spread over delay_s seconds."""
        size = local.stat().st_size
        headers = {"ETag": f'"{oid}"', "X-Repo-Commit": repo.commit, "Content-Type": "application/octet-stream"}
        self._send(200, headers | {"Content-Length": str(size)}, b"", body=False)
        if delay_s is None:
            return
        pieces = max(1, min(size, math.ceil(delay_s / MAX_PAUSE_S)))
        self.sent = False
        try:
            with local.open("rb") as f:
                for i in range(pieces):
                    time.sleep(delay_s / pieces)
                    self.wfile.write(f.read((i + 1) * size // pieces - i * size // pieces))
            self.sent = True
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-download (a test killed it): nothing to answer

    def _send(self, status: int, headers: dict[str, str], payload: bytes, body: bool = True):
        self.send_response(status)
        headers.setdefault("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(payload)


def main():
    parser = argparse.ArgumentParser(description="Serve local model directories as a stand-in Hugging Face Hub.")
    parser.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=DIR",
                        help="a repo id and the directory it serves; repeatable")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each file download takes")
    parser.add_argument("--fail-status", type=int, help="answer every request with this HTTP status")
    args = parser.parse_args()
    repos = {repo_id: Path(d) for repo_id, d in (r.split("=", 1) for r in args.repo)}
    with StandinHub(repos, delay_s=args.delay, fail_status=args.fail_status) as hub:
        print(hub.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
