"""A real broker process for end-to-end tests, started exactly as a user starts it.

The test writes an ``affidavit.toml``, exports the token and secret variables, and runs the
installed ``affidavit`` command (``affidavit db upgrade`` first for PostgreSQL, as the docs say,
unless the database is a copy of one at the current schema already). ``affidavit run`` itself
is started as the process it turns into: see :data:`BROKER_COMMAND`.
Everything the process prints goes to a log file the canary tests grep.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import tomli_w

from .envelopes import check_envelope

AFFIDAVIT = str(Path(sys.executable).with_name("affidavit"))
# `affidavit run` re-executes itself as `python -O -m proxy run ...` (same pid; proxy/cli.py,
# _optimized), after importing the command line and the whole broker once for nothing: ~1.1 s
# of CPU per start, for ~140 starts a run. The test brokers start as that second process
# directly; test_run_example_in_an_empty_directory checks that `affidavit run` still becomes
# exactly this command, and the tests that run `affidavit run` themselves still go through it.
BROKER_COMMAND = [sys.executable, "-O", "-m", "proxy"]


def validate_envelopes(response: httpx.Response) -> None:
    """An httpx response hook: a broker-originated failure (it names its ``Affidavit-Code``) must be
    a valid envelope, whatever the test goes on to check. Upstream answers pass untouched."""
    if "affidavit-code" in response.headers and response.headers.get("content-type", "").startswith("application/problem+json"):
        response.read()
        check_envelope(response.content)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` different free ports: each is held while the next is picked (two calls of
    :func:`free_port` can return the same one, and a broker's proxy and API then clash)."""
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


class _PortTaken(Exception):
    """The broker's first start found a listen port taken."""


@dataclass
class Agent:
    name: str
    token: str

    @property
    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.name}:{self.token}".encode()).decode()


@dataclass
class BrokerProcess:
    workdir: Path
    config: dict[str, Any]
    env: dict[str, str]
    agents: dict[str, Agent]
    operator_token: str
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)
    starts: int = 0
    # The database is at the current schema already (a copy of a migrated template): the first
    # start needs no `affidavit db upgrade`, which would find nothing to do.
    migrated: bool = False

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "affidavit.toml"
        self.log_path = self.workdir / "broker.log"
        self.config_path.write_text(tomli_w.dumps(self.config))

    # -- addresses ---------------------------------------------------------------------

    @property
    def proxy_port(self) -> int:
        return int(self.config["proxy"]["listen"].rsplit(":", 1)[1])

    @property
    def api_url(self) -> str:
        return "http://" + self.config["api"]["listen"]

    @property
    def ca_path(self) -> Path:
        return Path(self.config["proxy"]["confdir"]) / "mitmproxy-ca-cert.pem"

    @property
    def database_url(self) -> str:
        return self.config["database"]["url"]

    def proxy_url(self, agent: str = "builder", token: str | None = None) -> str:
        token = token if token is not None else self.agents[agent].token
        return f"http://{agent}:{token}@127.0.0.1:{self.proxy_port}"

    # -- lifecycle ---------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_") and "PROXY" not in k.upper()}
        env.update(self.env)
        return env

    def command(
        self, *args: str, input: bytes | None = None, timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """Run an ``affidavit`` subcommand against this broker's configuration (``env``: more variables)."""
        return subprocess.run(
            [AFFIDAVIT, *args, "--config", str(self.config_path)],
            cwd=self.workdir,
            env={**self._env(), **(env or {})},
            input=input,
            capture_output=True,
            timeout=timeout,
        )

    def start(self, timeout: float = 90.0) -> "BrokerProcess":
        """Start and wait until ready. The bound is generous: on a loaded 2-core machine each
        process of ``--workers 3`` spends ~3 s of CPU importing alone, beside the other tests.

        A first start whose port another test took between :func:`free_port` and the bind (the
        parallel workers share the machine's ports) is tried again on new ports, at most twice."""
        first = self.starts == 0
        for _ in range(2 if first else 0):
            try:
                return self._start(timeout)
            except _PortTaken:
                for section, port in zip(("proxy", "api"), free_ports(2)):
                    self.config[section]["listen"] = f"127.0.0.1:{port}"
                self.config_path.write_text(tomli_w.dumps(self.config))
        return self._start(timeout)

    def _start(self, timeout: float) -> "BrokerProcess":
        if self.database_url.startswith("postgresql") and self.starts == 0 and not self.migrated:
            done = self.command("db", "upgrade")
            assert done.returncode == 0, done.stderr.decode()
        self.starts += 1
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        env = self._env()
        command = [AFFIDAVIT] if env.get("AFFIDAVIT_DEBUG_CHECKS") == "1" else BROKER_COMMAND  # no re-exec then
        self.proc = subprocess.Popen(
            [*command, "run", "--config", str(self.config_path)],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.starts == 1 and b"cannot start:" in (tail := self.log_path.read_bytes()[offset:]) and b"already in use" in tail:
                    self.starts = 0
                    raise _PortTaken(f"the broker exited with {self.proc.returncode}:\n{self.logs()[-3000:]}")
                raise RuntimeError(f"the broker exited with {self.proc.returncode}:\n{self.logs()[-3000:]}")
            if b"proxy listening on" in self.log_path.read_bytes()[offset:]:
                try:
                    if httpx.get(self.api_url + "/readyz", timeout=1).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the broker did not become ready in {timeout}s:\n{self.logs()[-3000:]}")

    def stop(self, timeout: float = 15.0, sig: signal.Signals = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        """``kill -9``: no clean-up, no flush; what is durable is all that survives."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_entries(self) -> list[dict[str, Any]]:
        """The JSON log lines the broker wrote so far (its own, its workers' and their supervisor's)."""
        return [json.loads(line) for line in self.logs().splitlines() if line.startswith("{")]

    # -- clients -----------------------------------------------------------------------

    def client(self, agent: str = "builder", token: str | None = None, **kwargs: Any) -> httpx.Client:
        """An httpx client that goes through the broker and trusts its CA. Every envelope it
        receives is checked against the schema (see :func:`validate_envelopes`)."""
        verify = ssl.create_default_context(cafile=str(self.ca_path))
        return httpx.Client(proxy=self.proxy_url(agent, token), verify=verify, timeout=kwargs.pop("timeout", 20),
                            event_hooks={"response": [validate_envelopes]}, **kwargs)

    def api(self, token: str | None = None) -> httpx.Client:
        token = token if token is not None else self.agents["builder"].token
        return httpx.Client(base_url=self.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10,
                            event_hooks={"response": [validate_envelopes]})

    def operator(self) -> httpx.Client:
        return self.api(self.operator_token)

    def tunnel(self, host: str, port: int = 443, alpn: str = "http/1.1", agent: str = "builder",
               source: str | None = None, timeout: float = 10) -> ssl.SSLSocket:
        """A raw agent's CONNECT tunnel to ``host:port`` with ``agent``'s credentials (from the
        loopback address ``source``, if given), then TLS trusting the broker's CA and offering
        ``alpn`` only (which the broker must pick)."""
        authority = f"{host}:{port}"
        basic = base64.b64encode(f"{agent}:{self.agents[agent].token}".encode()).decode()
        sock = socket.create_connection(("127.0.0.1", self.proxy_port), timeout=timeout,
                                        source_address=(source, 0) if source else None)
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Basic {basic}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.set_alpn_protocols([alpn])
        tls = context.wrap_socket(sock, server_hostname=host)
        assert tls.selected_alpn_protocol() == alpn
        return tls

    def invocation(self, invocation_id: str, token: str | None = None) -> dict[str, Any]:
        with self.api(token) as api:
            response = api.get(f"/v1/invocations/{invocation_id}")
            assert response.status_code == 200, response.text
            return response.json()

    def wait_for(self, invocation_id: str, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Poll the side API until the record satisfies ``predicate`` (bounded)."""
        deadline = time.monotonic() + timeout
        record: dict[str, Any] = {}
        while time.monotonic() < deadline:
            record = self.invocation(invocation_id, self.operator_token)
            if predicate(record):
                return record
            time.sleep(0.05)
        raise AssertionError(f"record did not reach the expected state in {timeout}s: {record}")

    def curl(self, url: str, *args: str, agent: str = "builder", token: str | None = None, timeout: float = 20) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["curl", "-sS", "-i", "--max-time", str(timeout), "-x", self.proxy_url(agent, token), "--cacert", str(self.ca_path), *args, url],
            capture_output=True,
            timeout=timeout + 5,
            env={k: v for k, v in os.environ.items() if "PROXY" not in k.upper()},
        )


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """An HTTP/1 response read raw: its status, its headers (names lower-cased; a repeated one, the
    last) and what came after the head."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ", 2)[1]), headers, body


def big_answer_over_http1(broker: BrokerProcess, size: int, *, read_all: bool, after_head: Any = None) -> tuple[str, int]:
    """GET ``size`` bytes from the plain route's ``/h/big`` with a small receive buffer, so the
    delivery ends only as the agent reads: read it whole, or read its head only and reset the
    connection a second later. ``after_head`` runs once the head is in (a fault to inject while
    the answer is being delivered). (invocation id, body bytes read)"""
    import struct

    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        sock.connect(("127.0.0.1", broker.proxy_port))
        sock.sendall(b"GET http://plain.example.test/h/big?bytes=%d HTTP/1.1\r\nHost: plain.example.test\r\n"
                     b"Proxy-Authorization: Basic %s\r\n\r\n" % (size, basic))
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        head, _, body = data.partition(b"\r\n\r\n")
        invocation_id = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                             if line.lower().startswith(b"affidavit-invocation-id:"))
        if after_head is not None:
            after_head()
        read = len(body)
        if read_all:
            while read < size and (chunk := sock.recv(65536)):
                read += len(chunk)
        else:
            time.sleep(1.0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    return invocation_id, read
