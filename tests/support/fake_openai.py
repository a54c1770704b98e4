"""A minimal OpenAI-compatible chat completions server over TLS, for the agent SDK tests.

It answers ``POST /v1/chat/completions`` with a valid completion (with ``"stream": true``, as
server-sent events in chunks some milliseconds apart, the way a model streams tokens) and records
every request it receives (headers included), so a test can check the credential the broker
injected. The point is the real ``openai`` SDK talking through the broker, not a model: the
completion is fixed.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .certs import TestPKI

COMPLETION_TEXT = "Affidavit fake completion."
#: The streamed completion's pieces, one event each; together they are COMPLETION_TEXT.
STREAM_PIECES = ["Affidavit", " fake", " completion", "."]
STREAM_GAP = 0.05  # seconds between two events


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def completion(model: str) -> dict[str, object]:
    return {
        "id": "chatcmpl-affidavit-test",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": COMPLETION_TEXT},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    }


def stream_events(model: str) -> list[bytes]:
    """The server-sent events of a streamed completion, ``[DONE]`` last."""
    def chunk(delta: dict[str, object], finish: str | None) -> dict[str, object]:
        return {"id": "chatcmpl-affidavit-stream", "object": "chat.completion.chunk", "created": 1_700_000_000,
                "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    events = [chunk({"role": "assistant", "content": ""}, None)]
    events += [chunk({"content": piece}, None) for piece in STREAM_PIECES]
    events.append(chunk({}, "stop"))
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


class FakeOpenAI:
    """``with FakeOpenAI(pki) as fake:`` serves on ``127.0.0.1:fake.port`` with the ``good`` cert."""

    def __init__(self, pki: TestPKI):
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        context = pki.server_context("good")
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner._record(Seen("POST", self.path, list(self.headers.items()), body))
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
                asked = json.loads(body or b"{}")
                model = asked.get("model", "gpt-test")
                if asked.get("stream"):
                    return self._stream(model)
                self._send(200, completion(model))

            def do_GET(self) -> None:
                owner._record(Seen("GET", self.path, list(self.headers.items()), b""))
                self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def _stream(self, model: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in stream_events(model):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(STREAM_GAP)
                self.wfile.write(b"0\r\n\r\n")

            def _send(self, status: int, payload: dict[str, object]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # The handshake happens on the handler's first read, in its own thread, so one stalled
        # client cannot block accept().
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True, do_handshake_on_connect=False)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    @property
    def received(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
