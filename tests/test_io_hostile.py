"""``modelmeter.io`` against what an fvcore/iopath user may hand it: paths that are not paths, schemes nobody
serves, handlers with odd prefixes, file URLs with ``?``/``#``, URLs of the wrong kind given to the HTTP handler,
credentials in URLs, a cache file blocked by a directory, LazyPaths that fail or refer to themselves, and cache
directories written with variables. Each case wants a specific error from modelmeter's tree that names the path,
and never a silent wrong answer (a local directory ``./s3:/...``, a different file than the one named).

The HTTP cases talk to a ``ThreadingHTTPServer`` on 127.0.0.1 started here; nothing else is contacted.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from modelmeter.errors import InvalidTypeError, InvalidValueError, ModelMeterError, UnsupportedError
from modelmeter.io import (
    DownloadError,
    HTTPURLHandler,
    LazyPath,
    PathHandler,
    PathManager,
    PathManagerBase,
    get_cache_dir,
)
from modelmeter.io.cache_dir import chosen_cache_dir
from test_io import _no_proxy, serving  # noqa: F401 - _no_proxy: the autouse fixture clearing proxies


class _Replies(BaseHTTPRequestHandler):
    """``/redirect...`` answers 302 to ``/target.bin``; ``/cut...`` starts a chunked body and hangs up; anything
    else is ``payload of <path>``. Every request is counted by path."""

    timeout = 10
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.gets[self.path] += 1
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "/target.bin")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/cut"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"5\r\nhello\r\n")  # one chunk, then the connection closes without the last one
            self.close_connection = True
            return
        body = f"payload of {self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Replies)
        self.lock = threading.Lock()
        self.gets: Counter[str] = Counter()
        self.base = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server() -> Iterator[_Server]:
    with serving(_Server()) as srv:
        yield srv


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


# --------------------------------------------------------------------------------------------- PathManager


@pytest.mark.parametrize("url", ["s3://bucket/models/x.pth", "gs://b/x", "manifold://tree/x", "hdfs://nn:8020/x"])
def test_a_scheme_no_handler_serves_is_refused_not_made_local(url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (PathManager.exists, PathManager.isdir, PathManager.mkdirs, PathManager.get_local_path,
                 lambda p: PathManager.open(p, "w")):
        with pytest.raises(UnsupportedError, match="No handler serves .*://") as info:
            call(url)
        assert url in str(info.value) and "http://" in str(info.value)  # names the path and what is served
    assert list(tmp_path.iterdir()) == []  # no ./s3:/bucket/... written


def test_schemes_match_in_any_case(server: _Server, tmp_path: Path) -> None:
    manager = PathManagerBase()
    manager.register_handler(HTTPURLHandler(cache_dir=tmp_path, timeout=10))
    url = server.base.replace("http://", "HTTP://") + "/upper.bin"
    assert isinstance(manager.get_path_handler(url), HTTPURLHandler)
    assert Path(manager.get_local_path(url)).read_bytes() == b"payload of /upper.bin\n"
    for local in (tmp_path / "HTTP:" / "x", "relative/HTTP://x", "C://drive/x"):  # C: is a drive, not a scheme
        assert type(manager.get_path_handler(local)).__name__ == "NativePathHandler"


@pytest.mark.parametrize("path", [None, 3, b"/tmp", 1.5, ["a"]])
def test_what_is_not_a_path_is_an_invalid_type_error(path: Any) -> None:
    for call in (PathManager.exists, PathManager.open, PathManager.get_path_handler):
        with pytest.raises(InvalidTypeError, match=f"an os.PathLike of str, got {type(path).__name__}"):
            call(path)


def test_a_path_with_a_nul_is_an_invalid_value_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match="NUL"):
        PathManager.open(str(tmp_path / "a\0b"), "w")
    with pytest.raises(InvalidValueError, match="NUL"):
        PathManager.open((tmp_path / "a").as_uri() + "%00b")
    assert list(tmp_path.iterdir()) == []


class _Prefixes(PathHandler):
    def __init__(self, prefixes: Any) -> None:
        self.prefixes = prefixes

    def supported_prefixes(self) -> Any:
        return self.prefixes


@pytest.mark.parametrize(("prefixes", "error"), [
    ("mem://", InvalidTypeError),  # a bare str: its letters would become prefixes, "/" taking every local path
    (None, InvalidTypeError),
    (["mem://", ""], InvalidValueError),  # the empty prefix matches every path
    ([b"mem://"], InvalidValueError),
])
def test_register_handler_refuses_prefixes_that_would_take_every_path(prefixes: Any, error: type) -> None:
    manager = PathManagerBase()
    with pytest.raises(error, match="_Prefixes.supported_prefixes"):
        manager.register_handler(_Prefixes(prefixes))
    assert type(manager.get_path_handler("/etc/hosts")).__name__ == "NativePathHandler"
    assert type(manager.get_path_handler("mem-file")).__name__ == "NativePathHandler"


def test_overlapping_prefixes_go_to_the_longest() -> None:
    manager = PathManagerBase()
    short, long = _Prefixes(["mem://"]), _Prefixes(["MEM://special/"])
    manager.register_handler(long)
    manager.register_handler(short)
    assert manager.get_path_handler("mem://special/x") is long
    assert manager.get_path_handler("mem://Special/x") is short  # only the scheme is case-insensitive
    assert manager.get_path_handler("Mem://other") is short


def test_an_operation_a_handler_lacks_is_an_unsupported_error() -> None:
    manager = PathManagerBase()
    manager.register_handler(_Prefixes(["mem://"]))
    for call in (manager.open, manager.ls, manager.rm, manager.get_local_path):
        with pytest.raises(UnsupportedError, match=r"_Prefixes does not support \w+\(\) \(path: mem://x\)"):
            call("mem://x")


@pytest.mark.parametrize("tail", ["?v=1", "#frag", "?", "#"])
def test_a_file_url_with_a_query_or_fragment_is_refused_not_cut(tmp_path: Path, tail: str) -> None:
    # "file://" + "/data/run#3" would open /data/run: a different file than the one named.
    (tmp_path / "data").write_text("the wrong file")
    url = (tmp_path / "data").as_uri() + tail
    for call in (PathManager.open, PathManager.exists, PathManager.get_local_path):
        with pytest.raises(InvalidValueError, match="percent-encode") as info:
            call(url)
        assert url in str(info.value)
    odd = tmp_path / "run#3?.txt"
    odd.write_text("right")
    assert PathManager.open(odd.as_uri()).read() == "right"  # Path.as_uri() encodes them


def test_a_short_file_url_is_a_file_url_not_a_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "weights 1.bin"
    target.write_bytes(b"w")
    short = "file:" + target.as_uri()[len("file://"):]  # file:/tmp/.../weights%201.bin, as Java writes it
    assert PathManager.exists(short) and PathManager.isfile(short)
    assert PathManager.get_local_path(short) == str(target)
    with PathManager.open(short, "rb") as f:
        assert f.read() == b"w"
    assert (tmp_path / "file:").exists() is False


def test_copy_to_a_missing_directory_names_the_destination(tmp_path: Path) -> None:
    (tmp_path / "src").write_text("x")
    dst = tmp_path / "missing" / "dst"
    with pytest.raises(FileNotFoundError) as info:
        PathManager.copy(tmp_path / "src", dst)
    assert info.value.filename == str(dst) and str(dst) in str(info.value)  # not the hidden temporary file


def _fresh(directory: Path, mode: str) -> Path:
    """A new path in ``directory``, an existing file when ``mode`` reads (so that only the mode can fail)."""
    target = directory / f"m{len(list(directory.iterdir()))}"
    if "r" in mode:
        target.write_text("x")
    return target


def _builtin_takes(mode: str, directory: Path) -> bool:
    """Whether the builtin ``open`` takes ``mode``: the oracle."""
    try:
        open(_fresh(directory, mode), mode).close()
    except ValueError:
        return False
    return True


def test_open_modes_are_checked_as_the_builtin_does_and_name_the_path(tmp_path: Path) -> None:
    oracle, ours = tmp_path / "oracle", tmp_path / "ours"
    oracle.mkdir()
    ours.mkdir()
    letters = "rwxabt+U"
    modes = [""] + [a + b for a in letters for b in ["", *letters]] + ["r+b", "rb+", "wbt", "a+t", "xb+", "r++"]
    for mode in modes:
        target = _fresh(ours, mode)
        if _builtin_takes(mode, oracle):
            PathManager.open(target, mode).close()
            continue
        with pytest.raises(InvalidValueError, match="invalid mode") as info:
            PathManager.open(target, mode)
        assert str(target) in str(info.value), mode
    with pytest.raises(InvalidTypeError, match="mode must be a str"):
        PathManager.open(ours / "x", 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match=r"binary mode 'rb' takes no encoding") as info:
        PathManager.open(_fresh(ours, "r"), "rb", encoding="utf-8")
    assert str(ours) in str(info.value)


# --------------------------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("url", ["file:///etc/hostname", "ftp://127.0.0.1:1/x", "/etc/hostname", "data:,x"])
def test_the_http_handler_serves_http_urls_only(url: str, tmp_path: Path) -> None:
    handler = HTTPURLHandler(cache_dir=tmp_path, timeout=5)
    for call in (handler.get_local_path, handler.cache_path, handler.exists):
        with pytest.raises(InvalidValueError, match="http:// and https:// URLs only"):
            call(url)
    assert _files(tmp_path) == []  # a local file was not copied into the download cache


def test_http_messages_hide_credentials(tmp_path: Path) -> None:
    url = "https://user:SECRET@example.invalid/x.bin"
    handler = HTTPURLHandler(cache_dir=tmp_path)
    manager = PathManagerBase()
    manager.register_handler(handler)
    calls = (lambda: manager.open(url, "w"), lambda: manager.ls(url), lambda: manager.rm(url),
             lambda: manager.mkdirs(url), lambda: manager.copy_from_local(__file__, url),
             lambda: PathManager.exists(url.replace("https", "s3")))
    for call in calls:
        with pytest.raises(ModelMeterError) as info:
            call()
        assert "SECRET" not in str(info.value) and "***@example.invalid/x.bin" in str(info.value)


def test_a_directory_where_the_cached_file_goes_is_a_download_error(server: _Server, tmp_path: Path) -> None:
    handler = HTTPURLHandler(cache_dir=tmp_path, timeout=10)
    url = server.base + "/blocked.bin"
    local = Path(handler.cache_path(url))
    local.mkdir(parents=True)
    with pytest.raises(DownloadError, match=f"cannot store it as {local}") as info:
        handler.get_local_path(url)
    assert info.value.url == url
    assert _files(tmp_path) == []  # no .part file left beside it
    local.rmdir()
    assert Path(handler.get_local_path(url)).read_bytes() == b"payload of /blocked.bin\n"


def test_a_bad_open_mode_on_a_url_is_refused_before_downloading(server: _Server, tmp_path: Path) -> None:
    manager = PathManagerBase()
    manager.register_handler(HTTPURLHandler(cache_dir=tmp_path, timeout=10))
    for mode in ("z", "", "bt", "rr"):
        with pytest.raises(InvalidValueError, match="invalid mode") as info:
            manager.open(server.base + "/m.bin", mode)
        assert server.base + "/m.bin" in str(info.value)
    assert not server.gets and _files(tmp_path) == []


def test_a_file_where_a_cache_directory_goes_is_a_download_error(server: _Server, tmp_path: Path) -> None:
    handler = HTTPURLHandler(cache_dir=tmp_path, timeout=10)
    url = server.base + "/dir/x.bin"
    local = Path(handler.cache_path(url))
    local.parent.parent.mkdir(parents=True)
    local.parent.write_text("in the way")
    with pytest.raises(DownloadError, match=f"cannot lock its cache file {local}"):
        handler.get_local_path(url)
    assert not server.gets


def test_redirects_cut_transfers_and_threads(server: _Server, tmp_path: Path) -> None:
    """Cases that already held: kept here as the probes that tried them."""
    handler = HTTPURLHandler(cache_dir=tmp_path, timeout=10)
    redirected = handler.get_local_path(server.base + "/redirect/a.bin")
    assert Path(redirected).read_bytes() == b"payload of /target.bin\n"
    assert redirected == handler.cache_path(server.base + "/redirect/a.bin")  # cached under the URL asked for
    with pytest.raises(DownloadError, match="IncompleteRead"):
        handler.get_local_path(server.base + "/cut.bin")
    assert _files(tmp_path) == [Path(redirected)]
    url = server.base + "/shared.bin"
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(handler.get_local_path(url))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 8 and len(set(results)) == 1
    assert server.gets["/shared.bin"] == 1
    assert Path(results[0]).read_bytes() == b"payload of /shared.bin\n"


# --------------------------------------------------------------------------------------------- LazyPath


def test_a_lazy_path_that_needs_itself_raises_instead_of_hanging() -> None:
    path = LazyPath(lambda: os.path.join(path, "x"))
    outcome: list[BaseException] = []

    def use() -> None:
        try:
            os.fspath(path)
        except BaseException as e:  # the test reports whatever it was
            outcome.append(e)

    thread = threading.Thread(target=use, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "os.fspath(LazyPath) deadlocked on its own lock"
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidValueError)
    assert "needs the path it is computing" in str(outcome[0])
    assert not path.materialized


def test_a_failing_lazy_path_function_is_called_again_not_cached() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"attempt {len(calls)}")
        return "/data/x"

    path = LazyPath(flaky)
    for attempt in (1, 2):
        with pytest.raises(ConnectionError, match=f"attempt {attempt}"):
            os.fspath(path)
        assert not path.materialized
    assert str(path) == "/data/x" and os.fspath(path) == "/data/x"
    assert len(calls) == 3


def test_a_computed_lazy_path_pickles_without_its_function() -> None:
    path = LazyPath(lambda: "/data/x")  # a lambda does not pickle
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(path)
    assert os.fspath(path) == "/data/x"
    copy = pickle.loads(pickle.dumps(path))
    assert copy.materialized and os.fspath(copy) == "/data/x" and copy.upper() == "/DATA/X"


def test_a_lazy_path_is_computed_once_across_threads() -> None:
    calls = []
    start = threading.Barrier(16)

    def slow() -> str:
        calls.append(1)
        return "/data/once"

    path = LazyPath(slow)
    seen: list[str] = []

    def use() -> None:
        start.wait()
        seen.append(os.fspath(path))

    threads = [threading.Thread(target=use) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert seen == ["/data/once"] * 16 and len(calls) == 1


# --------------------------------------------------------------------------------------------- cache directory


def test_cache_dir_expands_variables_and_names_what_cannot_be_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBE_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("MODELMETER_CACHE", "$PROBE_SCRATCH/cache")
    assert get_cache_dir() == str(tmp_path / "scratch" / "cache")
    # a path given is used as written, as open() would (a directory name may hold a "$"); ~ is expanded
    assert get_cache_dir(str(tmp_path / "${PROBE_SCRATCH}")) == str(tmp_path / "${PROBE_SCRATCH}")
    monkeypatch.setenv("MODELMETER_CACHE", "")
    monkeypatch.setenv("FVCORE_CACHE", "~/fv")
    assert chosen_cache_dir() == os.path.expanduser("~/fv")  # an empty variable counts as unset
    with pytest.raises(InvalidValueError, match="cache_dir holds a NUL"):
        get_cache_dir(str(tmp_path) + "/a\0b")
    for bad in (b"/tmp/x", 3):
        with pytest.raises(InvalidTypeError, match="cache_dir must be a str"):
            get_cache_dir(bad)  # type: ignore[arg-type]

