"""What the HTTP protocol refuses before the app runs, in OpenAI's error JSON (uvicorn answers
plain text): headers past `MAX_HEADER_BYTES` (431), what is not HTTP (400); and clients too slow
to send their request: its headers (408 from the protocol, however the bytes trickle in, on a
new connection or a kept-alive one) or its body (408 from the app). Raw sockets, as such
clients are."""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_harness import Running, small_engine

from jkv.serve.body import MAX_HEADER_BYTES
from jkv.serve.server import Server

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def running(demo_params):
    server = Running(Server(demo_params, small_engine(demo_params), request_timeout=TIMEOUT_S))
    yield server
    server.stop()


def connect(running) -> socket.socket:
    url = urlsplit(running.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.settimeout(10 * TIMEOUT_S)
    return sock


def until_closed(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def error_in(response: bytes, status: int) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), response[:300]
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


@pytest.mark.parametrize("size", [2**20, 2 * MAX_HEADER_BYTES], ids=["1MiB", "2x"])
def test_headers_past_the_limit_are_431_and_garbage_400_in_openai_json(running, size):
    key = "Bearer sk-" + "x" * size  # 2x may come whole in one read: the app refuses it then
    r = httpx.get(running.url + "/v1/models", headers={"authorization": key}, timeout=30)
    assert r.status_code == 431, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "request_header_fields_too_large", error
    assert f"{MAX_HEADER_BYTES:,} bytes" in error["message"]
    ok = "Bearer sk-" + "x" * (MAX_HEADER_BYTES // 2)
    assert httpx.get(running.url + "/health", headers={"authorization": ok}).status_code == 200
    with connect(running) as sock:
        sock.sendall(b"HELLO THERE\r\n\r\n")
        assert error_in(until_closed(sock), 400)["code"] == "invalid_http_request"
    assert httpx.get(running.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("how", ["nothing", "half the headers", "a byte at a time"])
def test_a_client_slow_to_send_its_headers_gets_408(running, how):
    request = b"GET /health HTTP/1.1\r\nHost: jkv\r\nUser-Agent: slow\r\n\r\n"
    with connect(running) as sock:
        t0 = time.monotonic()
        if how == "half the headers":
            sock.sendall(request[:30])
        elif how == "a byte at a time":  # each byte well within the limit: the sum is not
            for byte in request[:-2]:
                if select.select([sock], [], [], TIMEOUT_S / 8)[0]:  # answered
                    break
                sock.sendall(bytes([byte]))
        error = error_in(until_closed(sock), 408)
        assert time.monotonic() - t0 < 3 * TIMEOUT_S
    assert error["code"] == "request_timeout" and "--request-timeout" in error["message"]


def test_a_kept_alive_connection_gets_408_for_its_next_requests_headers(running):
    request = b"GET /health HTTP/1.1\r\nHost: jkv\r\n\r\n"
    with connect(running) as sock:
        sock.sendall(request)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b'{"status":"ok"}'), first
        t0 = time.monotonic()
        sock.sendall(request[:20])
        error_in(until_closed(sock), 408)
        assert time.monotonic() - t0 < 3 * TIMEOUT_S


def test_a_client_slow_to_send_its_body_gets_408(running):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: jkv\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")  # fmt: skip
    with connect(running) as sock:
        t0 = time.monotonic()
        sock.sendall(head + b'{"model": "jkv-demo", ')
        error = error_in(until_closed(sock), 408)  # and the connection closes
        assert time.monotonic() - t0 < 3 * TIMEOUT_S
    assert error["code"] == "request_timeout" and "22 bytes came" in error["message"], error
