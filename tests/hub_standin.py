"""
A stand-in for the Hugging Face Hub on 127.0.0.1, answering in the shapes huggingface_hub reads:

    GET  /api/datasets/OWNER/NAME/revision/REV           {"id", "sha", "cardData": {"license"}}
    GET  /api/datasets/OWNER/NAME/tree/REV[/PATH]        [{"type": "file"|"directory", "oid", "size", "path",
                                                          "lfs": {"oid", "size", "pointerSize"}}], paginated
                                                          with a Link: <...>; rel="next" header
    HEAD /datasets/OWNER/NAME/resolve/REV/PATH           302 to http://localhost:PORT/lfs/SHA256 (the CDN: another
    GET                                                  host) with X-Linked-Etag, X-Linked-Size, X-Repo-Commit
    GET  /lfs/SHA256                                     the bytes (Range honoured)

Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) as the Hub's do.
Knobs for the tests: `claimed_sizes[path]` is the size the listing states; `unresolvable` paths are
listed but not served; `refused` paths answer 401 GatedRepo (terms not accepted) and `cut` paths close the
connection without an answer when asked for; `corrupt[path] = n` serves n corrupted copies of a file; `hang` (a path) sends half of
that file and then waits until `release` is set; `requests` lists (method, path) of every request.
"""

import hashlib
import http.server
import json
import re
import socket
import threading
import urllib.parse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PAGE_SIZE = 2  # tree entries per page: small, so the client has to follow the Link header


def git_sha1(content):
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos = {}  # repo -> {"files": {path: bytes}, "licence": str, "token": str | None}
        self.corrupt = {}
        self.claimed_sizes = {}  # path -> the size the tree listing states instead of the real one
        self.unresolvable = set()  # paths listed in the tree whose download answers 404 EntryNotFound
        self.refused, self.cut = set(), set()
        self.hang, self.release, self.hanging = None, threading.Event(), threading.Event()
        self.requests = []
        self.server = None

    def add(self, repo, files, licence, token=None):
        self.repos[repo] = {"files": dict(files), "licence": licence, "token": token}

    def blob(self, sha256):
        for repo in self.repos.values():
            for path, content in repo["files"].items():
                if hashlib.sha256(content).hexdigest() == sha256:
                    return path, content
        return None, None

    def lfs_gets(self, path):
        """How many times the bytes of this file were asked for."""
        content = next(r["files"][path] for r in self.repos.values() if path in r["files"])
        return self.requests.count(("GET", "/lfs/" + hashlib.sha256(content).hexdigest()))

    def start(self):
        self.server = Server(self)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}"

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Handler(http.server.BaseHTTPRequestHandler):
    """One request to the stand-in: its FakeHub is the server's."""

    protocol_version = "HTTP/1.1"

    @property
    def hub(self):
        return self.server.hub

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.hub.requests.append(("HEAD", self.path))
        self.route(head=True)

    def do_GET(self):
        self.hub.requests.append(("GET", self.path.split("?")[0]))
        self.route(head=False)

    def reply(self, status, body=b"", headers=(), head=False):
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def error(self, status, code, head=False):
        body = json.dumps({"error": code}).encode()
        self.reply(status, body, [("X-Error-Code", code), ("Content-Type", "application/json")], head)

    def repo_of(self, owner, name, head):
        repo = self.hub.repos.get(f"{owner}/{name}")
        if repo is None:
            self.error(404, "RepoNotFound", head)
            return None
        if repo["token"] and self.headers.get("Authorization") != f"Bearer {repo['token']}":
            self.error(401, "GatedRepo", head)
            return None
        return repo

    def route(self, head):
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.split("/")
        if url.path.startswith("/api/datasets/") and len(parts) >= 7:
            _, _, _, owner, name, what, rev, *rest = parts
            repo = self.repo_of(owner, name, head)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                return self.error(404, "RevisionNotFound", head)
            if what == "revision":
                info = {
                    "id": f"{owner}/{name}",
                    "sha": COMMIT,
                    "cardData": {"license": repo["licence"]},
                }
                return self.reply(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
            folder = urllib.parse.unquote("/".join(rest))
            return self.tree(repo, folder, urllib.parse.parse_qs(url.query), url.path)
        if url.path.startswith("/datasets/") and len(parts) >= 7 and parts[4] == "resolve":
            _, _, owner, name, _, rev, *rest = parts
            repo = self.repo_of(owner, name, head)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                return self.error(404, "RevisionNotFound", head)
            path = urllib.parse.unquote("/".join(rest))
            if path in self.hub.refused:
                return self.error(401, "GatedRepo", head)
            if path in self.hub.cut:
                self.close_connection = True
                return self.connection.shutdown(socket.SHUT_RDWR)
            content = repo["files"].get(path)
            if content is None or path in self.hub.unresolvable:
                return self.error(404, "EntryNotFound", head)
            sha256 = hashlib.sha256(content).hexdigest()
            # The Hub sends LFS files to a CDN on another host; the client then stops following
            # redirects (and keeps the token on the Hub): "localhost" is that other host here.
            location = f"http://localhost:{self.hub.server.server_port}/lfs/{sha256}"
            return self.reply(
                302,
                headers=[
                    ("Location", location),
                    ("X-Linked-Etag", f'"{sha256}"'),
                    ("X-Linked-Size", str(len(content))),
                    ("X-Repo-Commit", COMMIT),
                    ("ETag", f'"{git_sha1(content)}"'),
                ],
                head=head,
            )
        if url.path.startswith("/lfs/"):
            path, content = self.hub.blob(parts[2])
            if content is None:
                return self.error(404, "EntryNotFound", head)
            return self.send_blob(path, content, head)
        self.error(404, "RepoNotFound", head)

    def tree(self, repo, folder, query, base):
        entries, folders = [], set()
        for path, content in sorted(repo["files"].items()):
            if folder and not path.startswith(folder + "/"):
                continue
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            while parent and parent != folder and parent not in folders:
                folders.add(parent)
                entries.append({"type": "directory", "oid": git_sha1(parent.encode()), "path": parent})
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
            sha256 = hashlib.sha256(content).hexdigest()
            size = self.hub.claimed_sizes.get(path, len(content))
            entry = {"type": "file", "oid": git_sha1(content), "size": size, "path": path}
            if path.endswith(".parquet"):  # the Hub keeps data files in LFS, small text in git
                entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
            entries.append(entry)
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + PAGE_SIZE]
        headers = [("Content-Type", "application/json")]
        if start + PAGE_SIZE < len(entries):
            port = self.hub.server.server_port
            link = f"http://127.0.0.1:{port}{base}?recursive=true&cursor={start + PAGE_SIZE}"
            headers.append(("Link", f'<{link}>; rel="next"'))
        self.reply(200, json.dumps(page).encode(), headers)

    def send_blob(self, path, content, head):
        if self.hub.corrupt.get(path, 0) > 0 and not head:
            self.hub.corrupt[path] -= 1
            content = bytes(b ^ 0xFF for b in content[:64]) + content[64:]
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
        status = 206 if start else 200
        body = content[start:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        self.end_headers()
        if head:
            return
        if path == self.hub.hang:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.hub.hanging.set()
            self.hub.release.wait()
            return
        self.wfile.write(body)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub):
        super().__init__(("127.0.0.1", 0), Handler)
        self.hub = hub

    def handle_error(self, request, client_address):
        pass  # a client killed mid-file (the resume test) breaks its connection: expected
