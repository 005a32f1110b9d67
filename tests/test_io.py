"""``modelmeter.io``: cache directory, LazyPath, file lock, path handlers and the HTTP download cache.

HTTP tests talk to a ``ThreadingHTTPServer`` on 127.0.0.1 started here (port 0, daemon threads, socket
timeouts); nothing else is contacted. The server counts requests per path, so "no second request" and "one
transfer for eight processes" are checked on the wire.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO, TextIOWrapper
from pathlib import Path
from typing import IO, Any, TypeVar

import filelock
import pytest

import modelmeter.io as mio
from modelmeter.io import (
    DownloadError,
    FileURLHandler,
    HTTPURLHandler,
    LazyPath,
    NativePathHandler,
    PathHandler,
    PathManager,
    PathManagerBase,
    file_lock,
    get_cache_dir,
)
from modelmeter.io import download as download_module
from modelmeter.io.cache_dir import _fallback_cache_dir, _platform_cache_dir

ServerT = TypeVar("ServerT", bound=ThreadingHTTPServer)

BIG = bytes(range(256)) * (2 * 1024 * 1024 // 256 + 7)  # a bit over 2 MiB


# --------------------------------------------------------------------------------------------- test server


def body_for(path: str) -> bytes:
    """What the server returns for the request target ``path``."""
    if "big" in path:
        return BIG
    return f"payload of {path}\n".encode()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # per-connection socket timeout: no request can hang the server
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _respond(self, send_body: bool) -> None:
        path = self.path
        srv = self.server
        with srv.lock:
            (srv.gets if send_body else srv.heads)[path] += 1
            drop = send_body and path.startswith("/drop") and path not in srv.dropped
            if drop:
                srv.dropped.add(path)
        if path.startswith("/missing"):
            self.send_error(404)
            return
        body = body_for(path)
        if path.startswith("/slow"):
            time.sleep(0.5)  # keep the transfer open while the other processes queue up
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        # The first GET of /drop... announces more than it sends, then the connection closes (HTTP/1.0).
        self.send_header("Content-Length", str(len(body) + (1000 if drop else 0)))
        self.end_headers()
        if send_body:
            self.wfile.write(body[: len(body) // 2] if drop else body)

    def do_GET(self) -> None:
        self._respond(send_body=True)

    def do_HEAD(self) -> None:
        self._respond(send_body=False)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.gets: Counter[str] = Counter()
        self.heads: Counter[str] = Counter()
        self.dropped: set[str] = set()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@contextmanager
def serving(srv: ServerT) -> Iterator[ServerT]:
    """``srv`` answering on a daemon thread while the block runs, then shut down and closed."""
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[_Server]:
    with serving(_Server()) as srv:
        yield srv


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MODELMETER_CACHE", str(root))
    monkeypatch.delenv("FVCORE_CACHE", raising=False)
    return root


@pytest.fixture
def manager(cache: Path) -> PathManagerBase:
    pm = PathManagerBase()
    pm.register_handler(FileURLHandler())
    pm.register_handler(HTTPURLHandler(timeout=10))
    return pm


def cached_files(root: Path) -> list[Path]:
    """Every file under ``root`` except lock files."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def inside(path: str | Path, root: str | Path) -> bool:
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    return os.path.commonpath([real_root, real]) == real_root


# --------------------------------------------------------------------------------------------- get_cache_dir


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CACHE_HOME", "MODELMETER_CACHE", "FVCORE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    if sys.platform.startswith("linux"):
        assert get_cache_dir() == str(home / ".cache" / "modelmeter")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert get_cache_dir() == str(tmp_path / "xdg" / "modelmeter")
        monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative values are invalid
        assert get_cache_dir() == str(home / ".cache" / "modelmeter")
    else:
        assert get_cache_dir() == _platform_cache_dir()
    monkeypatch.setenv("FVCORE_CACHE", "~/fv")
    assert get_cache_dir() == str(home / "fv")
    monkeypatch.setenv("MODELMETER_CACHE", "~/mm")
    assert get_cache_dir() == str(home / "mm")
    assert get_cache_dir(tmp_path / "arg") == str(tmp_path / "arg")
    assert get_cache_dir("~/arg2") == str(home / "arg2")
    monkeypatch.setenv("MODELMETER_CACHE", "")  # empty counts as unset
    assert get_cache_dir() == str(home / "fv")
    for created in ("fv", "mm", "arg2"):
        assert (home / created).is_dir()
    assert (tmp_path / "arg").is_dir()


def test_platform_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert _platform_cache_dir("darwin") == os.path.join(str(tmp_path), "Library", "Caches", "modelmeter")
    assert _platform_cache_dir("linux") == os.path.join(str(tmp_path), ".cache", "modelmeter")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "Local"))
    assert _platform_cache_dir("win32") == os.path.join(str(tmp_path / "Local"), "modelmeter", "Cache")


def _under_a_file(tmp_path: Path) -> str:
    """A path that can never be created: its parent is a regular file (root cannot write there either)."""
    blocker = tmp_path / "regular_file"
    blocker.write_text("a file can never be a directory")
    return str(blocker / "cache")


@pytest.mark.parametrize("where", ["under_file", "proc"])
def test_unwritable_cache_dir_falls_back_with_warning(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "proc":
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc")
        bad = "/proc/modelmeter_forbidden_dir"
    else:
        bad = _under_a_file(tmp_path)
    tmp_root = tmp_path / "tmp"
    tmp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_root))
    monkeypatch.setenv("MODELMETER_CACHE", bad)
    with caplog.at_level(logging.WARNING, logger="modelmeter.io"):
        result = get_cache_dir()
    assert os.path.dirname(result) == str(tmp_root)
    assert os.path.basename(result).startswith("modelmeter_cache_")
    assert os.path.isdir(result) and os.access(result, os.W_OK)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert bad in warnings[0].getMessage() and result in warnings[0].getMessage()


def test_no_writable_cache_dir_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _under_a_file(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", os.path.join(bad, "tmp"))
    with pytest.raises(OSError, match="No writable cache directory") as info:
        get_cache_dir(bad)
    assert bad in str(info.value) and "MODELMETER_CACHE" in str(info.value)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_fallback_owned_by_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _under_a_file(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = Path(_fallback_cache_dir())
    squatted.mkdir()
    os.chown(squatted, 12345, 12345)
    with pytest.raises(OSError, match="owned by uid 12345"):
        get_cache_dir(bad)


# --------------------------------------------------------------------------------------------- file_lock


def test_file_lock(tmp_path: Path) -> None:
    target = tmp_path / "new" / "sub" / "thing.bin"
    lock = file_lock(target)
    assert isinstance(lock, filelock.FileLock)
    assert lock.lock_file == str(target) + ".lock"
    assert lock.timeout >= 1800
    assert target.parent.is_dir()
    with lock:
        assert lock.is_locked
        other = filelock.FileLock(str(target) + ".lock", timeout=0.05)
        result: list[BaseException] = []
        thread = threading.Thread(target=lambda: result.append(_try_acquire(other)))
        thread.start()
        thread.join(5)
        assert result and isinstance(result[0], filelock.Timeout)
    assert not lock.is_locked


def _try_acquire(lock: filelock.FileLock) -> BaseException:
    try:
        with lock:
            return AssertionError("acquired a held lock")
    except filelock.Timeout as e:
        return e


# --------------------------------------------------------------------------------------------- LazyPath

_LAZY_TARGET = os.path.join(tempfile.gettempdir(), "modelmeter-lazy")


def _lazy_target() -> str:
    return _LAZY_TARGET


def test_lazy_path(tmp_path: Path) -> None:
    calls: list[int] = []
    target = tmp_path / "lazy.txt"
    target.write_text("hello")

    def compute() -> str:
        calls.append(1)
        return str(target)

    lp = LazyPath(compute)
    assert isinstance(lp, os.PathLike)
    with pytest.raises(AttributeError, match="Uninitialized LazyPath"):
        lp.upper()
    assert not hasattr(lp, "endswith")
    assert "not computed" in repr(lp)
    assert calls == [] and not lp.materialized
    with open(lp) as f:
        assert f.read() == "hello"
    assert calls == [1] and lp.materialized
    assert os.fspath(lp) == str(lp) == str(target)
    assert os.path.join(lp, "x") == os.path.join(str(target), "x")
    assert lp.upper() == str(target).upper()
    assert lp.endswith(".txt")
    assert lp[1] == str(target)[1] and lp[-4:] == ".txt"
    assert lp + ".bak" == str(target) + ".bak"
    assert "/pre" + lp == "/pre" + str(target)
    assert "lazy" in lp and len(lp) == len(str(target))
    assert calls == [1]  # computed exactly once
    assert repr(lp) == f"LazyPath({str(target)!r})"


def test_lazy_path_operators_compute_and_pickle() -> None:
    calls: list[int] = []

    def compute() -> str:
        calls.append(1)
        return "/data/x.pth"

    assert LazyPath(compute)[1] == "d"
    assert LazyPath(compute) + ".tmp" == "/data/x.pth.tmp"
    assert "x.pth" in LazyPath(compute)
    assert len(calls) == 3
    with pytest.raises(TypeError, match="must return a str"):
        os.fspath(LazyPath(lambda: 3))  # type: ignore[arg-type,return-value]
    restored = pickle.loads(pickle.dumps(LazyPath(_lazy_target)))
    assert os.fspath(restored) == _LAZY_TARGET
    done = LazyPath(_lazy_target)
    os.fspath(done)
    assert pickle.loads(pickle.dumps(done)).upper() == _LAZY_TARGET.upper()


def test_lazy_path_with_path_manager(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("")
    assert PathManager.ls(LazyPath(lambda: str(tmp_path))) == ["a"]
    assert isinstance(PathManager.get_path_handler(LazyPath(lambda: "https://h/x")), HTTPURLHandler)


# --------------------------------------------------------------------------------------------- native paths


def test_native_operations(tmp_path: Path) -> None:
    pm = PathManager
    d = tmp_path / "d" / "e"
    pm.mkdirs(d)
    pm.mkdirs(d)  # no error the second time
    assert pm.isdir(d) and not pm.isfile(d) and pm.exists(str(d))
    with pm.open(d / "b.txt", "w", encoding="utf-8") as f:
        f.write("bee")
    with pm.open(str(d / "a.bin"), "wb") as f:
        f.write(b"\x00a")
    assert pm.ls(d) == ["a.bin", "b.txt"]
    assert pm.isfile(d / "b.txt") and pm.exists(d / "b.txt")
    with pm.open(d / "b.txt", encoding="utf-8") as f:
        assert f.read() == "bee"
    assert pm.get_local_path(d / "b.txt") == str(d / "b.txt")
    assert pm.get_local_path(str(d / "b.txt"), force=True) == str(d / "b.txt")
    with pytest.raises(ValueError, match="Unused arguments"):
        pm.open(d / "b.txt", "r", bogus=1)
    pm.rm(d / "b.txt")
    assert not pm.exists(d / "b.txt")
    with pytest.raises(FileNotFoundError):
        pm.rm(d / "b.txt")
    assert isinstance(pm.get_path_handler(str(d)), NativePathHandler)
    with pytest.raises(NotImplementedError, match="No handler serves s3://"):  # not a local path "./s3:/bucket/x"
        pm.get_path_handler("s3://bucket/x")


def test_copy_and_overwrite(tmp_path: Path) -> None:
    pm = PathManager
    src, dst = tmp_path / "src.txt", tmp_path / "dst.txt"
    src.write_text("one")
    os.chmod(src, 0o640)
    assert pm.copy(src, dst) is True
    assert dst.read_text() == "one" and (dst.stat().st_mode & 0o777) == 0o640
    src.write_text("two")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        pm.copy(src, dst)
    assert dst.read_text() == "one"  # untouched
    assert pm.copy(src, dst, overwrite=True)
    assert dst.read_text() == "two"
    src.write_text("three")
    with pytest.raises(FileExistsError):
        pm.copy_from_local(src, dst)
    assert pm.copy_from_local(str(src), dst, overwrite=True)
    assert dst.read_text() == "three"
    with pytest.raises(IsADirectoryError):
        pm.copy(src, tmp_path, overwrite=True)
    with pytest.raises(FileNotFoundError):
        pm.copy(tmp_path / "missing", tmp_path / "new.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.txt", "src.txt"]  # no temporary files left


LONGEST_NAMES = ["a" * 255, "\U0001f600" * 62 + ".bin", "\u00fc" * 127 + "x"]  # 255, 252 and 255 bytes


@pytest.mark.parametrize("name", LONGEST_NAMES, ids=["ascii", "emoji", "latin"])
def test_atomic_writes_and_copies_take_every_name_the_file_system_takes(tmp_path: Path, name: str) -> None:
    """The temporary file beside the target must fit the file system's name limit whenever the target does
    (it added ~30 bytes to the name, so every name over ~225 bytes failed with ENAMETOOLONG)."""
    from modelmeter.io.atomic import atomic_write

    target = tmp_path / name
    atomic_write(str(target), lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new"
    (tmp_path / "src").write_bytes(b"copied")
    os.remove(target)
    assert PathManager.copy(tmp_path / "src", target)
    assert PathManager.copy(tmp_path / "src", target, overwrite=True)
    assert target.read_bytes() == b"copied"
    assert sorted(os.listdir(tmp_path)) == sorted([name, "src"])  # no temporary file left


# --------------------------------------------------------------------------------------------- file:// URLs


def test_file_urls(tmp_path: Path) -> None:
    pm = PathManager
    folder = tmp_path / "with space"
    folder.mkdir()
    target = folder / "f ü.txt"
    target.write_text("file url", encoding="utf-8")
    url = target.as_uri()
    assert "%20" in url
    assert isinstance(pm.get_path_handler(url), FileURLHandler)
    with pm.open(url, encoding="utf-8") as f:
        assert f.read() == "file url"
    assert pm.get_local_path(url) == str(target)
    assert pm.exists(url) and pm.isfile(url) and pm.isdir(folder.as_uri())
    assert pm.ls(folder.as_uri()) == ["f ü.txt"]
    assert pm.copy(url, tmp_path / "plain.txt")  # file:// -> native
    assert (tmp_path / "plain.txt").read_text(encoding="utf-8") == "file url"
    assert pm.copy(tmp_path / "plain.txt", (folder / "back.txt").as_uri())  # native -> file://
    assert pm.copy(url, (folder / "same-handler.txt").as_uri())
    with pytest.raises(FileExistsError):
        pm.copy(url, (folder / "same-handler.txt").as_uri())
    pm.mkdirs((folder / "sub").as_uri())
    pm.rm((folder / "back.txt").as_uri())
    assert sorted(os.listdir(folder)) == ["f ü.txt", "same-handler.txt", "sub"]
    assert pm.exists("file://localhost" + target.as_uri()[len("file://") :])
    with pytest.raises(ValueError, match="host 'otherhost'"):
        pm.open("file://otherhost/x")


# --------------------------------------------------------------------------------------------- handlers


class MemoryHandler(PathHandler):
    """An in-memory handler for a custom prefix."""

    def __init__(self, *prefixes: str) -> None:
        self.prefixes = prefixes
        self.files: dict[str, bytes] = {}

    def supported_prefixes(self) -> list[str]:
        return list(self.prefixes)

    def open(self, path: Any, mode: str = "r", **kwargs: Any) -> IO[Any]:
        data = BytesIO(self.files[os.fspath(path)])
        return data if "b" in mode else TextIOWrapper(data, encoding="utf-8")

    def exists(self, path: Any) -> bool:
        return os.fspath(path) in self.files


def test_register_handler_custom_prefix(tmp_path: Path) -> None:
    pm = PathManagerBase()
    general, special = MemoryHandler("mem://"), MemoryHandler("mem://special/")
    pm.register_handler(general)
    pm.register_handler(special)
    general.files["mem://a"] = b"general"
    special.files["mem://special/a"] = b"special"
    assert pm.get_path_handler("mem://a") is general
    assert pm.get_path_handler("mem://special/a") is special  # longest prefix wins
    assert pm.get_path_handler("mem://specia") is general
    assert isinstance(pm.get_path_handler("mem:/a"), NativePathHandler)
    with pytest.raises(NotImplementedError, match="No handler serves http://"):  # a bare manager: native only
        pm.get_path_handler("http://x")
    with pm.open("mem://special/a", "rb") as f:
        assert f.read() == b"special"
    with pm.open("mem://a") as f:
        assert f.read() == "general"
    assert pm.exists("mem://a") and not pm.exists("mem://b")
    with pytest.raises(NotImplementedError, match=r"MemoryHandler does not support ls\(\)"):
        pm.ls("mem://a")
    with pytest.raises(NotImplementedError, match="does not support get_local_path"):
        pm.copy("mem://a", tmp_path / "x")  # another handler's destination needs a local copy
    replacement = MemoryHandler("mem://")
    with pytest.raises(ValueError, match="already served"):
        pm.register_handler(replacement, allow_override=False)
    assert pm.get_path_handler("mem://a") is general
    pm.register_handler(replacement)
    assert pm.get_path_handler("mem://a") is replacement
    with pytest.raises(TypeError, match="PathHandler"):
        pm.register_handler(object())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- HTTP


def test_download_once_then_cache_hit(server: _Server, cache: Path) -> None:
    url = server.base + "/models/model_final.pkl"
    local = PathManager.get_local_path(url)  # the shared, ready PathManager
    assert Path(local).read_bytes() == body_for("/models/model_final.pkl")
    assert local.endswith("model_final.pkl") and inside(local, cache / "downloads")
    assert "127.0.0.1_" in local
    assert PathManager.get_local_path(url) == local
    with PathManager.open(url, "rb") as f:
        assert f.read() == body_for("/models/model_final.pkl")
    with PathManager.open(url) as f:
        assert f.read() == body_for("/models/model_final.pkl").decode()
    assert PathManager.exists(url) and PathManager.isfile(url) and not PathManager.isdir(url)
    assert server.gets["/models/model_final.pkl"] == 1 and not server.heads  # cache hits: no new request
    assert cached_files(cache) == [Path(local)]
    PathManager.get_local_path(url, force=True)
    assert server.gets["/models/model_final.pkl"] == 2


def test_http_read_only_and_errors(server: _Server, manager: PathManagerBase, cache: Path, tmp_path: Path) -> None:
    url = server.base + "/weights.bin"
    for mode in ("w", "wb", "a", "r+", "x"):
        with pytest.raises(ValueError, match="read-only"):
            manager.open(url, mode)
    with pytest.raises(NotImplementedError, match="cannot list"):
        manager.ls(url)
    with pytest.raises(NotImplementedError, match="cannot remove"):
        manager.rm(url)
    with pytest.raises(NotImplementedError, match="cannot create directories"):
        manager.mkdirs(url)
    with pytest.raises(NotImplementedError, match="cannot upload"):
        manager.copy_from_local(__file__, url)
    assert not server.gets
    assert manager.exists(url)  # not cached: asks with HEAD, downloads nothing
    assert server.heads["/weights.bin"] == 1 and not server.gets
    assert not manager.exists(server.base + "/missing.bin")
    with pytest.raises(DownloadError, match="HTTP 404") as info:
        manager.get_local_path(server.base + "/missing.bin?token=1")
    assert info.value.status == 404 and server.base + "/missing.bin?token=1" in str(info.value)
    assert isinstance(info.value, OSError)
    assert manager.copy(url, tmp_path / "copy.bin")  # URL -> local through the cache
    assert (tmp_path / "copy.bin").read_bytes() == body_for("/weights.bin")
    with pytest.raises(FileExistsError):
        manager.copy(url, tmp_path / "copy.bin")
    assert server.gets["/weights.bin"] == 1
    assert len(cached_files(cache)) == 1


def test_download_error_hides_credentials(tmp_path: Path) -> None:
    err = DownloadError("https://user:secret@example.com/x", "boom", status=500)
    assert "secret" not in str(err) and "example.com/x" in str(err)
    assert pickle.loads(pickle.dumps(err)).status == 500
    # A refused connection is a DownloadError too: a port that was free a moment ago.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    handler = HTTPURLHandler(cache_dir=tmp_path, timeout=5)
    with pytest.raises(DownloadError, match=f"127.0.0.1:{port}/x"):
        handler.get_local_path(f"http://127.0.0.1:{port}/x")
    assert cached_files(tmp_path) == []


def test_broken_transfer_leaves_no_cache_entry(server: _Server, manager: PathManagerBase, cache: Path) -> None:
    url = server.base + "/drop/big.bin"
    with pytest.raises(DownloadError) as info:
        manager.get_local_path(url)
    message = str(info.value)
    assert url in message and "Content-Length" in message
    assert cached_files(cache) == []  # neither the file nor a partial .part file
    local = manager.get_local_path(url)  # the server behaves now
    assert Path(local).read_bytes() == BIG
    assert server.gets["/drop/big.bin"] == 2
    assert cached_files(cache) == [Path(local)]


def test_progress_bar_for_large_files(
    server: _Server, manager: PathManagerBase, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(download_module, "_isatty", lambda stream: True)
    manager.get_local_path(server.base + "/small.txt")
    assert capsys.readouterr().err == ""
    manager.get_local_path(server.base + "/big.bin")
    err = capsys.readouterr().err
    assert "big.bin" in err and "100%" in err


HOSTILE = [
    "/../../etc/passwd",
    "/%2e%2e/%2e%2e/x",
    "/a/..%2f..%2fb",
    "/..%5c..%5cwin.ini",
    "/%00/nul%00byte",
    "/C:/Windows/system32",
    "/%2Fetc%2Fpasswd",
    "/" + "n" * 3000 + ".pth",
    "/" + "/".join(["deep"] * 200) + "/f",
    "/?q=../../x",
    "/?q=/etc/passwd",
    "/dir/",
    "/CON",
]


def test_hostile_urls_stay_inside_cache(server: _Server, manager: PathManagerBase, cache: Path) -> None:
    handler = manager.get_path_handler(server.base)
    assert isinstance(handler, HTTPURLHandler)
    downloads = cache / "downloads"
    seen: dict[str, str] = {}
    for target in HOSTILE:
        url = server.base + target
        local = manager.get_local_path(url)
        assert inside(local, downloads), (url, local)
        assert local == handler.cache_path(url)
        assert Path(local).read_bytes().startswith(b"payload of /")
        assert all(len(part.encode()) <= 255 for part in Path(local).parts)
        assert local not in seen, f"{url} and {seen.get(local)} share a cache file"
        seen[local] = url
    assert sum(server.gets.values()) == len(HOSTILE)
    assert len(cached_files(cache)) == len(HOSTILE)
    assert seen and all(inside(p, downloads) for p in map(str, cached_files(cache)))
    assert handler.cache_path(server.base + "/" + "n" * 3000 + ".pth").endswith(".pth")
    # Different queries and hosts never collide.
    urls = ("http://h/x?a=1", "http://h/x?a=2", "http://h/x", "http://g/x", "http://h:81/x", "https://h/x")
    assert len({handler.cache_path(u) for u in urls}) == len(urls)
    assert handler.cache_path("http://h/x#part") == handler.cache_path("http://h/x")


_WORKER = textwrap.dedent(
    """
    import os, sys, time, types
    # Load modelmeter.io without running modelmeter/__init__.py (which imports torch: seconds per process).
    package = types.ModuleType("modelmeter")
    package.__path__ = [sys.argv[1]]
    sys.modules["modelmeter"] = package
    import logging
    logging.basicConfig(level=logging.DEBUG, format="%(message)s")
    from modelmeter.io import PathManager

    url, ready, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    open(os.path.join(ready, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(ready)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    print(PathManager.get_local_path(url))
    """
)


def test_concurrent_processes_download_once(server: _Server, cache: Path, tmp_path: Path) -> None:
    n = 8
    url = server.base + "/slow/big-shared.bin"
    ready = tmp_path / "ready"
    ready.mkdir()
    package_dir = str(Path(mio.__file__).resolve().parent.parent)
    env = {**os.environ, "MODELMETER_CACHE": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, package_dir, url, str(ready), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(n)
    ]
    outputs, logs = [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            outputs.append(out.strip())
            logs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert server.gets["/slow/big-shared.bin"] == 1  # one transfer on the wire
    assert sum(log.count("Downloading ") for log in logs) == 1
    assert any("downloaded by another process" in log for log in logs)  # they really did wait on the lock
    assert len(set(outputs)) == 1
    assert Path(outputs[0]).read_bytes() == BIG
    assert cached_files(cache) == [Path(outputs[0])]


def test_handler_base_class() -> None:
    handler = PathHandler()
    assert handler.supported_prefixes() == []
    with pytest.raises(NotImplementedError, match=r"PathHandler does not support open\(\) \(path: p\)"):
        handler.open("p")


def test_abandoned_part_files_are_removed_and_live_ones_kept(server: _Server, tmp_path: Path) -> None:
    from modelmeter.io.atomic import owner_tag

    handler = HTTPURLHandler(cache_dir=tmp_path, timeout=10)
    url = server.base + "/small.txt"
    local = Path(handler.cache_path(url))
    local.parent.mkdir(parents=True)
    host = owner_tag().rpartition(".")[0]
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    name = local.name
    parts = {
        "dead writer": (f".{name}.{host}.{dead}.0123456789ab.part", False),
        "live writer": (f".{name}.{owner_tag()}.0123456789ab.part", True),
        "other host, recent": (f".{name}.elsewhere.42.0123456789ab.part", True),
        "other host, stale": (f".{name}.elsewhere.43.0123456789ab.part", False),
        "old name, stale": (f".{name}.0123456789ab.part", False),
        "another file's": (f".not-{name}.{host}.{dead}.0123456789ab.part", True),
        "a user's file": (f"{name}.part", True),
    }
    two_hours_ago = time.time() - 7200
    for what, (part, _) in parts.items():
        (local.parent / part).write_bytes(b"partial")
        if "stale" in what:
            os.utime(local.parent / part, (two_hours_ago, two_hours_ago))
    assert Path(handler.get_local_path(url)).read_bytes() == body_for("/small.txt")
    for what, (part, kept) in parts.items():
        assert (local.parent / part).exists() == kept, what
    left = sorted(p.name for p in local.parent.iterdir() if p.name.endswith(".part"))
    assert left == sorted(part for part, kept in parts.values() if kept)  # the download's own went into place
