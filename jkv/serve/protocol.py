"""uvicorn's HTTP/1.1 protocol (h11) with the limits a public server needs before the app runs.

- A request line and headers past `body.MAX_HEADER_BYTES` get 431 (those that arrive whole in
  one read: `body.HeaderLimit`, in the app), anything else h11 cannot parse 400, both in
  OpenAI's error JSON (uvicorn answers plain text), and the connection closes.
- A client that has not sent its request line and headers within `request_timeout` seconds (of
  connecting, or of its previous response) gets 408 and the connection closes: a slow client
  holds no connection for long. The body's own time limit is the app's (`body.read`: 408).

`config(server, ...)` is uvicorn's `Config` for a `jkv.serve.server.Server` with this protocol;
`jkv serve` and the tests' servers use it. The protocol is uvicorn's `H11Protocol`, always (not
httptools, which uvicorn prefers when it is installed), so these limits hold everywhere. uvicorn
and h11 (the serve extra) are imported where they are used, so that `import jkv.cli` stays light.
"""

from __future__ import annotations

import http
import json

from jkv.serve.body import MAX_HEADER_BYTES, headers_too_large
from jkv.serve.openai import APIError

LINGER_S = 1.0  # after refusing a request: its remaining bytes are read (and dropped) this long


def config(server, **kwargs):
    """uvicorn's `Config` for `server.app` with `protocol(server.request_timeout)`."""
    import uvicorn

    return uvicorn.Config(server.app, http=protocol(server.request_timeout),
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **kwargs)  # fmt: skip


def protocol(request_timeout: float) -> type:
    """uvicorn's `H11Protocol` with OpenAI-style refusals and a deadline for each request's
    headers (`request_timeout` seconds)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self._deadline = None
            self._refused = False
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:  # answered already: the rest is dropped until the close
                return
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # its headers are in: the app's now
                self._disarm()
            elif self._deadline is None and not self._refused and not self.transport.is_closing():
                self._arm()  # a new request's (a byte at a time never pushes it back)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # the next request's, from now

        def shutdown(self) -> None:
            if self._refused:  # its answer is sent; h11 may be past sending a close
                self.transport.close()
                return
            super().shutdown()

        def send_400_response(self, msg: str) -> None:
            """What h11 cannot parse: 431 when the headers outgrew its buffer, else 400."""
            if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
                self._refuse(headers_too_large())
            else:
                self._refuse(APIError(400, "the request is not valid HTTP/1.1",
                                      code="invalid_http_request"))  # fmt: skip

        def _timed_out(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._refuse(APIError(408, "the request's headers did not arrive within "
                                      f"{request_timeout:g} s (jkv serve --request-timeout)",
                                      code="request_timeout"))  # fmt: skip

        def _refuse(self, err: APIError) -> None:
            """`err` as OpenAI's error JSON, then the connection closes (after `LINGER_S` of
            reading, so that a client still sending gets the answer rather than a reset)."""
            self._disarm()
            self._refused = True
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]  # fmt: skip
            reason = http.HTTPStatus(err.status).phrase.encode()
            try:
                out = self.conn.send(h11.Response(status_code=err.status, headers=headers,
                                                  reason=reason))  # fmt: skip
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError:  # a response under way already: only the close
                out = b""
            self.transport.write(out)
            self.loop.call_later(LINGER_S, self.transport.close)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

    return Protocol
