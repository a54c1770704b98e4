"""Real agent clients through a real broker, each configured ONLY by what `affidavit env` prints.

Every client runs in a subprocess whose environment is the machine's minus any proxy or CA
settings, plus the `export` lines of `affidavit env --agent builder --token TOKEN`. Nothing else
tells it about the broker. Each test checks what the upstream received (the credential injected
where the route says, and nowhere else), that the client got `Affidavit-Invocation-Id`, and that
the client never held the secret.

The snippets run here are the ones docs/clients.md shows.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import module_broker
from tests.support.broker import BrokerProcess
from tests.support.canaries import CANARIES
from tests.support.certs import TestPKI
from tests.support.fake_openai import COMPLETION_TEXT, STREAM_GAP, FakeOpenAI, stream_events
from tests.support.hostile import HostileUpstream

PAYMENTS = "https://api.payments.test/h/ok"  # route with an injected credential
OPEN = "https://open.example.test/h/ok"  # route without one
OPENAI_BASE = "https://openai.example.test/v1"  # the fake chat completions server
OPENAI_LOST_BASE = "https://openai-lost.example.test/h/close_after_effect/v1"  # applies, then hangs up
PAYMENTS_SECRET = CANARIES["PAYMENTS_KEY"]
OPENAI_SECRET = CANARIES["BASIC_KEY"]  # the "real OpenAI key" only the broker holds
NODE_SCRIPT = Path(__file__).parent / "support" / "node" / "fetch.mjs"

#: Everything that could configure a client besides `affidavit env`: removed from the base env.
_CLIENT_SETTINGS = {
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
    "NODE_OPTIONS", "NODE_USE_ENV_PROXY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_ORG_ID",
}


def agent_routes(up: HostileUpstream, fake_openai_port: int) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    bearer = {"header": "Authorization", "value": "Bearer {secret}"}
    return [
        {"name": "payments", "host": "api.payments.test", "methods": ["GET", "POST"], "agents": ["builder"],
         "credential": "payments-key", "inject": bearer, "connect_to": good},
        {"name": "open", "host": "open.example.test", "methods": ["GET"], "agents": ["builder"], "connect_to": good},
        {"name": "openai", "host": "openai.example.test", "methods": ["POST"], "path": "/v1/*", "agents": ["builder"],
         "credential": "basic-key", "inject": {**bearer, "placeholder": "Bearer affidavit-placeholder"},
         "connect_to": f"127.0.0.1:{fake_openai_port}"},
        {"name": "openai-lost", "host": "openai-lost.example.test", "methods": ["POST"], "agents": ["builder"],
         "credential": "basic-key", "inject": bearer, "connect_to": good,
         "response_timeout": "5s", "result_horizon": "6s"},
    ]


@pytest.fixture(scope="module")
def fake_openai(pki: TestPKI) -> Iterator[FakeOpenAI]:
    with FakeOpenAI(pki) as server:
        yield server


@pytest.fixture(scope="module")
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI,
           upstream_server: HostileUpstream, fake_openai: FakeOpenAI) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, agent_routes(upstream_server, fake_openai.port),
                             name="agents-clients", dialect="sqlite")


def exports(text: str) -> dict[str, str]:
    """`export K="V"` lines, as a POSIX shell would read them."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        assert line.startswith("export "), f"not an export line: {line!r}"
        name, _, value = line.removeprefix("export ").partition("=")
        [values[name]] = shlex.split(value) or [""]
    return values


@pytest.fixture(scope="module")
def agent_env(broker: BrokerProcess) -> dict[str, str]:
    done = broker.command("env", "--agent", "builder", "--token", broker.agents["builder"].token)
    assert done.returncode == 0, done.stderr.decode()
    printed = exports(done.stdout.decode())
    assert {"HTTPS_PROXY", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS"} <= printed.keys(), printed
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper() and k.upper() not in _CLIENT_SETTINGS}
    env.update(printed)
    assert not any(secret in value for value in env.values() for secret in CANARIES.values()), "the agent must never hold a secret"
    return env


@pytest.fixture
def fresh(upstream: HostileUpstream, fake_openai: FakeOpenAI) -> HostileUpstream:
    fake_openai.reset()
    return upstream


def run(args: list[str], env: dict[str, str], timeout: float = 60, cwd: Path | None = None) -> str:
    done = subprocess.run(args, env=env, capture_output=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, f"{args[0]} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}"
    return done.stdout.decode()


def python(snippet: str, env: dict[str, str], *args: str) -> Any:
    return json.loads(run([sys.executable, "-c", snippet, *args], env).strip().splitlines()[-1])


def check_calls(results: list[dict[str, Any]], upstream: HostileUpstream) -> None:
    """One call to PAYMENTS (credential injected) and one to OPEN (none), in that order."""
    assert [r["status"] for r in results] == [200, 200], results
    for result in results:
        headers = {k.lower(): v for k, v in result["headers"].items()}
        assert headers["affidavit-invocation-id"].startswith("act_"), headers
        assert headers["affidavit-outcome"] == "committed"
        assert PAYMENTS_SECRET not in json.dumps(result), "the client saw the secret"
    echoed = [{k.lower(): v for k, v in json.loads(r["body"])["headers"]} for r in results]
    assert echoed[0]["authorization"] == "[REDACTED]"  # the upstream's echo is redacted for the agent
    assert "authorization" not in echoed[1]
    paid, opened = upstream.received
    assert paid.header("Authorization") == f"Bearer {PAYMENTS_SECRET}"
    assert opened.header("Authorization") is None, "a credential went where no route configures one"
    for seen in (paid, opened):
        assert seen.header("Proxy-Authorization") is None
        others = [v for k, v in seen.headers if k.lower() != "authorization"]
        assert not any(PAYMENTS_SECRET in v for v in others), "the secret leaked into another header"


# -- curl ---------------------------------------------------------------------------------------


def _curl_result(output: bytes) -> dict[str, Any]:
    """`curl -i` through a proxy prints the CONNECT answer first; keep the final response."""
    rest = output
    while True:
        head, _, rest = rest.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200 Connection established"):
            break
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return {"status": int(lines[0].split()[1]), "headers": headers, "body": rest.decode()}


def test_curl(broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream):
    assert shutil.which("curl"), "curl is required (.ci/run installs it)"
    results = []
    for url in (PAYMENTS, OPEN):
        done = subprocess.run(["curl", "-sS", "-i", "--max-time", "20", url], env=agent_env, capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr.decode()
        results.append(_curl_result(done.stdout))
    check_calls(results, fresh)


def test_the_side_api_is_reached_directly_with_the_same_environment(broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream):
    """`affidavit env` sets the proxy for every URL, lower-case http_proxy included, so it must
    also exempt the side API: through the proxy it is a target no route allows."""
    done = subprocess.run(["curl", "-sS", "-i", "--max-time", "20", PAYMENTS], env=agent_env, capture_output=True, timeout=30)
    invocation_id = {k.lower(): v for k, v in _curl_result(done.stdout)["headers"].items()}["affidavit-invocation-id"]
    token = broker.agents["builder"].token
    for client in (
        ["curl", "-sS", "--max-time", "20", "-H", f"Authorization: Bearer {token}", f"{agent_env['AFFIDAVIT_API_URL']}/v1/invocations/{invocation_id}"],
        [sys.executable, "-c", "import os, sys, requests; r = requests.get(sys.argv[1], headers={'Authorization': 'Bearer ' + sys.argv[2]}, timeout=20); print(r.text)",
         f"{agent_env['AFFIDAVIT_API_URL']}/v1/invocations/{invocation_id}", token],
    ):
        record = json.loads(run(client, agent_env))
        assert record["invocation_id"] == invocation_id and record["outcome"] == "committed", record


# -- Python: requests, httpx --------------------------------------------------------------------

REQUESTS_SNIPPET = """
import json, sys, requests
out = []
for url in sys.argv[1:]:
    r = requests.get(url, timeout=20)  # HTTPS_PROXY and REQUESTS_CA_BUNDLE come from the environment
    out.append({"status": r.status_code, "headers": dict(r.headers), "body": r.text})
print(json.dumps(out))
"""

HTTPX_SNIPPET = """
import json, sys, httpx
out = []
with httpx.Client(timeout=20) as client:  # trust_env=True (the default): HTTPS_PROXY, SSL_CERT_FILE
    for url in sys.argv[1:]:
        r = client.get(url)
        out.append({"status": r.status_code, "headers": dict(r.headers), "body": r.text})
print(json.dumps(out))
"""


def test_python_requests(broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream):
    check_calls(python(REQUESTS_SNIPPET, agent_env, PAYMENTS, OPEN), fresh)


def test_python_httpx(broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream):
    check_calls(python(HTTPX_SNIPPET, agent_env, PAYMENTS, OPEN), fresh)


# -- the openai SDK -----------------------------------------------------------------------------

OPENAI_SNIPPET = """
import json, sys, openai

client = openai.OpenAI(
    base_url=sys.argv[1],
    api_key="affidavit-placeholder",  # the route's placeholder: the broker replaces it with the real key
    max_retries=0,  # recovery is proxy.client's job: the SDK's own retries cannot reuse a key
)
raw = client.chat.completions.with_raw_response.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
completion = raw.parse()
print(json.dumps({"content": completion.choices[0].message.content, "status": raw.status_code,
                  "invocation_id": raw.headers.get("affidavit-invocation-id"),
                  "outcome": raw.headers.get("affidavit-outcome"), "sdk_key": client.api_key}))
"""


def test_openai_sdk_gets_a_completion_with_a_key_it_never_held(broker: BrokerProcess, agent_env: dict[str, str],
                                                              fresh: HostileUpstream, fake_openai: FakeOpenAI):
    result = python(OPENAI_SNIPPET, agent_env, OPENAI_BASE)
    assert result["status"] == 200 and result["content"] == COMPLETION_TEXT
    assert result["invocation_id"].startswith("act_") and result["outcome"] == "committed"
    assert OPENAI_SECRET not in json.dumps(result) and result["sdk_key"] == "affidavit-placeholder"
    [seen] = fake_openai.received
    assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
    assert seen.header("Authorization") == f"Bearer {OPENAI_SECRET}"
    assert seen.header("Proxy-Authorization") is None
    assert json.loads(seen.body)["messages"] == [{"role": "user", "content": "hi"}]
    assert broker.invocation(result["invocation_id"])["route"] == "openai"
    assert fresh.received == []


STREAM_SNIPPET = """
import json, sys, time, openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="affidavit-placeholder", max_retries=0)
started = time.monotonic()
raw = client.chat.completions.with_raw_response.create(
    model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True)
arrivals, pieces = [], []
for chunk in raw.parse():
    arrivals.append(time.monotonic() - started)
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
print(json.dumps({"text": "".join(pieces), "status": raw.status_code, "first": arrivals[0], "last": arrivals[-1],
                  "invocation_id": raw.headers.get("affidavit-invocation-id"), "outcome": raw.headers.get("affidavit-outcome")}))
"""


def test_openai_sdk_streaming_gets_the_whole_stream_once_it_is_recorded(
    broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream, fake_openai: FakeOpenAI
):
    """``stream=True`` works through the broker, but not as a stream: the result is durable
    before it is delivered (contract section 6), so the events arrive together once the upstream
    has sent its last one, and the recorded result is the whole event stream."""
    result = python(STREAM_SNIPPET, agent_env, OPENAI_BASE)
    assert result["status"] == 200 and result["text"] == COMPLETION_TEXT, result
    events = stream_events("gpt-test")
    upstream_took = (len(events) - 1) * STREAM_GAP
    assert result["first"] >= upstream_took, "nothing is delivered before the stream is complete and recorded"
    assert result["last"] - result["first"] < upstream_took / 2, "the events are delivered together"
    record = broker.invocation(result["invocation_id"])
    assert record["outcome"] == "committed" and record["evidence"]["framing"] == "chunked", record["evidence"]
    with broker.api() as api:
        replayed = api.get(f"/v1/invocations/{result['invocation_id']}/result")
    assert replayed.status_code == 200 and replayed.headers["content-type"] == "text/event-stream"
    assert replayed.content == b"".join(events)


PLACEHOLDER_SNIPPET = """
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="placeholder")  # sends Authorization: Bearer placeholder
try:
    client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
    print(json.dumps({"raised": None}))
except openai.APIStatusError as exc:
    print(json.dumps({"raised": type(exc).__name__, "status": exc.status_code, "body": exc.response.text,
                      "headers": dict(exc.response.headers)}))
"""


def test_openai_sdk_with_only_a_placeholder_key_is_refused_and_nothing_is_sent(
    broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream, fake_openai: FakeOpenAI
):
    """The SDK always sends `Authorization: Bearer <api_key>`; any value but the route's configured
    placeholder is an attempt to set the injected header: FORBIDDEN_HEADER_OVERRIDE, nothing sent."""
    from proxy.client import Step, after_failure, envelope_of

    result = python(PLACEHOLDER_SNIPPET, agent_env, OPENAI_BASE)
    assert (result["raised"], result["status"]) == ("PermissionDeniedError", 403)
    envelope = envelope_of(result["headers"], result["body"].encode())
    assert envelope is not None and envelope.code.value == "FORBIDDEN_HEADER_OVERRIDE"
    assert after_failure(envelope).step is Step.CORRECT
    assert fake_openai.received == []


LOST_SNIPPET = """
import json, sys, openai
from proxy.client import ReconcileRequired, SideAPI, call_with_recovery
base_url, api_url, retries, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def without_authorization(request):
    request.headers.pop("Authorization", None)

client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=retries,
                       http_client=openai.DefaultHttpxClient(event_hooks={"request": [without_authorization]}))

def send(headers):
    try:
        return client.chat.completions.with_raw_response.create(
            model="gpt-test", messages=[{"role": "user", "content": "pay"}], extra_headers=headers).http_response
    except openai.APIStatusError as exc:
        return exc.response

if key:
    try:
        call_with_recovery(send, SideAPI.from_proxy_url(api_url), key)
        print(json.dumps({"raised": None}))
    except ReconcileRequired as exc:
        print(json.dumps({"raised": "ReconcileRequired", "code": exc.envelope.code.value,
                          "next_action": exc.invocation.next_action.value, "invocation_id": exc.invocation_id}))
else:
    response = send({})
    print(json.dumps({"status": response.status_code, "invocation_id": response.headers.get("affidavit-invocation-id")}))
"""


TIMEOUT_SNIPPET = """
import json, sys, openai
base_url, key = sys.argv[1], sys.argv[2]

def without_authorization(request):
    request.headers.pop("Authorization", None)

# The SDK's default retries, and a timeout shorter than the upstream takes to answer.
client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=0.4,
                       http_client=openai.DefaultHttpxClient(event_hooks={"request": [without_authorization]}))
try:
    client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "pay"}],
                                   extra_headers={"Idempotency-Key": key} if key else None)
    print(json.dumps({"raised": None}))
except openai.APIError as exc:
    print(json.dumps({"raised": type(exc).__name__}))
"""


@pytest.mark.parametrize("key", ["", "chat-order-7"])
def test_openai_sdk_retries_of_its_own_timeouts_are_new_sends_unless_each_call_has_a_key(
    broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream, key: str
):
    """No envelope answers the SDK's own timeout, so x-should-retry cannot stop its retry: without a
    key each one is a new invocation, executed upstream (what docs/clients.md warns of); with an
    Idempotency-Key the broker binds the retries to the first send and the upstream runs it once."""
    result = python(TIMEOUT_SNIPPET, agent_env, "https://openai-lost.example.test/h/slow/v1", key)
    if not key:
        assert result["raised"] == "APITimeoutError", result
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(r.response_status is None for r in fresh.received):
        time.sleep(0.05)  # each send the upstream took is answered after its 1 s
    if key:
        assert fresh.effects == 1, [r.header("Idempotency-Key") for r in fresh.received]
    else:
        assert fresh.effects > 1, "the SDK's own retries went out as new operations"


def test_openai_sdk_lost_response_is_reconciled_not_resent_with_recovery(
    broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream
):
    """The SDK with max_retries=0 plus proxy.client: one send, then ReconcileRequired from the record."""
    result = python(LOST_SNIPPET, agent_env, OPENAI_LOST_BASE, broker.api_url, "0", "chat-order-1")
    assert result["raised"] == "ReconcileRequired"
    assert (result["code"], result["next_action"]) == ("REMOTE_OUTCOME_UNKNOWN", "reconcile")
    [seen] = fresh.received
    assert seen.header("Authorization") == f"Bearer {OPENAI_SECRET}"
    assert seen.header("Idempotency-Key") == "chat-order-1" and fresh.effects == 1


def test_openai_sdk_default_retries_stop_at_an_unknown_outcome(
    broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream
):
    """The SDK retries any 5xx by itself (max_retries=2 by default, no idempotency key), and the
    broker's 502 REMOTE_OUTCOME_UNKNOWN is a 5xx. The envelope carries `x-should-retry: false`
    (anything but retry=backoff), which the SDK obeys: one invocation, one effect, not three."""
    result = python(LOST_SNIPPET, agent_env, OPENAI_LOST_BASE, broker.api_url, "2", "")
    assert result["status"] == 502
    assert len(fresh.received) == 1 and fresh.effects == 1


STATUS_SNIPPET = """
import json, sys, openai
base_url, query = sys.argv[1], json.loads(sys.argv[2])

def without_authorization(request):
    request.headers.pop("Authorization", None)

# The SDK's default retries (2), which repeat any 5xx, 408, 409 and 429 unless x-should-retry says no.
client = openai.OpenAI(base_url=base_url, api_key="unused",
                       http_client=openai.DefaultHttpxClient(event_hooks={"request": [without_authorization]}))
try:
    client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "pay"}], extra_query=query)
    print(json.dumps({"raised": None}))
except openai.APIStatusError as exc:
    print(json.dumps({"status": exc.response.status_code, "should_retry": exc.response.headers.get("x-should-retry")}))
"""


@pytest.mark.parametrize(("query", "should_retry", "effects"), [
    ({"code": "500"}, "false", 1),                                   # committed: the broker says no
    ({"code": "500", "header": "x-should-retry:true"}, "true", 3),   # the remote's own word is kept
    ({"code": "429"}, None, 3),                                      # rejected (no effect claimed): untouched
])
def test_openai_sdk_default_retries_do_not_repeat_a_non_idempotent_call_the_remote_answered_with_a_500(
    broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream, query: dict[str, str],
    should_retry: str | None, effects: int,
):
    """A complete 500 to a POST is a result (committed: the remote ran far enough to answer), and the
    SDK's own loop would send the request twice more as new invocations, each executed upstream (a
    probe saw three). The broker adds `x-should-retry: false` to it; a remote's own x-should-retry,
    and a refusal that claims no effect (429, 503, 4xx), pass through as they are."""
    result = python(STATUS_SNIPPET, agent_env, "https://openai-lost.example.test/h/status/v1", json.dumps(query))
    assert result == {"status": int(query["code"]), "should_retry": should_retry}, result
    assert fresh.effects == effects


# -- Node.js fetch ------------------------------------------------------------------------------


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        message = "node is not installed: the Node.js fetch tests need it (Debian package nodejs)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return node


def _node_version(node: str) -> tuple[int, int]:
    major, minor, *_ = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip().lstrip("v").split(".")
    return int(major), int(minor)


@pytest.fixture(scope="session")
def node_with_undici(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """node, and a directory holding fetch.mjs next to node_modules/undici (npm install, once a session)."""
    node = _node()
    npm = shutil.which("npm")
    assert npm is not None, "npm is required to install undici for the Node.js fetch test"
    directory = tmp_path_factory.mktemp("node")
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "undici@6"], cwd=directory,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, f"npm install undici@6 failed:\n{done.stderr.decode()[-3000:]}"
    shutil.copy(NODE_SCRIPT, directory / NODE_SCRIPT.name)
    return node, directory


def test_node_fetch_with_undici_env_proxy_agent(broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream,
                                               node_with_undici: tuple[str, Path]):
    node, directory = node_with_undici
    out = run([node, NODE_SCRIPT.name, "undici", PAYMENTS, OPEN], agent_env, cwd=directory)
    check_calls(json.loads(out), fresh)


def test_node_fetch_with_only_node_use_env_proxy(broker: BrokerProcess, agent_env: dict[str, str], fresh: HostileUpstream):
    """`NODE_USE_ENV_PROXY=1` (printed by `affidavit env`) makes fetch use HTTPS_PROXY on Node 22.21+
    and 24+. Older Node ignores it and connects DIRECTLY, bypassing the broker: here the test host
    does not resolve (ENOTFOUND); on the internet the call would go out without the broker."""
    node = _node()
    version = _node_version(node)
    results = json.loads(run([node, str(NODE_SCRIPT), "builtin", PAYMENTS, OPEN], agent_env))
    if version >= (24, 0) or (22, 21) <= version < (23, 0):
        check_calls(results, fresh)
    elif version < (21, 0):
        assert results == [{"error": "ENOTFOUND"}, {"error": "ENOTFOUND"}], results
        assert fresh.received == [], "nothing reached the upstream, through the broker or around it"
    else:
        pytest.skip(f"Node {version}: NODE_USE_ENV_PROXY support is not pinned for this release line")
