"""A stop signal while a Hugging Face Hub dataset downloads is acted on at once: the launcher and
prepare_dataset.py print one line, exit 128 + the signal, keep no partial file in the Hub cache
and nothing in the prepared-dataset cache, and leave no process behind (pretrain/data/
hub_process.py downloads in a child process that they kill). A Hub served here on 127.0.0.1
(HF_ENDPOINT) answers the requests the data code makes and streams the data file slowly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.processes import ROOT, alive, cache_leftovers, launcher_env, one_line_error, stop_as_a_user_would, wait_until

pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DATA_FILE = "data/train.jsonl"
BODY = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(2000))
FAST_FILE = "other/small.jsonl"
"""Sent at once; outside data/, so that the runs above (data.hub_files data/*.jsonl) never see it."""
FAST_BODY = json.dumps({"text": "a small document"}).encode() + b"\n"
FILES = {DATA_FILE: BODY, FAST_FILE: FAST_BODY}
STREAM_SECONDS = 6.0
"""How long the fake Hub takes to send the data file: a stop acted on only when the download
ends takes about this long; one acted on at once, a fraction of a second."""
CHUNKS = 60


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's API for dataset owner/name (revision, file tree) and its one data file, whose
    body comes in CHUNKS pieces over STREAM_SECONDS."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path.startswith("/api/datasets/owner/name/revision/"):
            self._json({"id": "owner/name", "sha": COMMIT, "siblings": [{"rfilename": DATA_FILE}]})
        elif path.startswith("/api/datasets/owner/name/tree/"):
            self._json([{"type": "file", "path": name, "size": len(body), "oid": "0" * 40} for name, body in FILES.items()])
        else:
            self._data_file(send_body=True)

    def do_HEAD(self) -> None:
        self._data_file(send_body=False)

    def _json(self, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _data_file(self, send_body: bool) -> None:
        name = self.path.split("?")[0].removeprefix(f"/datasets/owner/name/resolve/{COMMIT}/")
        if name not in FILES:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = FILES[name]
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"etag-{len(body)}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        step = len(body) // CHUNKS + 1
        for start in range(0, len(body) if send_body else 0, step):
            try:
                self.wfile.write(body[start : start + step])
                self.wfile.flush()
            except OSError:  # the client went away
                return
            if body is BODY:
                time.sleep(STREAM_SECONDS / CHUNKS)


@pytest.fixture(scope="module")
def hub_endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def command(entry: str, tmp_path) -> list[str]:
    data = ["--set", "data.source=hub", "--set", "data.hub_repo=owner/name", "--set", "data.hub_files=data/*.jsonl"]
    data += ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    return {
        "launcher": [sys.executable, "-m", "launcher", "--debug", "--device", "cpu", "--run-dir", str(tmp_path / "run"), *data],
        "prepare_dataset.py": [sys.executable, "prepare_dataset.py", "--debug", *data],
    }[entry]


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry, stop_signal",
    [("launcher", signal.SIGINT), ("launcher", signal.SIGTERM), ("prepare_dataset.py", signal.SIGHUP)],
    ids=["launcher-SIGINT", "launcher-SIGTERM", "prepare_dataset.py-SIGHUP"],
)
def test_a_stop_signal_during_a_hub_download_is_acted_on_at_once(processes, tmp_path, hub_endpoint, entry, stop_signal):
    hub_cache = tmp_path / "hf" / "hub"
    env = launcher_env(PYTHONUNBUFFERED="1", HF_ENDPOINT=hub_endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(hub_cache))
    env.pop("HF_HUB_OFFLINE", None)
    proc = processes(command(entry, tmp_path), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    while "dataset: downloading data/train.jsonl of dataset owner/name@0123456789ab" not in (line := proc.stdout.readline()):
        assert line, "".join(seen)
        seen.append(line)
    # The file is on its way (the child takes ~1 s to start on a loaded machine).
    assert wait_until(lambda: list(hub_cache.rglob("*.incomplete")), timeout=15), "the download has not started"
    code, took, out, job = stop_as_a_user_would(proc, stop_signal, timeout=STREAM_SECONDS + 30)  # SIGINT: the child too

    assert code == 128 + stop_signal, out
    assert took < STREAM_SECONDS / 3, f"stopped {took:.2f} s after {stop_signal.name}; the download takes {STREAM_SECONDS} s"
    interrupted = [line for line in out.splitlines() if "download interrupted by" in line]
    assert len(interrupted) == 1 and interrupted[0].endswith(
        f"dataset: download interrupted by {stop_signal.name}; the files it finished stay in the Hugging Face cache "
        "for the next run, the partial ones are removed"
    ), out
    assert "Traceback" not in out
    assert wait_until(lambda: not any(alive(p.pid) for p in job), timeout=5), job
    assert list(hub_cache.rglob("*.incomplete")) == [] and not list(hub_cache.rglob("train.jsonl"))
    assert cache_leftovers(tmp_path) == []


@pytest.fixture
def online_hub(tmp_path, monkeypatch, hub_endpoint):
    """This process and its children use the fake Hub, with an empty Hub cache; returns the cache."""
    constants = pytest.importorskip("huggingface_hub.constants")
    cache = tmp_path / "hf" / "hub"
    for name, value in (("HF_ENDPOINT", hub_endpoint), ("HF_HOME", str(tmp_path / "hf")), ("HF_HUB_CACHE", str(cache))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads these when it is imported: set them where it looks at call time too.
    monkeypatch.setattr(constants, "ENDPOINT", hub_endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


def test_a_hub_file_is_downloaded_once_then_found_in_the_cache_without_a_download(online_hub):
    from pretrain.data.hub_process import hub_snapshot

    lines: list[str] = []
    folder = hub_snapshot("owner/name", "main", [FAST_FILE], log=lines.append)
    assert (folder / FAST_FILE).read_bytes() == FAST_BODY
    assert lines == [
        f"dataset: downloading {FAST_FILE} of dataset owner/name@{COMMIT[:12]} into the Hugging Face cache ({online_hub})"
    ]

    assert (online_hub / "datasets--owner--name" / "refs" / "main").read_text() == COMMIT  # for offline runs

    again = hub_snapshot("owner/name", "main", [FAST_FILE], log=lines.append)
    assert again == folder and len(lines) == 1  # no second download, no child process


def test_a_download_that_fails_in_the_child_process_is_its_one_line_error_here(online_hub):
    from pretrain.data import DataError
    from pretrain.data.hub_process import hub_snapshot

    with pytest.raises(DataError) as excinfo:  # the fake Hub knows no owner/missing: the child's snapshot_download fails
        hub_snapshot("owner/missing", COMMIT, [DATA_FILE], log=lambda line: None)
    assert one_line_error(excinfo).startswith(f"dataset owner/missing is not in the Hugging Face cache ({online_hub})")
