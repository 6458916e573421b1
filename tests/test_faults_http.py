"""The HTTP fault matrix: what the engine's HTTP client (libcurl) promises against servers that
lie, stall, never stop or inject, each written here as a small server on 127.0.0.1, over http://
and https://, through VolumeDataset as a user meets it."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fanrun import _core
from fanrun._errors import DataFileError, DataSourceError, EngineInvalidArgument, EngineOSError
from fanrun.data import VolumeDataset
from fanrun.data._cache import FsspecFetch, engine_http_options

pytest.importorskip("aiohttp")  # the listing of an http(s):// source is fsspec's

# What a server may send before a client that stops reading is noticed: the socket buffers of
# both ends, not the hundreds of MB an endless answer holds.
BUFFERED_AT_MOST = 64 << 20
# An endless answer ends here, so that a client that never stops still lets the test end.
ENDLESS_BYTES = 512 << 20

Handler = Callable[["HostileServer", socket.socket], bool]


class HostileServer:
    """An HTTP/1.1 server on 127.0.0.1, a thread per connection. `routes` maps a request's
    target to what the server writes back; a handler returns whether the connection serves
    another request. Unknown targets get a 404, and a HEAD request an empty answer unless `heads`
    maps its target to a handler. With `tls`, connections are wrapped in it."""

    def __init__(self, routes: dict[str, Handler], tls: ssl.SSLContext | None = None,
                 heads: dict[str, Handler] | None = None) -> None:
        self.routes = routes
        self.heads = heads or {}
        self.tls = tls
        self.stopping = threading.Event()
        self.requests: list[tuple[int, str]] = []  # (connection number, request head)
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            number += 1
            with self._lock:
                if self.stopping.is_set():
                    connection.close()
                    return
                self._connections.append(connection)
                thread = threading.Thread(target=self._serve, args=(connection, number), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket, number: int) -> None:
        try:
            if self.tls is not None:
                connection = self.tls.wrap_socket(connection, server_side=True)
                with self._lock:
                    self._connections.append(connection)
            pending = b""
            while not self.stopping.is_set():
                while b"\r\n\r\n" not in pending:
                    data = connection.recv(65536)
                    if not data:
                        return
                    pending += data
                head, pending = pending.split(b"\r\n\r\n", 1)
                request = head.decode("latin-1")
                with self._lock:
                    self.requests.append((number, request))
                method, target = request.split(" ")[:2]
                if method == "HEAD" and target in self.heads:
                    if not self.heads[target](self, connection):
                        return
                elif method == "HEAD":  # fsspec asks whether the source exists: a head alone
                    status = "200 OK" if target in self.routes else "404 Not Found"
                    if not self.send(connection, f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n".encode()):
                        return
                elif not self.routes.get(target, not_found)(self, connection):
                    return
        except (OSError, ssl.SSLError):
            return  # the client went away, or the test ended
        finally:
            connection.close()

    def send(self, connection: socket.socket, data: bytes) -> bool:
        """For handlers: False once the client closed the connection or the test ended."""
        if self.stopping.is_set():
            return False
        try:
            connection.sendall(data)
        except OSError:
            return False
        with self._lock:
            self.bytes_sent += len(data)
        return True

    def targets(self) -> list[str]:
        with self._lock:
            return [request.split(" ")[1] for _, request in self.requests]

    def connections_serving(self, targets: set[str]) -> int:
        with self._lock:
            return len({number for number, request in self.requests if request.split(" ")[1] in targets})

    def stop(self) -> None:
        self.stopping.set()
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept(), which closing alone does not
        self._acceptor.join()
        self._listener.close()
        with self._lock:
            connections, threads = list(self._connections), list(self._threads)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join()


def answer(body: bytes, status: str = "200 OK", fields: str | None = None) -> bytes:
    fields = f"Content-Length: {len(body)}\r\n" if fields is None else fields
    return f"HTTP/1.1 {status}\r\n{fields}\r\n".encode() + body


def serve(data: bytes, **kwargs) -> Handler:
    return lambda server, connection: server.send(connection, answer(data, **kwargs))


def not_found(server: HostileServer, connection: socket.socket) -> bool:
    return server.send(connection, answer(b"not here", "404 Not Found"))


def listing(hrefs: list[str]) -> Handler:
    """A directory listing as nginx's autoindex writes one, with the hrefs given raw."""
    html = "<html><body>" + "".join(f'<a href="{href}">{href}</a>\n' for href in hrefs) + "</body></html>"
    return serve(html.encode(), fields=f"Content-Type: text/html\r\nContent-Length: {len(html.encode())}\r\n")


def files(root: str, contents: dict[str, bytes]) -> dict[str, Handler]:
    """The routes of a directory `root` holding `contents`, and its listing."""
    routes = {f"{root}/{name}": serve(data) for name, data in contents.items()}
    routes[f"{root}/"] = listing(list(contents))
    return routes


def slowly(data: bytes) -> Callable[[HostileServer, socket.socket], bool]:
    """Writes data a byte a second, for as long as the test lasts."""
    def handler(server: HostileServer, connection: socket.socket) -> bool:
        for byte in data:
            if not server.send(connection, bytes([byte])) or server.stopping.wait(1.0):
                return False
        return False
    return handler


def silent(server: HostileServer, connection: socket.socket) -> bool:
    """Reads the request, answers nothing, holds the connection open until the test ends."""
    server.stopping.wait()
    return False


def endless(head: bytes, piece: bytes) -> Handler:
    def handler(server: HostileServer, connection: socket.socket) -> bool:
        if not server.send(connection, head):
            return False
        for _ in range(ENDLESS_BYTES // len(piece)):
            if not server.send(connection, piece):
                return False
        return False
    return handler


@pytest.fixture
def hostile():
    started: list[HostileServer] = []

    def start(routes: dict[str, Handler], tls: ssl.SSLContext | None = None,
              heads: dict[str, Handler] | None = None) -> HostileServer:
        server = HostileServer(routes, tls, heads)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def dataset(url: str, tmp_path: Path, **kwargs) -> VolumeDataset:
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("transform", read)
    return VolumeDataset(url, cache_dir=tmp_path / "cache", **kwargs)


# ----------------------------------------------------------------- what already held


def test_files_are_fetched_on_connections_kept_alive(hostile, tmp_path):
    """Every file arrives whole, over a few connections kept alive between files (one per
    fetching thread), not a connection per file."""
    contents = {f"f{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(30)}
    server = hostile(files("/data", contents))
    ds = dataset(server.url + "/data/", tmp_path, cache_threads=2)
    assert list(ds) == [contents[name] for name in sorted(contents)]
    assert server.connections_serving({f"/data/{name}" for name in contents}) <= 3  # 2 threads and the caller's


def test_a_short_body_is_an_error_naming_the_url(hostile, tmp_path):
    """A body that ends before its Content-Length is never cached, and the error says so."""
    def short(server, connection):
        server.send(connection, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcd")
        return False
    server = hostile({"/d/": listing(["short.bin"]), "/d/short.bin": short})
    with pytest.raises(DataFileError, match="ended after 4 of the 10 bytes its server announced") as error:
        list(dataset(server.url + "/d/", tmp_path, retries=0))
    assert f"'{server.url}/d/short.bin'" in str(error.value)
    assert not list((tmp_path / "cache" / "files").iterdir())


# ----------------------------------------------------------------- keep-alive desync


def test_bytes_after_an_answer_never_become_the_next_file(hostile, tmp_path):
    """A server that sends a forged answer after a real one: read as the answer to the next
    request on that connection, it was cached as that file. A connection with bytes nobody
    asked for is dropped instead."""
    def first_then_forged(server, connection):
        return (server.send(connection, answer(b"first")) and not server.stopping.wait(0.05)
                and server.send(connection, answer(b"EVIL")))
    server = hostile({"/d/": listing(["a_first.bin", "b_ok.bin"]), "/d/a_first.bin": first_then_forged,
                      "/d/b_ok.bin": serve(b"ok")})

    def slow_read(path: str) -> bytes:
        time.sleep(0.3)  # the forged answer arrives while the first file is read
        return read(path)

    ds = dataset(server.url + "/d/", tmp_path, prefetch=0, cache_threads=1, transform=slow_read)
    assert list(ds) == [b"first", b"ok"]
    assert server.connections_serving({"/d/a_first.bin", "/d/b_ok.bin"}) == 2


@pytest.mark.parametrize("fields, why", [
    ("Content-Length: 3xyz\r\n", "gives a Content-Length of '3xyz', which is not one number of bytes"),
    ("Content-Length: 3, 6\r\n", "gives a Content-Length of '3, 6', which is not one number of bytes"),
    ("Content-Length: 3\r\nContent-Length: 6\r\n", "gives Content-Length twice ('3' and '6')"),
])
def test_a_content_length_that_is_not_one_number_is_an_error(hostile, tmp_path, fields, why):
    """A Content-Length that is not one plain number, or that comes twice, frames the body in
    a way no client can trust: the file fails, naming the field, instead of a guess being cached."""
    server = hostile({"/d/": listing(["bad.bin"]), "/d/bad.bin": serve(b"abcdefgh", fields=fields)})
    with pytest.raises(DataFileError, match=why.replace("(", r"\(").replace(")", r"\)")) as error:
        list(dataset(server.url + "/d/", tmp_path, retries=0))
    assert f"The answer for '{server.url}/d/bad.bin'" in str(error.value)
    assert not list((tmp_path / "cache" / "files").iterdir())


# ----------------------------------------------------------------- URLs from a listing


def test_an_href_with_a_cr_lf_is_refused_naming_the_entry(hostile, tmp_path):
    """A listing's href with CR LF would end the request line and add a header of the server's
    choosing. The listing is refused, naming the entry, and nothing is requested with it."""
    server = hostile({"/d/": listing(["ok.bin", "evil.bin\r\nX-Injected: 1"]), "/d/ok.bin": serve(b"ok")})
    with pytest.raises(DataSourceError, match="has an entry with a control character") as error:
        dataset(server.url + "/d/", tmp_path)
    assert repr(f"{server.url}/d/evil.bin\r\nX-Injected: 1") in str(error.value)
    assert not any("X-Injected" in request for _, request in server.requests)


def test_the_engine_refuses_a_url_with_a_control_character(hostile, tmp_path):
    """The engine checks too, whatever gave it the URL: the error names the URL, escaped."""
    server = hostile({})
    cache = _core.FileCache(str(tmp_path / "cache"), 0, 1, 1, FsspecFetch({}, {}), native_http=True)
    try:
        with pytest.raises(EngineInvalidArgument, match="holds a control character") as error:
            cache.acquire(server.url + "/a.bin\r\nX-Injected: 1", "a.bin", -1)
        assert f"'{server.url}/a.bin\\x0d\\x0aX-Injected: 1'" in str(error.value)
    finally:
        cache.close()
    assert server.requests == []


def test_a_space_in_an_href_is_percent_encoded(hostile, tmp_path):
    """'sp ace.bin' was requested as '/index2/sp', another file. The path is percent-encoded."""
    server = hostile({"/index2/": listing(["sp ace.bin"]), "/index2/sp%20ace.bin": serve(b"the file with a space"),
                      "/index2/sp": serve(b"another file")})
    assert list(dataset(server.url + "/index2/", tmp_path)) == [b"the file with a space"]
    assert "/index2/sp%20ace.bin" in server.targets() and "/index2/sp" not in server.targets()


# ----------------------------------------------------------------- stalls and endless answers

HEAD_100 = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"


def head_then_slow_body(server, connection):
    return server.send(connection, HEAD_100) and slowly(b"x" * 100)(server, connection)


@pytest.mark.parametrize("handler", [silent, slowly(HEAD_100), head_then_slow_body], ids=["silent", "slow head", "slow body"])
def test_a_fetch_a_byte_a_second_meets_its_deadline(hostile, tmp_path, handler):
    """A server sending a byte a second, or nothing, kept a fetch alive for ever; fetch_timeout
    bounds each attempt, and the error names the URL and the limit."""
    server = hostile({"/d/": listing(["slow.bin"]), "/d/slow.bin": handler})
    ds = dataset(server.url + "/d/", tmp_path, retries=0, fetch_timeout=1.5, min_fetch_rate=None)
    start = time.monotonic()
    with pytest.raises(DataFileError, match=r"was not fetched within its deadline of 1\.5 s") as error:
        list(ds)
    assert 1.4 < time.monotonic() - start < 5.0
    assert f"'{server.url}/d/slow.bin'" in str(error.value) and "fetch_timeout" in str(error.value)


LISTING = answer(b'<html><body><a href="a.bin">a.bin</a></body></html>',
                 fields="Content-Type: text/html\r\nContent-Length: 51\r\n")


@pytest.mark.parametrize("handler", [silent, slowly(LISTING)], ids=["silent", "trickling"])
def test_a_listing_meets_fetch_timeout_and_names_the_url(hostile, tmp_path, handler):
    """The listing (fsspec's) waited aiohttp's 300 s on a server that accepts and says nothing,
    or trickles, whatever fetch_timeout said, then raised an FSTimeoutError with no message.
    Each of its requests now has fetch_timeout, and the error names the URL and the wait."""
    server = hostile({"/d/": handler})
    start = time.monotonic()
    with pytest.raises(DataSourceError, match=r"got no whole answer from its server within fetch_timeout=2 s, "
                                              r"after \d+\.\d s of waiting") as error:
        dataset(server.url + "/d/", tmp_path, fetch_timeout=2)
    assert 1.9 < time.monotonic() - start < 60
    assert f"The listing of '{server.url}/d/'" in str(error.value)


def test_a_files_size_meets_fetch_timeout(hostile, tmp_path):
    """A single file's source asks its size with a HEAD request, which waited 300 s on a server
    that never answers it. It now waits fetch_timeout, and fsspec asks with a GET instead."""
    server = hostile({"/a.bin": serve(b"abc")}, heads={"/a.bin": silent})
    start = time.monotonic()
    ds = dataset(server.url + "/a.bin", tmp_path, fetch_timeout=2)
    assert 1.9 < time.monotonic() - start < 60
    assert ds.files == [server.url + "/a.bin"] and list(ds) == [b"abc"]


@pytest.fixture
def never_accepting():
    """The URL of a port on 127.0.0.1 whose accept queue is full: the kernel drops every further
    handshake, so a connection to it never completes."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
    yield f"http://127.0.0.1:{port}"
    for filler in fillers:
        filler.close()
    listener.close()


def test_a_connection_never_completed_meets_fetch_timeout(never_accepting, tmp_path):
    """The engine's connection has fetch_timeout too, and says so; so has the listing's."""
    cache = _core.FileCache(str(tmp_path / "cache"), 0, 1, 1, FsspecFetch({}, {}), native_http=True,
                            **engine_http_options(2.0, None))
    try:
        start = time.monotonic()
        with pytest.raises(EngineOSError, match=r"was not connected to within its deadline of 2 s: .*fetch_timeout"):
            cache.acquire(never_accepting + "/a.bin", "a.bin", -1)
        assert 1.9 < time.monotonic() - start < 60
    finally:
        cache.close()
    with pytest.raises(DataSourceError, match=rf"The listing of '{never_accepting}/d/' got no whole answer from its "
                                              rf"server within fetch_timeout=2 s"):
        dataset(never_accepting + "/d/", tmp_path, fetch_timeout=2)


@pytest.mark.parametrize("handler", [silent, head_then_slow_body], ids=["silent", "trickling"])
def test_a_fetch_by_fsspec_meets_fetch_timeout_and_names_the_url(hostile, tmp_path, handler):
    """With storage options, fsspec fetches the files: each attempt within fetch_timeout too."""
    server = hostile({"/d/": listing(["slow.bin"]), "/d/slow.bin": handler})
    ds = dataset(server.url + "/d/", tmp_path, retries=0, fetch_timeout=2,
                 storage_options={"headers": {"X-Fanrun-Test": "1"}})
    start = time.monotonic()
    with pytest.raises(DataFileError, match=r"got no whole answer from its server within fetch_timeout=2 s") as error:
        list(ds)
    assert 1.9 < time.monotonic() - start < 60
    assert f"The fetch of '{server.url}/d/slow.bin'" in str(error.value)


@pytest.mark.parametrize("handler", [slowly(HEAD_100), head_then_slow_body], ids=["slow head", "slow body"])
def test_a_fetch_a_byte_a_second_fails_the_minimum_rate(hostile, tmp_path, handler):
    """min_fetch_rate=(bytes/s, seconds) ends a fetch that stays slower than that, before any
    deadline."""
    server = hostile({"/d/": listing(["slow.bin"]), "/d/slow.bin": handler})
    ds = dataset(server.url + "/d/", tmp_path, retries=0, fetch_timeout=None, min_fetch_rate=(100, 1))
    start = time.monotonic()
    with pytest.raises(DataFileError, match="came at less than 100 bytes/s for 1 s") as error:
        list(ds)
    assert time.monotonic() - start < 5.0
    assert f"'{server.url}/d/slow.bin'" in str(error.value) and "min_fetch_rate" in str(error.value)


def test_limits_that_make_no_sense_are_refused(tmp_path):
    for bad in ({"fetch_timeout": 0}, {"fetch_timeout": -1.0}, {"min_fetch_rate": 1024},
                {"min_fetch_rate": (0, 10)}, {"min_fetch_rate": (1024, 0)}):
        with pytest.raises(ValueError, match="fetch_timeout|min_fetch_rate"):
            VolumeDataset(str(tmp_path), **bad)


def test_an_endless_chunked_body_stops_at_the_cache_limit(hostile, tmp_path):
    """A chunked answer that never ends was written to the cache until the disk was full (8.9 GB
    in 30 s). It now stops at the cache's limit, having read little more than that."""
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"e" * (1 << 16))
    server = hostile({"/d/": listing(["endless.bin"]),
                      "/d/endless.bin": endless(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk)})
    with pytest.raises(DataFileError, match="is larger than the cache's limit of 2000000 bytes") as error:
        list(dataset(server.url + "/d/", tmp_path, retries=0, cache_limit="2MB"))
    assert f"'{server.url}/d/endless.bin'" in str(error.value)
    assert server.bytes_sent < BUFFERED_AT_MOST
    assert not list((tmp_path / "cache" / "partial").iterdir())


def test_an_endless_chunked_body_stops_at_the_listed_size(hostile, tmp_path):
    """Where the listing gives a size, a body longer than it stops right there."""
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"e" * (1 << 16))
    server = hostile({"/endless.bin": endless(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk)})
    cache = _core.FileCache(str(tmp_path / "cache"), 0, 1, 1, FsspecFetch({}, {}), native_http=True)
    try:
        with pytest.raises(EngineOSError, match="sent more than the 1000000 bytes its listing gave"):
            cache.acquire(server.url + "/endless.bin", "endless.bin", 1_000_000)
    finally:
        cache.close()
    assert server.bytes_sent < BUFFERED_AT_MOST


def test_a_404_with_an_endless_body_fails_at_once_naming_the_status(hostile, tmp_path):
    """The body of an error answer was read to its end (here, never) before the error came.
    The error now comes with the head, and names the status."""
    server = hostile({"/d/": listing(["gone.bin"]),
                      "/d/gone.bin": endless(b"HTTP/1.1 404 Not Found\r\nContent-Length: 100000000000\r\n\r\n", b"n" * (1 << 16))})
    start = time.monotonic()
    with pytest.raises(DataFileError, match="HTTP 404 Not Found for") as error:
        list(dataset(server.url + "/d/", tmp_path, retries=0))
    assert time.monotonic() - start < 5.0
    assert f"'{server.url}/d/gone.bin'" in str(error.value)
    assert server.bytes_sent < BUFFERED_AT_MOST


def interrupted_after(server: HostileServer, code: str) -> tuple[str, float]:
    """Runs `code` in a process of its own, sends it SIGINT once it waits on a slow file, and
    returns its stderr and the seconds from the signal to its end."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "listed"
        deadline = time.monotonic() + 30
        while not any(target.startswith("/d/slow") for target in server.targets()):
            assert time.monotonic() < deadline, "the files were never asked for"
            time.sleep(0.05)
        time.sleep(0.5)  # the caller is waiting on a slow body now
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=10)
        return stderr, time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def slow_files(hostile) -> HostileServer:
    return hostile({"/d/": listing([f"slow{i}.bin" for i in range(4)]),
                    **{f"/d/slow{i}.bin": head_then_slow_body for i in range(4)}})


def test_ctrl_c_interrupts_a_slow_fetch_within_a_second(hostile, tmp_path):
    """SIGINT (Ctrl+C, or a Jupyter kernel's interrupt) reached a caller waiting in the engine
    only when the fetch ended, which a server sending a byte a second never lets happen. The
    caller now gets KeyboardInterrupt at once, and the process exits without waiting for the
    fetches still in flight on the cache's threads."""
    server = slow_files(hostile)
    stderr, took = interrupted_after(server, textwrap.dedent(
        f"""
        from fanrun.data import VolumeDataset
        ds = VolumeDataset({server.url + "/d/"!r}, cache_dir={str(tmp_path / "cache")!r}, shuffle=False)
        print("listed", flush=True)
        list(ds)
        """
    ))
    assert "KeyboardInterrupt" in stderr, stderr
    assert took < 2.0, f"{took:.2f} s from SIGINT to the end of the process"


def test_ctrl_c_in_a_fetch_by_fsspec_is_not_taken_for_a_failed_attempt(hostile, tmp_path):
    """A KeyboardInterrupt raised inside fsspec's fetch (storage_options given) was taken for a
    failed attempt and tried again. It now reaches the caller at once. (fsspec's fetches still
    in flight on the cache's threads are waited for at exit: the process ends here by
    os._exit.)"""
    server = slow_files(hostile)
    stderr, took = interrupted_after(server, textwrap.dedent(
        f"""
        import os, sys
        from fanrun.data import VolumeDataset
        ds = VolumeDataset({server.url + "/d/"!r}, cache_dir={str(tmp_path / "cache")!r}, shuffle=False,
                           storage_options={{"headers": {{"X-Fanrun-Test": "1"}}}})
        print("listed", flush=True)
        try:
            list(ds)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", file=sys.stderr, flush=True)
            os._exit(1)
        """
    ))
    assert "KeyboardInterrupt" in stderr, stderr
    assert took < 2.0, f"{took:.2f} s from SIGINT to the end of the process"


# ----------------------------------------------------------------- https and proxies


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A CA of the test's own, and a certificate it signed for 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = tmp_path_factory.mktemp("certificates")
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                          content_commitment=False, key_encipherment=False,
                                                          data_encipherment=False, key_agreement=False,
                                                          encipher_only=False, decipher_only=False), critical=True)
        else:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                            critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("fanrun test CA", ca_key, "fanrun test CA", ca_key, ca=True)
    leaf = certificate("127.0.0.1", server_key, "fanrun test CA", ca_key, ca=False)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "server.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (directory / "server.key").write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "server.pem", directory / "server.key")
    return directory / "ca.pem", context


def test_https_is_fetched_by_the_engine_trusting_ssl_cert_file(hostile, tmp_path, certificates):
    """https:// files come through the engine (libcurl), not fsspec, and trust the certificate
    authorities of SSL_CERT_FILE, as Python's ssl (and so the listing) does. In a process of
    its own: aiohttp reads SSL_CERT_FILE once, when it is imported."""
    ca_file, context = certificates
    contents = {f"s{i}.bin": bytes([i]) * 5000 for i in range(5)}
    server = hostile(files("/d", contents), tls=context)
    env = {name: value for name, value in os.environ.items() if name not in ("CURL_CA_BUNDLE", "SSL_CERT_DIR")}
    code = textwrap.dedent(
        f"""
        from fanrun.data import VolumeDataset
        ds = VolumeDataset({server.url + "/d/"!r}, cache_dir={str(tmp_path / "cache")!r}, shuffle=False,
                           transform=lambda path: open(path, "rb").read())
        print(repr(list(ds)))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], env={**env, "SSL_CERT_FILE": str(ca_file)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr([contents[name] for name in sorted(contents)])
    file_requests = [request for _, request in server.requests if request.split(" ")[1] != "/d/"]
    assert len(file_requests) == 5 and all("User-Agent: fanrun\r\n" in request for request in file_requests)


def test_with_no_variable_set_the_engine_trusts_the_systems_bundle(monkeypatch):
    """The wheel's libcurl, built on a RHEL-like system, would look for its authorities at
    RHEL's path alone: the engine is handed this system's bundle, wherever it keeps it."""
    for name in ("CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    ca_file = engine_http_options(60.0, None)["ca_file"]
    assert ca_file and os.path.isfile(ca_file), ca_file
    monkeypatch.setenv("SSL_CERT_DIR", "/etc/ssl/certs")  # a directory named: that one alone
    assert engine_http_options(60.0, None)["ca_file"] == ""


def test_https_trusts_curl_ca_bundle_and_refuses_an_unknown_authority(hostile, tmp_path, certificates, monkeypatch):
    """CURL_CA_BUNDLE comes before SSL_CERT_FILE; a server whose authority is not trusted is an
    error naming the URL and what to set."""
    ca_file, context = certificates
    server = hostile({"/a.bin": serve(b"secret")}, tls=context)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", "/nonexistent/ca.pem")
    monkeypatch.setenv("CURL_CA_BUNDLE", str(ca_file))
    trusting = _core.FileCache(str(tmp_path / "trusting"), 0, 1, 1, FsspecFetch({}, {}), native_http=True,
                               **engine_http_options(60.0, None))
    try:
        assert read(trusting.acquire(server.url + "/a.bin", "a.bin", -1)) == b"secret"
    finally:
        trusting.close()
    system = _core.FileCache(str(tmp_path / "system"), 0, 1, 1, FsspecFetch({}, {}), native_http=True)
    try:
        with pytest.raises(EngineOSError, match="was not verified") as error:
            system.acquire(server.url + "/a.bin", "a.bin", -1)
        assert f"The certificate of '{server.url}/a.bin'" in str(error.value)
        assert "SSL_CERT_FILE or CURL_CA_BUNDLE" in str(error.value)
    finally:
        system.close()


def test_the_engine_fetches_through_the_proxy_of_the_environment(hostile, tmp_path, monkeypatch):
    """With http_proxy set, the engine (not fsspec, as before) fetches, through that proxy, as
    libcurl reads the variable. The listing, fsspec's, goes as aiohttp goes: direct."""
    origin = hostile({"/d/": listing(["a.bin"]), "/d/a.bin": serve(b"direct")})
    proxy = hostile({f"{origin.url}/d/a.bin": serve(b"through the proxy")})
    monkeypatch.setenv("http_proxy", proxy.url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert list(dataset(origin.url + "/d/", tmp_path)) == [b"through the proxy"]
    assert proxy.targets() == [f"{origin.url}/d/a.bin"]
    assert "User-Agent: fanrun\r\n" in proxy.requests[0][1]
