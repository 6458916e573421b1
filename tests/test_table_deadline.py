"""fetch_timeout of a remote table, against servers on 127.0.0.1 that accept and then stay silent
or trickle a byte a second: over http(s) while the table is listed, while a footer is read and
while a file is fetched; over S3 at an endpoint that never answers, for pyarrow (the listing and
the files) and for deltalake (a Delta log). Each wait ends in an error naming the URL, the limit
and the time waited, within a few times fetch_timeout."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import threading
import time

import pytest
from test_faults_http import answer, hostile, listing, silent, slowly  # noqa: F401  (hostile: the fixture)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from fanrun.data import TableDataset, TableError  # noqa: E402
from fanrun.data._table_deadline import delta_options  # noqa: E402

# Waits end within this: the clients' retries of a request that timed out, under a loaded machine.
AT_MOST_S = 60


def parquet_bytes() -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(300))}), sink, row_group_size=100)
    return sink.getvalue()


def ranged(data: bytes, stalled: threading.Event, then=silent):
    """Serves `data`, a Range request its part (fsspec reads a footer so), until `stalled` is set;
    then answers as `then` does. Requests come one at a time while a table is opened, so the last
    one recorded is the one answered."""
    def handler(server, connection) -> bool:
        if stalled.is_set():
            return then(server, connection)
        head = server.requests[-1][1]
        match = re.search(r"(?im)^range: bytes=(\d+)-(\d*)", head)
        if match is None:
            return server.send(connection, answer(data))
        start = int(match[1])
        end = min(len(data), int(match[2]) + 1 if match[2] else len(data))
        fields = f"Content-Length: {end - start}\r\nContent-Range: bytes {start}-{end - 1}/{len(data)}\r\n"
        return server.send(connection, answer(data[start:end], "206 Partial Content", fields))
    return handler


def size_of(data: bytes):
    def handler(server, connection) -> bool:
        return server.send(connection, f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\nAccept-Ranges: bytes\r\n\r\n"
                           .encode())
    return handler


def opened_within(url: str, tmp_path, **kwargs) -> TableError:
    start = time.monotonic()
    with pytest.raises(TableError) as error:
        TableDataset(url, cache_dir=tmp_path / "cache", fetch_timeout=2, **kwargs)
    assert 1.9 < time.monotonic() - start < AT_MOST_S
    return error.value


@pytest.mark.parametrize("handler", [silent, slowly(answer(b"<html></html>"))], ids=["silent", "trickling"])
def test_an_http_listing_meets_fetch_timeout_and_names_the_url(hostile, tmp_path, handler):  # noqa: F811 (the fixture)
    """The listing waited aiohttp's 300 s on a server that accepts and says nothing, or trickles."""
    server = hostile({"/t/": handler})
    error = opened_within(server.url + "/t/", tmp_path)
    assert re.search(rf"Opening the table '{server.url}/t/' got no whole answer from its server within "
                     rf"fetch_timeout=2 s for each request, after \d+\.\d s of waiting", str(error)), error


@pytest.mark.parametrize("handler", [silent, slowly(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n\r\n")],
                         ids=["silent", "trickling"])
def test_an_http_footer_meets_fetch_timeout_and_names_the_url(hostile, tmp_path, handler):  # noqa: F811 (the fixture)
    """The table is listed and its file's size known; the read of its footer never completes."""
    data = parquet_bytes()
    server = hostile({"/t/": listing(["a.parquet"]), "/t/a.parquet": handler}, heads={"/t/a.parquet": size_of(data)})
    error = opened_within(server.url + "/t/", tmp_path)
    assert f"Opening the table '{server.url}/t/'" in str(error) and "fetch_timeout=2 s" in str(error)


def test_the_footer_of_a_later_file_names_that_file(hostile, tmp_path):  # noqa: F811 (the fixture)
    """The table's schema comes from its first file; the second file's footer never comes, and
    the error names that file."""
    data = parquet_bytes()
    server = hostile({"/t/": listing(["a.parquet", "b.parquet"]), "/t/a.parquet": ranged(data, threading.Event()),
                      "/t/b.parquet": silent},
                     heads={"/t/a.parquet": size_of(data), "/t/b.parquet": size_of(data)})
    error = opened_within(server.url + "/t/", tmp_path)
    assert re.search(rf"The footer of '{server.url}/t/b.parquet' got no whole answer from its server within "
                     rf"fetch_timeout=2 s", str(error)), error


@pytest.mark.parametrize("then", [silent, slowly(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)],
                         ids=["silent", "trickling"])
@pytest.mark.parametrize("storage_options", [{}, {"headers": {"X-Fanrun-Test": "1"}}], ids=["engine", "fsspec"])
def test_an_http_file_whose_server_falls_silent_meets_fetch_timeout(
        hostile, tmp_path, storage_options, then):  # noqa: F811 (the fixture)
    """The table opens (listing, size, footer); its file's fetch into the cache, by the engine or
    by fsspec where storage options are given, meets a server gone silent, or sending a byte a
    second."""
    data = parquet_bytes()
    stalled = threading.Event()
    server = hostile({"/t/": listing(["a.parquet"]), "/t/a.parquet": ranged(data, stalled, then)},
                     heads={"/t/a.parquet": size_of(data)})
    dataset = TableDataset(server.url + "/t/", cache_dir=tmp_path / "cache", fetch_timeout=2,
                           storage_options=storage_options)
    assert dataset.num_rows == 300
    stalled.set()
    start = time.monotonic()
    with pytest.raises(TableError) as error:
        list(dataset)
    assert 1.9 < time.monotonic() - start < AT_MOST_S
    assert f"'{server.url}/t/a.parquet'" in str(error.value) and "fetch_timeout" in str(error.value), error.value


@pytest.fixture
def silent_endpoint():
    """http://127.0.0.1:PORT of a TCP server that takes every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # the listener was shut down
            held.append(connection)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.shutdown(socket.SHUT_RDWR)  # wakes accept(), which closing alone does not
    acceptor.join()
    listener.close()
    for connection in held:
        connection.close()


def s3_options(endpoint: str) -> dict:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


def test_an_s3_endpoint_that_never_answers_meets_fetch_timeout(silent_endpoint, tmp_path):
    """pyarrow's S3 client gave up after its own limits (3 s a request, 3 attempts) with an OSError
    that named neither the table nor a limit; a shorter fetch_timeout now shortens its requests,
    and the error is a TableError that names the table, the limit and the time waited."""
    error = opened_within("s3://lake/events", tmp_path, storage_options=s3_options(silent_endpoint))
    assert re.search(r"Opening the table 's3://lake/events' got no whole answer from its server within "
                     r"fetch_timeout=2 s for each request, after \d+\.\d s", str(error)), error


def test_a_delta_log_over_s3_meets_fetch_timeout(silent_endpoint):
    """deltalake's requests to the store are given fetch_timeout, its retries of one request too:
    with its defaults (30 s a request, retried for up to 180 s), a silent store held it minutes."""
    from deltalake import DeltaTable

    options = delta_options("s3://lake/events", s3_options(silent_endpoint), 2)
    start = time.monotonic()
    with pytest.raises(OSError, match="timed out"):
        DeltaTable("s3://lake/events", storage_options=options)
    assert time.monotonic() - start < 10


def test_a_timeout_given_in_storage_options_stays_the_callers():
    options = delta_options("s3://lake/events", {"timeout": "5s"}, 2)
    assert options == {"timeout": "5s", "retry_timeout": "2000ms"}
    assert delta_options("/local/table", {}, 2) == {} and delta_options("s3://lake/t", {}, None) == {}


def test_fetch_timeout_shortens_the_s3_clients_limits_never_lengthens_them():
    """The default hour would have held a silent S3 store three attempts of an hour in pyarrow
    (whose own stall limit is 3 s) and a Delta log's request an hour (object_store's: 30 s)."""
    from fanrun.data._table_store import open_store

    assert delta_options("s3://lake/t", {}, 3600) == {}
    assert delta_options("s3://lake/t", {}, 60) == {"retry_timeout": "60000ms"}
    options = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1"}
    default = open_store("s3://lake/t", options, None).filesystem
    assert open_store("s3://lake/t", options, 3600).filesystem.equals(default)
    assert not open_store("s3://lake/t", options, 0.5).filesystem.equals(default)


def test_a_fetch_timeout_that_makes_no_sense_is_refused(tmp_path):
    for bad in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="fetch_timeout must be a number of seconds above 0"):
            TableDataset(str(tmp_path), fetch_timeout=bad)


@pytest.fixture
def s3_table(tmp_path):
    """s3://lake/events, a Delta table of 300 rows in one file, on a real S3 server process."""
    pytest.importorskip("deltalake")
    pytest.importorskip("boto3")
    from deltalake import write_deltalake
    from s3_server import S3Server

    local = tmp_path / "events"
    write_deltalake(str(local), pa.table({"id": list(range(300))}))
    server = S3Server(tmp_path)
    try:
        server.upload(local, "lake", "events")
        yield server
    finally:
        server.stop()


def test_an_s3_file_whose_server_stops_answering_meets_fetch_timeout(s3_table, tmp_path):
    """The Delta table opens (its log through deltalake given fetch_timeout, which it accepts, a
    timeout of the caller's own in the dict too); then the server stops (SIGSTOP: the kernel still
    takes connections, nothing answers), and the file's fetch into the cache ends within its
    attempts' fetch_timeout, naming the file."""
    options = {**s3_table.storage_options(), "timeout": "30s"}
    dataset = TableDataset("s3://lake/events", storage_options=options, cache_dir=tmp_path / "cache", fetch_timeout=2)
    assert dataset.num_rows == 300
    os.killpg(s3_table.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TableError) as error:
            list(dataset)
        assert 1.9 < time.monotonic() - start < AT_MOST_S
    finally:
        os.killpg(s3_table.process.pid, signal.SIGCONT)
    assert re.search(r"The fetch of 's3://lake/events/[^']+\.parquet' got no whole answer from its server within "
                     r"fetch_timeout=2 s", str(error.value)), error.value
