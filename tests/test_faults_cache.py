"""The node-wide file cache of VolumeDataset against damaged files, a hostile local user and broken
servers: what is served is always the source's bytes, nothing is written or read through a link
another user planted, and everything the cache holds is private to its owner.

Hostile users are uid 65534: their directories, files and links are made by a forked child that
drops to that uid, or made by root and given to it. Servers are nginx (tests/nginx_server.py) or
a small http.server on 127.0.0.1 written here."""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nginx_server import NginxServer

from fanrun import _core
from fanrun._errors import DataFileError, FanrunError
from fanrun.data import VolumeDataset
from fanrun.data._cache import cache_name

pytest.importorskip("aiohttp")

NOBODY = 65534
MB = 1_000_000
# Through the engine's own HTTP client, and through fsspec (which storage options send fetches to).
HTTP_FETCHERS = {"http": {}, "http-fsspec": {"headers": {"X-Fanrun-Test": "1"}}}

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def make_sources(root: Path, count: int, size: int) -> dict[str, bytes]:
    """count files of `size` bytes, each different, mode 0600; by file name."""
    root.mkdir(parents=True, exist_ok=True)
    contents = {}
    for i in range(count):
        data = f"file {i}\n".encode() + bytes([(i * 7) % 251]) * (size - len(f"file {i}\n"))
        path = root / f"f{i}.bin"
        path.write_bytes(data)
        path.chmod(0o600)
        contents[path.name] = data
    return contents


def by_name(ds: VolumeDataset) -> dict[str, bytes]:
    """Every sample of one pass, by the base name of its source."""
    return {source.rsplit("/", 1)[-1]: data for source, data in zip(ds.files, [read_bytes(p) for p in ds], strict=True)}


def cached_path(cache: Path, source: str) -> Path:
    return cache / "files" / cache_name(source)


def as_nobody(action: Callable[[], None]) -> None:
    """Runs `action` in a forked child as uid/gid 65534, as another local user would."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the planting child failed"


def give_away(path: Path) -> None:
    """What root made now belongs to uid 65534: a file or link that appeared from another user."""
    os.lchown(path, NOBODY, NOBODY)


@pytest.fixture
def world(tmp_path_factory) -> Iterator[Path]:
    """A directory other users can reach (tmp_path's parents are root's 0700): 0755, with a
    sticky world-writable `shared/` inside, as /tmp is."""
    root = Path(tempfile.mkdtemp(prefix="fanrun-faults-cache-"))
    root.chmod(0o755)
    (root / "shared").mkdir()
    (root / "shared").chmod(0o1777)
    yield root
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, dict[str, bytes]]]:
    """nginx serving three 2 MB files; its autoindex listing gives no sizes."""
    root = tmp_path_factory.mktemp("served")
    contents = make_sources(root / "data", 3, 2 * MB)
    for path in (root / "data").iterdir():
        path.chmod(0o644)  # nginx's workers read them
    server = NginxServer(root, tmp_path_factory.mktemp("nginx"))
    yield server.url + "/data/", contents
    server.stop()


def dataset(source, cache: Path, kind: str = "local", **options) -> VolumeDataset:
    if kind == "local":
        options.setdefault("cache_local", True)
    else:
        options.setdefault("storage_options", HTTP_FETCHERS[kind])
    return VolumeDataset(source, cache_dir=cache, shuffle=False, **options)


# ---------------------------------------------------------------- damaged files are never served


def damage_same_size(path: Path) -> None:
    with open(path, "r+b") as file:
        file.write(b"CORRUPT")


def damage_truncate(path: Path) -> None:
    os.truncate(path, 1000)


@pytest.mark.parametrize("damage", [damage_same_size, damage_truncate], ids=["same-size", "truncated"])
@pytest.mark.parametrize("kind", ["local", "http", "http-fsspec"])
def test_a_damaged_cached_file_is_fetched_again_never_served(tmp_path, served, kind, damage):
    """A cached copy written in place (same size) or truncated is detected on open and fetched
    again, for local sources (cache_local=True) and HTTP ones, whose listing gives no size."""
    source, contents = (served if kind != "local" else (tmp_path / "data", make_sources(tmp_path / "data", 3, 2 * MB)))
    cache = tmp_path / "cache"
    ds = dataset(source, cache, kind)
    assert by_name(ds) == contents
    for url in ds.files:
        damage(cached_path(cache, url))
    again = dataset(source, cache, kind)
    assert by_name(again) == contents
    assert all(cached_path(cache, url).read_bytes() == contents[url.rsplit("/", 1)[-1]] for url in ds.files)


def test_a_cached_file_whose_change_time_moved_is_verified_then_served_without_a_fetch(tmp_path):
    """A file whose record no longer names its identity (as after a fetcher died between moving
    it in and confirming its record, or a restart) is re-admitted once its size and checksum
    verify, without fetching it again; the next open is a plain hit."""
    contents = make_sources(tmp_path / "data", 2, 100_000)
    cache = tmp_path / "cache"
    assert by_name(dataset(tmp_path / "data", cache)) == contents
    for path in (cache / "files").iterdir():
        path.chmod(0o600)  # the same mode: only its change time moves
    again = dataset(tmp_path / "data", cache)
    assert by_name(again) == contents
    stats = again._cache.get().stats()
    assert (stats["readmitted"], stats["fetched"], stats["rejected"]) == (2, 0, 0)
    assert by_name(again) == contents
    assert again._cache.get().stats()["hits"] == 2


def test_a_source_whose_size_changed_is_fetched_again(tmp_path):
    """A source that changed size since it was cached is fetched again, not served stale."""
    contents = make_sources(tmp_path / "data", 2, 5_000)
    cache = tmp_path / "cache"
    assert by_name(dataset(tmp_path / "data", cache)) == contents
    (tmp_path / "data" / "f0.bin").write_bytes(b"longer now\n" * 1000)
    contents["f0.bin"] = b"longer now\n" * 1000
    assert by_name(dataset(tmp_path / "data", cache)) == contents


# ---------------------------------------------------------------- the cache directory


def test_the_default_cache_dir_is_the_users_own_under_xdg_cache_home(tmp_path, monkeypatch):
    """Without cache_dir or FANRUN_CACHE_DIR, the cache is fanrun/data under $XDG_CACHE_HOME,
    or ~/.cache where that is unset; made 0700."""
    make_sources(tmp_path / "data", 1, 100)
    monkeypatch.delenv("FANRUN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ds = VolumeDataset(tmp_path / "data", cache_local=True)
    assert ds.cache_dir == str(tmp_path / "xdg" / "fanrun" / "data")
    list(ds)
    assert stat.S_IMODE((tmp_path / "xdg" / "fanrun" / "data").stat().st_mode) == 0o700
    assert list((tmp_path / "xdg" / "fanrun" / "data" / "files").iterdir())

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ds = VolumeDataset(tmp_path / "data")
    assert ds.cache_dir == str(tmp_path / "home" / ".cache" / "fanrun" / "data")
    assert stat.S_IMODE((tmp_path / "home" / ".cache").stat().st_mode) == 0o700


@needs_root
@pytest.mark.parametrize("given_by", ["cache_dir", "FANRUN_CACHE_DIR"])
def test_a_cache_dir_another_user_created_is_refused(tmp_path, world, monkeypatch, given_by):
    """A cache directory that another user made (in a shared, sticky place such as /tmp) is
    refused with an error naming its owner and what to do, by the dataset and by the engine,
    and nothing is written in it."""
    make_sources(tmp_path / "data", 1, 100)
    theirs = world / "shared" / "cache"
    as_nobody(lambda: theirs.mkdir(mode=0o755))
    options = {"cache_dir": theirs} if given_by == "cache_dir" else {}
    if given_by == "FANRUN_CACHE_DIR":
        monkeypatch.setenv("FANRUN_CACHE_DIR", str(theirs))
    with pytest.raises(PermissionError, match="belongs to uid 65534, not to you") as refused:
        list(VolumeDataset(tmp_path / "data", cache_local=True, **options))
    assert isinstance(refused.value, FanrunError) and f"'{theirs}'" in str(refused.value)
    assert "cache_dir" in str(refused.value) and "FANRUN_CACHE_DIR" in str(refused.value)
    with pytest.raises(FanrunError, match="belongs to uid 65534"):
        _core.FileCache(str(theirs), 0, 1, 1, None)
    assert list(theirs.iterdir()) == []


@needs_root
def test_a_cache_dir_others_can_write_is_refused(tmp_path, world):
    """A shared directory anyone can write (1777 as /tmp, even root's own) is refused as a cache
    directory, and so is one under a directory others can write that is not sticky."""
    make_sources(tmp_path / "data", 1, 100)
    with pytest.raises(PermissionError, match=r"can be written by other users \(mode 1777\)"):
        list(VolumeDataset(tmp_path / "data", cache_dir=world / "shared", cache_local=True))
    (world / "open").mkdir()
    (world / "open").chmod(0o777)
    with pytest.raises(PermissionError, match=r"which other users can write \(mode 0777\) and is not sticky"):
        list(VolumeDataset(tmp_path / "data", cache_dir=world / "open" / "cache", cache_local=True))
    with pytest.raises(FanrunError, match="can be written by other users"):
        _core.FileCache(str(world / "shared"), 0, 1, 1, None)
    assert sorted(p.name for p in (world / "shared").iterdir()) == []


@needs_root
def test_links_planted_in_the_cache_are_never_followed(tmp_path, monkeypatch):
    """Links another user left in a cache directory (under files/, partial/, locks/, records/,
    as the listing, its lock and its temporary file) are never written through nor read: the
    samples are the source's, the files they point to are untouched, and no file is created
    where they point. A link as the usage file, in the directory the caller named, is refused."""
    contents = make_sources(tmp_path / "data", 4, 2_000)
    monkeypatch.setenv("FANRUN_RUN_ID", "links")  # the listing is written to the cache
    cache = tmp_path / "cache"
    victims = tmp_path / "victims"
    victims.mkdir()
    for name in ("files", "partial", "records", "usage", "json", "lock", "tmp"):
        (victims / name).write_bytes(b"V" * 2_000)  # the size of a sample, to be served if followed
    first = dataset(tmp_path / "data", cache, cache_limit="1MB")
    sources = first.files
    first._cache.get()  # the cache is open and swept: what is planted now meets a fetch

    def plant(link: Path, target: Path) -> None:
        link.parent.mkdir(mode=0o700, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        give_away(link)

    (key,) = {p.name.split(".")[0] for p in (cache / "listings").iterdir()}  # the run's listing and its lock
    plant(cache / "files" / cache_name(sources[0]), victims / "files")
    plant(cache / "partial" / cache_name(sources[1]), victims / "partial")
    plant(cache / "locks" / cache_name(sources[2]), victims / "created-by-lock")
    plant(cache / "records" / cache_name(sources[3]), victims / "records")
    (cache / "listings" / f"{key}.json").unlink()
    plant(cache / "listings" / f"{key}.json", victims / "json")
    plant(cache / "listings" / f"{key}.lock", victims / "lock")
    plant(cache / "listings" / f"{key}.json.{os.getpid()}.tmp", victims / "tmp")

    assert by_name(first) == contents
    assert by_name(dataset(tmp_path / "data", cache, cache_limit="1MB")) == contents
    assert not any(p.is_symlink() for p in cache.rglob("*"))

    plant(cache / "usage", victims / "usage")  # written on every commit under a cache_limit
    with pytest.raises(FanrunError, match=f"'{cache}/usage' is a symbolic link, which the cache does not follow"):
        list(dataset(tmp_path / "data", cache, cache_limit="1MB"))
    assert {p.name: p.read_bytes() for p in victims.iterdir()} == {n: b"V" * 2_000 for n in
                                                                   ("files", "partial", "records", "usage", "json", "lock", "tmp")}


@needs_root
def test_a_planted_file_of_the_right_size_is_not_served(tmp_path):
    """A file of the right size found in files/ that the cache did not record (another user's,
    or one without its record) is fetched over, never served."""
    contents = make_sources(tmp_path / "data", 2, 3_000)
    cache = tmp_path / "cache"
    ds = dataset(tmp_path / "data", cache)
    ds._cache.get()
    theirs, unrecorded = (cached_path(cache, source) for source in ds.files)
    theirs.write_bytes(b"E" * 3_000)
    give_away(theirs)
    unrecorded.write_bytes(b"F" * 3_000)
    assert by_name(ds) == contents
    assert ds._cache.get().stats()["fetched"] == 2


# ---------------------------------------------------------------- private to its owner


def modes_under(root: Path) -> dict[str, str]:
    """Every entry under root (root included) whose mode is not 0700 (directories) or 0600."""
    wrong = {}
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_IMODE(mode) != (0o700 if stat.S_ISDIR(mode) else 0o600):
            wrong[str(path.relative_to(root))] = f"{stat.S_IMODE(mode):04o}"
    return wrong


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask-022", "umask-000"])
@pytest.mark.parametrize("kind", ["local", "http", "http-fsspec"])
def test_everything_the_cache_writes_is_private_to_its_owner(tmp_path, served, monkeypatch, kind, umask):
    """Copies, records, locks, the usage file, the listing and its lock: 0600 files in 0700
    directories, whatever the umask, for local and remote sources."""
    if kind == "local":
        source, contents = tmp_path / "data", make_sources(tmp_path / "data", 2, 10_000)
    else:
        source, contents = served
    monkeypatch.setenv("FANRUN_RUN_ID", f"private-{kind}-{umask}")  # the listing is written to the cache
    previous = os.umask(umask)
    try:
        ds = dataset(source, tmp_path / "cache", kind, cache_limit="100MB")
        assert by_name(ds) == contents
    finally:
        os.umask(previous)
    assert modes_under(tmp_path / "cache") == {}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["files", "listings", "locks", "partial",
                                                                     "records", "usage"]


# ---------------------------------------------------------------- broken servers and fetchers


class _Handler(http.server.BaseHTTPRequestHandler):
    """/ lists one file; /file.bin answers as the server's `mode` says."""

    protocol_version = "HTTP/1.1"
    BODY = b"0123456789" * 200  # 2,000 bytes
    LISTING = b'<html><body><a href="file.bin">file.bin</a></body></html>'

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self._head(len(self.LISTING) if self.path == "/" else len(self.BODY))

    def do_GET(self) -> None:  # noqa: N802
        server: _Server = self.server  # type: ignore[assignment]
        if self.path == "/":
            self._head(len(self.LISTING))
            self.wfile.write(self.LISTING)
            return
        self._head(len(self.BODY))
        if server.mode == "whole":
            self.wfile.write(self.BODY)
            return
        self.wfile.write(self.BODY[:1000])
        self.wfile.flush()
        if server.mode == "short":
            self.close_connection = True  # announced 2,000 bytes, sent 1,000
            return
        server.half_sent.set()  # "stall": a fetcher waits here until it is killed
        server.release.wait(30)
        self.close_connection = True

    def _head(self, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    mode = "whole"

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.half_sent = threading.Event()
        self.release = threading.Event()


@contextlib.contextmanager
def small_server() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_transfer_cut_short_is_never_cached(tmp_path):
    """A server that announces more bytes than it sends gives a DataFileError naming the
    file; nothing is moved into the cache."""
    with small_server() as server:
        server.mode = "short"
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with pytest.raises(DataFileError, match="file.bin"):
            list(VolumeDataset(url, cache_dir=tmp_path / "cache", retries=0))
    assert list((tmp_path / "cache" / "files").iterdir()) == []
    assert list((tmp_path / "cache" / "partial").iterdir()) == []


def test_a_fetcher_killed_mid_file_leaves_nothing_that_is_served(tmp_path):
    """A process killed (SIGKILL) halfway through a fetch leaves nothing that is served: the
    next reader of the cache sweeps its partial file (its lock died with it) and fetches the
    file whole."""
    with small_server() as server:
        server.mode = "stall"
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        code = textwrap.dedent(f"""
            from fanrun.data import VolumeDataset
            list(VolumeDataset({url!r}, cache_dir={str(tmp_path / "cache")!r}, retries=0))
            """)
        child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
        try:
            assert server.half_sent.wait(60), child.stderr.read() if child.poll() is not None else "no fetch began"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stderr.close()
        server.mode = "whole"
        ds = VolumeDataset(url, cache_dir=tmp_path / "cache", retries=0)
        assert [read_bytes(p) for p in ds] == [_Handler.BODY]
    assert list((tmp_path / "cache" / "partial").iterdir()) == []


def test_names_from_a_listing_stay_inside_the_cache(tmp_path):
    """A server's or a listing's name cannot leave the cache's directories: cache names hold no
    '/' and never start with '.', and the engine refuses any name that would."""
    for source in ("http://h/../../etc/passwd", "http://h/a/..", "http://h/.hidden", "/x/\n\r/..", "http://h/"):
        name = cache_name(source)
        assert "/" not in name and not name.startswith(".") and name, source
    cache = _core.FileCache(str(tmp_path / "cache"), 0, 1, 1, None)
    for name in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(FanrunError, match="must be non-empty, not start with '.' and hold no '/'"):
            cache.acquire("/etc/hostname", name, -1)
    cache.close()
