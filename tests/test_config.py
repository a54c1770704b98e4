"""Configuration: a bad file names the file, the key and the reason, and nothing starts."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from proxy.config import redact_url
from proxy.config import ConfigError, load_settings, parse_duration
from tests.support.broker import AFFIDAVIT, free_port, free_ports

GOOD = """
[proxy]
listen = "127.0.0.1:{port}"
[api]
listen = "127.0.0.1:{api_port}"
[database]
url = "sqlite+aiosqlite:///{db}"
[[agents]]
name = "builder"
token = "env:BUILDER_TOKEN"
[[secrets]]
name = "payments-key"
from = "env:PAYMENTS_KEY"
[[routes]]
name = "payments.create"
host = "api.payments.test"
methods = ["post"]
path = "/v1/charges*"
agents = ["builder"]
credential = "payments-key"
inject = {{ header = "Authorization", value = "Bearer {{secret}}" }}
idempotency = {{ header = "Idempotency-Key", scope = "payments.create", retention = "24h" }}
max_body = "1MiB"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "affidavit.toml"
    path.write_text(text)
    return path


def good(tmp_path: Path, **extra: str) -> str:
    return GOOD.format(**dict(zip(("port", "api_port"), free_ports(2))), db=tmp_path / "j.db", **extra)


def test_a_good_file_loads_with_typed_values(tmp_path):
    settings = load_settings(write(tmp_path, good(tmp_path)))
    route = settings.routes[0]
    assert route.methods == ["POST"]
    assert route.port == 443 and route.effective_scheme == "https"
    assert route.idempotency.retention == 24 * 3600
    assert int(route.max_body) == 1024 * 1024
    assert route.inject.method == "header"
    assert route.matches_target("https", "API.payments.test", 443)
    assert not route.matches_target("http", "api.payments.test", 443)
    assert route.matches_path("/v1/charges/ch_1") and not route.matches_path("/v1/refunds")


def test_the_environment_overrides_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("AFFIDAVIT_PROXY__LISTEN", "127.0.0.1:9999")
    monkeypatch.setenv("AFFIDAVIT_UPSTREAM__RESPONSE_TIMEOUT", "90s")
    settings = load_settings(write(tmp_path, good(tmp_path)))
    assert settings.proxy.listen == "127.0.0.1:9999"
    assert settings.upstream.response_timeout == 90.0


@pytest.mark.parametrize(
    ("mutation", "key", "reason"),
    [
        (('port = 443', ''), "routes[0].agents", "no agent named 'nobody'"),
        (('name = "payments.create"\nhost = "api.payments.test"', 'name = "payments.create"\nhost = "api.payments.test"\nport = "https"'), "routes[0].port", "valid integer"),
        (('token = "env:BUILDER_TOKEN"', 'token = "hunter2"'), "agents[0].token", "never the value itself"),
        (('retention = "24h"', 'retention = "soon"'), "routes[0].idempotency.retention", "not a duration"),
        (('retention = "24h"', 'retention = "-3s"'), "routes[0].idempotency.retention", "'-3s': a duration must be positive"),
        (('max_body = "1MiB"', 'max_body = "lots"'), "routes[0].max_body", "'lots': not a size such as '64KiB'"),
        (('max_body = "1MiB"', 'max_body = "-1MiB"'), "routes[0].max_body", "'-1MiB': a size cannot be negative"),
        (('listen = "127.0.0.1:{port}"', 'listen = "localhost"'), "proxy.listen", "host:port"),
        (('value = "Bearer {{secret}}"', 'value = "Bearer"'), "routes[0].inject", "must contain '{secret}'"),
        (('[[routes]]', '[[routes]]\nbogus = 1'), "routes[0].bogus", "unknown key (a typo?"),
        (('host = "api.payments.test"', 'host = "*.payments.test"\nconnect_to = "127.0.0.1:9"'), "routes[0]", "needs an exact host"),
        (('url = "sqlite+aiosqlite:///{db}"', 'url = "sqlite+aiosqlite:///:memory:"'), "database.url", "in-memory SQLite"),
        (('url = "sqlite+aiosqlite:///{db}"', 'url = "sqlite+aiosqlite://"'), "database.url", "in-memory SQLite"),
        (('url = "sqlite+aiosqlite:///{db}"', 'url = "sqlite+aiosqlite:///file::memory:?cache=shared&uri=true"'), "database.url", "in-memory SQLite"),
        (('methods = ["post"]', 'methods = ["FOO BAR"]'), "routes[0].methods", "not a valid HTTP token"),
        (('host = "api.payments.test"', 'host = "*.a b"'), "routes[0].host", "must be an exact host name"),
        (('listen = "127.0.0.1:{port}"', 'listen = "127.0.0.1:0"'), "proxy.listen", "port 0 is out of range (1 to 65535)"),
        (('header = "Authorization", value', 'header = "Bad Header:", value'), "routes[0].inject.header", "not a valid HTTP token"),
        (('header = "Authorization", value', 'header = "", value'), "routes[0].inject.header", "not a valid HTTP token"),
        (('header = "Idempotency-Key", scope', 'header = "Idem Key", scope'), "routes[0].idempotency.header", "not a valid HTTP token"),
        (('inject = {{ header = "Authorization", value = "Bearer {{secret}}" }}', 'inject = {{ basic = "svc", value = "x{{secret}}" }}'), "routes[0].inject", "no effect with 'basic'"),
        # Found by a probe: each of these was accepted, and each misbehaved once the broker ran.
        (('listen = "127.0.0.1:{port}"', 'listen = "[]:{port}"'), "proxy.listen", "every interface: '0.0.0.0:8080'"),
        (('listen = "127.0.0.1:{port}"', 'listen = "a b:{port}"'), "proxy.listen", "is not host:port"),
        (('listen = "127.0.0.1:{port}"', 'listen = "127.0.0.1:99999"'), "proxy.listen", "port 99999 is out of range (1 to 65535)"),
        (('agents = ["builder"]', 'agents = []'), "routes[0].agents", "list at least one agent"),
        (('listen = "127.0.0.1:{port}"', 'listen = "127.0.0.1:{port}"\nidempotency_header = "Proxy-Authorization"'),
         "proxy.idempotency_header", "a header the broker itself reads, sets or drops"),
        (('header = "Authorization", value', 'header = "Connection", value'), "routes[0].inject.header", "cannot carry a key or a credential"),
        (('header = "Idempotency-Key", scope', 'header = "Host", scope'), "routes[0].idempotency.header", "cannot carry a key"),
        (('header = "Idempotency-Key", scope', 'header = "authorization", scope'), "routes[0]", "the injected header are both 'authorization'"),
        (('value = "Bearer {{secret}}"', 'value = "Bearer {{secret}}\\r\\nX-Evil: 1"'), "routes[0].inject", "'value' holds a control character"),
        (('retention = "24h"', 'retention = nan'), "routes[0].idempotency.retention", "a duration must be positive"),
        (('retention = "24h"', 'retention = inf'), "routes[0].idempotency.retention", "at most 366d"),
        (('retention = "24h"', 'retention = "400d"'), "routes[0].idempotency.retention", "at most 366d"),
        (('retention = "24h"', 'retention = "\u0663s"'), "routes[0].idempotency.retention", "is not a duration"),
        (('[database]', '[recovery]\nheartbeat = "10s"\nstale_after = "15s"\n[database]'), "recovery", "at least two heartbeats"),
        (('url = "sqlite+aiosqlite:///{db}"', 'url = "sqlite+aiosqlite:///file:memdb1?vfs=memdb&uri=true"'), "database.url", "in-memory SQLite"),
        # Found by a probe: accepted, and then a route that could never match, or one that did not do what it said.
        (('host = "api.payments.test"', 'host = "api.payments.test."'), "routes[0].host", "without its trailing dot ('api.payments.test')"),
        (('host = "api.payments.test"', 'host = "."'), "routes[0].host", "must be an exact host name"),
        (('host = "api.payments.test"', 'host = "-"'), "routes[0].host", "must be an exact host name"),
        (('host = "api.payments.test"', 'host = ".payments.test"'), "routes[0].host", "must be an exact host name"),
        (('host = "api.payments.test"', 'host = "api..payments.test"'), "routes[0].host", "must be an exact host name"),
        (('host = "api.payments.test"', 'host = "*.-payments.test"'), "routes[0].host", "must be an exact host name"),
        (('host = "api.payments.test"', 'host = "[not:v6"'), "routes[0].host", "must be an exact host name"),
        (('methods = ["post"]', 'methods = ["*"]'), "routes[0].methods", "'*' is not a wildcard here"),
        (('path = "/v1/charges*"', 'path = "/v1/charges#frag"'), "routes[0].path", "without '#'"),
        (('path = "/v1/charges*"', 'path = "/v1/ch arges"'), "routes[0].path", "visible ASCII only"),
        (('inject = {{ header = "Authorization", value = "Bearer {{secret}}" }}', 'inject = {{ basic = "svc:admin" }}'), "routes[0].inject", "'basic' holds a ':'"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\nlookup = {{ path = "//evil.test/{{key}}" }}'), "routes[0].lookup.path", "starts with '//'"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\nlookup = {{ path = "/v1/{{keyy}}" }}'), "routes[0].lookup.path", "unknown placeholder(s) {keyy}"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\nlookup = {{ path = "/v1/{{key}}\\r\\nX-Evil: 1" }}'), "routes[0].lookup.path", "visible ASCII only"),
        (('max_body = "1MiB"', 'max_body = true'), "routes[0].max_body", "true is a boolean; this setting takes a number"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\nport = true'), "routes[0].port", "true is a boolean"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\napproval = "no"'), "routes[0].approval", "'no': give true or false"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\nreuse_connections = 0'), "routes[0].reuse_connections", "0: give true or false"),
        (('max_body = "1MiB"', 'max_body = "1MiB"\nretry_budget = 1000000'), "routes[0].retry_budget", "less than or equal to 100"),
        (('[database]', '[recovery]\ninstance = ""\n[database]'), "recovery.instance", "a name of visible ASCII characters"),
        (('[database]', '[recovery]\ninstance = "broker 1"\n[database]'), "recovery.instance", "without spaces"),
    ],
)
def test_a_bad_value_names_file_key_and_reason(tmp_path, mutation, key, reason):
    text = GOOD.replace(*mutation) if mutation[0] != 'port = 443' else GOOD.replace('agents = ["builder"]', 'agents = ["nobody"]')
    path = write(tmp_path, text.format(**dict(zip(("port", "api_port"), free_ports(2))), db=tmp_path / "j.db"))
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    message = str(caught.value)
    assert str(path) in message
    assert key in message
    assert reason in message


@pytest.mark.parametrize(
    ("variable", "value", "key", "reason"),
    [
        ("AFFIDAVIT_PROXY__LSITEN", "1", "proxy.lsiten", "unknown key (a typo?"),
        ("AFFIDAVIT_DATABASE__URL", "postgres://x", "database.url", "use 'sqlite+aiosqlite:///path.db'"),
        ("AFFIDAVIT_PROXY__WORKERS", "abc", "proxy.workers", "valid integer"),
        ("AFFIDAVIT_PROXY__LISTEN", "", "proxy.listen", "is not host:port"),
        ("AFFIDAVIT_ROUTES", '[{"name": "r", "host": "a b", "agents": ["builder"]}]', "routes[0].host", "exact host name"),
    ],
)
def test_a_bad_environment_variable_is_named_and_not_blamed_on_a_good_file(tmp_path, variable, value, key, reason):
    write(tmp_path, good(tmp_path))  # ./affidavit.toml, valid: the variable overrides it
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}, variable: value}
    done = subprocess.run([AFFIDAVIT, "env"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert "environment: invalid configuration (1 problem(s))" in done.stderr, done.stderr
    named = [line for line in done.stderr.splitlines() if line.startswith(f"  {key} (from {variable}): ")]
    assert len(named) == 1 and reason in named[0], done.stderr
    assert "affidavit.toml" not in done.stderr, done.stderr


def test_flags_from_the_environment_are_true_false_1_or_0(tmp_path, monkeypatch):
    for given, read in (("true", True), ("FALSE", False), ("1", True), ("0", False)):
        monkeypatch.setenv("AFFIDAVIT_DATABASE__AUTO_UPGRADE", given)
        assert load_settings(write(tmp_path, good(tmp_path))).database.auto_upgrade is read
    monkeypatch.setenv("AFFIDAVIT_DATABASE__AUTO_UPGRADE", "yes")
    assert "'yes': give true or false" in refusal_of(write(tmp_path, good(tmp_path)))


def test_hosts_that_stay_accepted(tmp_path):
    for host in ("localhost", "10.0.0.5", "[::1]", "*.x-y.test", "API.Payments.test", "a" * 63 + ".test"):
        route = load_settings(write(tmp_path, good(tmp_path).replace('host = "api.payments.test"', f'host = "{host}"'))).routes[0]
        assert route.host == host.lower()


def refusal_of(path: Path) -> str:
    """What loading the configuration at ``path`` (with the environment as it is) refuses with."""
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    return str(caught.value)


def test_problems_in_the_file_and_the_environment_each_name_their_own_source(tmp_path, monkeypatch):
    path = write(tmp_path, good(tmp_path).replace("[proxy]\n", "[proxy]\nworkers = 0\n", 1))
    monkeypatch.setenv("AFFIDAVIT_PROXY__EVENT_LOOP", "libuv")
    message = refusal_of(path)
    assert message.startswith(f"{path} and environment: invalid configuration (2 problem(s))"), message
    assert f"  proxy.workers (from {path}): Input should be greater than or equal to 1" in message, message
    assert "  proxy.event_loop (from AFFIDAVIT_PROXY__EVENT_LOOP): Input should be 'uvloop' or 'asyncio'" in message, message


def test_a_section_set_as_json_is_not_blamed_for_a_key_it_does_not_set(tmp_path, monkeypatch):
    """AFFIDAVIT_PROXY='{...}' is merged with the file's [proxy]: a bad key the JSON does not hold is the file's."""
    path = write(tmp_path, good(tmp_path).replace("[proxy]\n", "[proxy]\nworkers = 0\n", 1))
    monkeypatch.setenv("AFFIDAVIT_PROXY", '{"event_loop": "asyncio"}')
    message = refusal_of(path)
    assert message.startswith(f"{path}: invalid configuration (1 problem(s))"), message
    assert "  proxy.workers: Input should be greater than or equal to 1" in message and "AFFIDAVIT_PROXY" not in message


def test_a_check_across_sections_of_the_file_alone_is_the_files_whatever_else_the_environment_sets(tmp_path, monkeypatch):
    path = write(tmp_path, good(tmp_path).replace('agents = ["builder"]', 'agents = ["nobody"]', 1))
    monkeypatch.setenv("AFFIDAVIT_PROXY__EVENT_LOOP", "asyncio")
    message = refusal_of(path)
    assert message.startswith(f"{path}: invalid configuration (1 problem(s))"), message
    assert "  (top level): routes[0].agents: no agent named 'nobody'" in message, message
    monkeypatch.setenv("AFFIDAVIT_AGENTS", '[{"name": "builder", "token": "env:BUILDER_TOKEN"}]')
    with pytest.raises(ConfigError, match=r"\(top level, from .* and AFFIDAVIT_\* variables together\)"):
        load_settings(path)


def test_broken_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"affidavit.toml: not valid TOML: .*line 2"):
        load_settings(write(tmp_path, "[proxy]\nlisten = \n"))
    with pytest.raises(ConfigError, match="no such configuration file"):
        load_settings(tmp_path / "missing.toml")


def test_durations():
    assert parse_duration("250ms") == 0.25 and parse_duration("5m") == 300 and parse_duration(7) == 7
    with pytest.raises(ValueError):
        parse_duration("-1s")


def test_the_request_deadlines_default_to_30_and_120_seconds_and_are_read_from_file_and_environment(tmp_path, monkeypatch):
    settings = load_settings(write(tmp_path, good(tmp_path)))
    assert (settings.proxy.request_head_timeout, settings.proxy.request_body_timeout) == (30.0, 120.0)
    text = good(tmp_path).replace('[proxy]\n', '[proxy]\nrequest_head_timeout = "500ms"\n', 1)
    monkeypatch.setenv("AFFIDAVIT_PROXY__REQUEST_BODY_TIMEOUT", "15m")
    settings = load_settings(write(tmp_path, text))
    assert (settings.proxy.request_head_timeout, settings.proxy.request_body_timeout) == (0.5, 900.0)


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("request_head_timeout", "0", "a duration must be positive"),
    ("request_body_timeout", '"0s"', "a duration must be positive"),
    ("request_body_timeout", "-5", "a duration must be positive"),
    ("request_head_timeout", '"soon"', "not a duration"),
])
def test_a_request_deadline_that_is_not_a_positive_duration_is_refused(tmp_path, key, value, reason):
    path = write(tmp_path, good(tmp_path).replace("[proxy]\n", f"[proxy]\n{key} = {value}\n", 1))
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert f"proxy.{key}" in str(caught.value) and reason in str(caught.value), caught.value


@pytest.mark.parametrize(("old", "new", "where", "said"), [
    ('methods = ["post"]', 'methods = ["post", "' + "X" * 17 + '"]', "routes[0].methods", "at most 16"),
    ('name = "builder"', 'name = "' + "b" * 101 + '"', "agents[0].name", "at most 100 characters"),
    ('name = "payments-key"', 'name = "' + "k" * 101 + '"', "secrets[0].name", "at most 100 characters"),
    ('name = "payments.create"', 'name = "' + "r" * 201 + '"', "routes[0].name", "at most 200 characters"),
    ('scope = "payments.create"', 'scope = "' + "s" * 201 + '"', "routes[0].idempotency.scope", "at most 200 characters"),
])
def test_a_name_or_method_longer_than_the_journal_records_is_refused(tmp_path, old, new, where, said):
    """Each is written into records, in a column of that width: on PostgreSQL a longer one failed
    every journal write that held it, and the writes batched alongside."""
    text = good(tmp_path)
    assert old in text
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text.replace(old, new, 1)))
    assert where in str(caught.value) and said in str(caught.value), caught.value


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_affidavit_run_refuses_a_bad_config_and_listens_on_nothing(tmp_path):
    port, api_port = free_ports(2)
    text = GOOD.replace('agents = ["builder"]', 'agents = ["nobody"]').format(port=port, api_port=api_port, db=tmp_path / "j.db")
    path = write(tmp_path, text)
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert str(path) in done.stderr and "routes[0].agents" in done.stderr and "nothing was done" in done.stderr
    assert not _listening(port) and not _listening(api_port)
    assert not (tmp_path / "j.db").exists()
    # Any other command says the same, and does nothing either.
    listed = subprocess.run([AFFIDAVIT, "invocations", "list", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert listed.returncode == 2 and "routes[0].agents" in listed.stderr and "nothing was done" in listed.stderr, listed.stderr
    assert not (tmp_path / "j.db").exists()


def test_affidavit_run_refuses_a_missing_token(tmp_path):
    path = write(tmp_path, good(tmp_path))
    env = {"PATH": "/usr/bin:/bin", "PAYMENTS_KEY": "x"}
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2
    assert "agents[0].token: environment variable BUILDER_TOKEN is not set" in done.stderr
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**env, "BUILDER_TOKEN": ""})
    assert done.returncode == 2 and "agents[0].token: environment variable BUILDER_TOKEN is set but empty" in done.stderr, done.stderr
    vaulted = write(tmp_path, good(tmp_path).replace('token = "env:BUILDER_TOKEN"', 'token = "vault:builder"'))
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(vaulted)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2 and "agents[0].token: the vault is not available" in done.stderr, done.stderr
    assert "agent and operator tokens come from env:NAME or file:/path" in done.stderr, done.stderr


@pytest.mark.parametrize("taken", ["proxy", "api"])
def test_affidavit_run_on_a_taken_port_says_which_and_exits(tmp_path, taken):
    port, api_port = free_ports(2)
    path = write(tmp_path, GOOD.format(port=port, api_port=api_port, db=tmp_path / "j.db"))
    env = {"PATH": "/usr/bin:/bin", "BUILDER_TOKEN": "t" * 24, "PAYMENTS_KEY": "x", "HOME": str(tmp_path)}
    holder = socket.socket()
    holder.bind(("127.0.0.1", port if taken == "proxy" else api_port))
    holder.listen(1)
    try:
        done = subprocess.run([AFFIDAVIT, "run", "--config", str(path)], capture_output=True, text=True,
                              timeout=90, cwd=tmp_path, env=env)
    finally:
        holder.close()
    assert done.returncode == 1, done.stderr
    key = f"{taken}.listen 127.0.0.1:{port if taken == 'proxy' else api_port}"
    assert f"affidavit: cannot start: {key}: Address already in use (is another broker running?)" in done.stderr, done.stderr
    # One account of the failure, in the broker's words: not mitmproxy's advice to pass `--mode
    # regular@<port>`, an option the broker does not have.
    assert "--mode" not in done.stderr and "failed to listen" not in done.stderr, done.stderr
    other = api_port if taken == "proxy" else port
    assert not _listening(other), "nothing may stay bound after a failed start"


def test_affidavit_run_without_uvloop_says_what_to_do_and_touches_nothing(tmp_path):
    """Where uvloop cannot be imported (Windows, a broken install), the default event loop is refused
    at start, before the journal is opened, with both ways out; `event_loop = "asyncio"` starts."""
    port, api_port = free_ports(2)
    config = GOOD.format(port=port, api_port=api_port, db=tmp_path / "j.db")
    path = write(tmp_path, config)
    shadow = tmp_path / "shadow" / "uvloop"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no uvloop on this machine')\n")
    env = {"PATH": "/usr/bin:/bin", "BUILDER_TOKEN": "t" * 24, "PAYMENTS_KEY": "x", "HOME": str(tmp_path),
           "PYTHONPATH": str(shadow.parent)}
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(path)], capture_output=True, text=True,
                          timeout=90, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert ('affidavit: cannot start: proxy.event_loop = "uvloop", but uvloop cannot be imported (no uvloop on this '
            'machine); install it (pip install uvloop) or set [proxy] event_loop = "asyncio"') in done.stderr, done.stderr
    assert not (tmp_path / "j.db").exists(), "refused before the journal was opened"
    assert not _listening(port) and not _listening(api_port)

    path.write_text(config.replace("[proxy]\n", '[proxy]\nevent_loop = "asyncio"\n', 1))
    broker = subprocess.Popen([AFFIDAVIT, "run", "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port) and broker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening(port), "the broker on asyncio's loop did not start"
    finally:
        broker.terminate()
        output = broker.communicate(timeout=30)[0]
    assert "event loop: asyncio (_UnixSelectorEventLoop)" in output, output


@pytest.mark.parametrize("command", [["invocations", "list"], ["metrics"]])
def test_a_bad_since_window_is_a_usage_error_not_a_traceback(tmp_path, command):
    path = write(tmp_path, good(tmp_path))
    done = subprocess.run([AFFIDAVIT, *command, "--config", str(path), "--since", "yesterday"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert "--since" in done.stderr and "Traceback" not in done.stderr


def test_env_lines_cover_both_spellings_encode_the_token_and_name_a_reachable_host(tmp_path, monkeypatch):
    from urllib.parse import unquote, urlsplit

    from proxy.app import env_lines

    monkeypatch.setenv("BUILDER_TOKEN", "unused")
    monkeypatch.setenv("PAYMENTS_KEY", "unused")
    text = good(tmp_path).replace('listen = "127.0.0.1:', 'listen = "0.0.0.0:')
    settings = load_settings(write(tmp_path, text))
    token = "p@ss:w/rd%?#"
    lines = dict(line.removeprefix("export ").split("=", 1) for line in env_lines(settings, "builder", token))
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        url = urlsplit(lines[name].strip('"'))
        assert (url.hostname, url.port) == ("127.0.0.1", int(settings.proxy.listen.rsplit(":", 1)[1]))
        assert url.username == "builder" and unquote(url.password) == token, name
    assert urlsplit(lines["AFFIDAVIT_API_URL"].strip('"')).hostname == "127.0.0.1"


def test_affidavit_env_for_an_unknown_agent_is_a_usage_error_naming_the_agents(tmp_path):
    path = write(tmp_path, good(tmp_path))
    done = subprocess.run([AFFIDAVIT, "env", "--config", str(path), "--agent", "buidler"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert "no agent 'buidler'" in done.stderr and "builder" in done.stderr
    done = subprocess.run([AFFIDAVIT, "env", "--config", str(path), "--agent", "builder"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and 'export NO_PROXY="127.0.0.1"' in done.stdout
    # No broker has run here: the CA the exports name is not there, which is said (exit 0 still:
    # a script may print the exports before the broker's first start).
    ca = tmp_path / ".affidavit" / "mitmproxy-ca-cert.pem"
    assert f"warning: no CA at {ca} yet" in done.stderr, done.stderr
    ca.parent.mkdir()
    ca.write_text("a certificate")
    with_token_file = path.read_text().replace('token = "env:BUILDER_TOKEN"', 'token = "file:.affidavit/builder.token"')
    assert with_token_file != path.read_text()
    path.write_text(with_token_file)
    done = subprocess.run([AFFIDAVIT, "env", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "no CA" not in done.stderr, done.stderr
    assert f"agent 'builder''s token file {tmp_path / '.affidavit' / 'builder.token'} does not exist" in done.stderr
    (tmp_path / ".affidavit" / "builder.token").write_text("t0ken")
    done = subprocess.run([AFFIDAVIT, "env", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr


def test_a_read_command_in_the_wrong_directory_says_so_and_creates_nothing(tmp_path):
    """No ./affidavit.toml: the defaults apply, which is said, and the default SQLite journal that
    is not there is reported missing rather than created empty."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}
    done = subprocess.run([AFFIDAVIT, "invocations", "list"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert f"no --config and no affidavit.toml in {tmp_path}" in done.stderr
    assert f"no journal at {tmp_path / 'affidavit.db'} (database.url's path ./affidavit.db is relative: it is read " \
        f"from the working directory {tmp_path})" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == [], "a read command left a file behind"
    # A --config elsewhere does not move a relative path: the message says where it was looked for.
    elsewhere = tmp_path.parent / f"{tmp_path.name}-broker"
    elsewhere.mkdir()
    (elsewhere / "affidavit.toml").write_text('[database]\nurl = "sqlite+aiosqlite:///./affidavit.db"\n')
    done = subprocess.run([AFFIDAVIT, "invocations", "list", "-c", str(elsewhere / "affidavit.toml")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1 and f"working directory {tmp_path})" in done.stderr, done.stderr
    assert "run the command where the broker runs, or pass its --config" in done.stderr


@pytest.mark.parametrize("where", ["a directory", "a missing directory"])
@pytest.mark.parametrize("command", [["run"], ["db", "upgrade"], ["invocations", "list"], ["secrets", "list"]])
def test_a_sqlite_url_that_names_no_file_it_can_hold_is_said_so_by_every_command(tmp_path, command, where):
    """SQLite says only "unable to open database file", and its connection thread could print a
    traceback after the loop ended: each command says what the path is, and what to do."""
    (tmp_path / "journal").mkdir()
    path = tmp_path / "journal" if where == "a directory" else tmp_path / "nowhere" / "journal.db"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}
    proxy_port, api_port = free_ports(2)
    env |= {"AFFIDAVIT_DATABASE__URL": f"sqlite+aiosqlite:///{path}", "AFFIDAVIT_PROXY__LISTEN": f"127.0.0.1:{proxy_port}",
            "AFFIDAVIT_API__LISTEN": f"127.0.0.1:{api_port}"}
    done = subprocess.run([AFFIDAVIT, *command], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1, (done.returncode, done.stderr)
    said = "is a directory; the journal is a file" if where == "a directory" else f"the directory of {path} does not exist"
    assert said in done.stderr and "Traceback" not in done.stderr and "unable to open" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["journal"], "nothing was created"


def test_affidavit_version_is_the_installed_distributions():
    from importlib.metadata import version

    done = subprocess.run([AFFIDAVIT, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"affidavit {version('affidavit')}", done


def test_env_prints_urls_an_ipv6_listen_address_works_in(tmp_path, monkeypatch):
    from proxy.app import env_lines

    monkeypatch.setenv("BUILDER_TOKEN", "unused")
    monkeypatch.setenv("PAYMENTS_KEY", "unused")
    text = good(tmp_path).replace('listen = "127.0.0.1:', 'listen = "[::1]:')
    lines = dict(line.removeprefix("export ").split("=", 1) for line in env_lines(load_settings(write(tmp_path, text)), "builder", "t"))
    assert lines["HTTPS_PROXY"].startswith('"http://builder:t@[::1]:') and lines["AFFIDAVIT_API_URL"].startswith('"http://[::1]:')
    assert lines["NO_PROXY"] == '"::1"'


def test_env_with_a_literal_token_takes_the_agent_name_as_given(tmp_path):
    """With --token nothing is read from the configuration's agents, so a name it does not list is
    not an error (an agent's shell may have no broker configuration at all)."""
    done = subprocess.run([AFFIDAVIT, "env", "--agent", "elsewhere", "--token", "t0k"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and 'HTTPS_PROXY="http://elsewhere:t0k@' in done.stdout, done.stderr


def test_read_commands_accept_a_sqlite_uri_filename(tmp_path):
    """A SQLite URI filename is not a path to test for existence; only a plain path that does not
    exist is reported missing."""
    from proxy.cli_operator import with_engine

    journal = tmp_path / "j.db"
    journal.write_bytes(b"")
    settings = load_settings(write(tmp_path, good(tmp_path).replace(f"sqlite+aiosqlite:///{tmp_path / 'j.db'}",
                                                                       f"sqlite+aiosqlite:///file:{journal}?uri=true")))

    async def work(engine):
        from sqlalchemy import text
        async with engine.connect() as conn:
            return (await conn.execute(text("SELECT 1"))).scalar()

    assert with_engine(settings, work) == 1


def test_affidavit_ca_without_a_ca_says_where_it_looked_and_what_to_do(tmp_path):
    path = write(tmp_path, good(tmp_path))
    done = subprocess.run([AFFIDAVIT, "ca", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no CA at {tmp_path / '.affidavit' / 'mitmproxy-ca-cert.pem'}" in done.stderr, done.stderr
    # The default confdir is relative: another --config alone would not find the broker's CA.
    assert "is relative" in done.stderr and "broker's working directory" in done.stderr, done.stderr
    absolute = tmp_path / "abs-conf"
    path = write(tmp_path, good(tmp_path).replace("[proxy]\n", f'[proxy]\nconfdir = "{absolute}"\n', 1))
    done = subprocess.run([AFFIDAVIT, "ca", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and f"no CA at {absolute / 'mitmproxy-ca-cert.pem'}" in done.stderr, done.stderr
    assert "pass its --config" in done.stderr and "relative" not in done.stderr, done.stderr


def test_ca_and_env_print_the_ca_path_as_configured_not_through_its_symlinks(tmp_path):
    """As a Kubernetes Secret is mounted: each file is a link through `..data`, itself a link to a
    timestamped directory the kubelet replaces at every update. Agents must be given the stable path."""
    mount = tmp_path / "ca"
    (mount / "..2026_01_01_00_00_00.000").mkdir(parents=True)
    (mount / "..2026_01_01_00_00_00.000" / "mitmproxy-ca-cert.pem").write_bytes(b"PEM\r\n\xff")
    (mount / "..data").symlink_to("..2026_01_01_00_00_00.000")
    (mount / "mitmproxy-ca-cert.pem").symlink_to("..data/mitmproxy-ca-cert.pem")
    path = write(tmp_path, good(tmp_path).replace("[proxy]\n", f'[proxy]\nconfdir = "{mount}"\n', 1))
    expected = str(mount / "mitmproxy-ca-cert.pem")
    done = subprocess.run([AFFIDAVIT, "ca", "--config", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == expected, done
    done = subprocess.run([AFFIDAVIT, "ca", "--pem", "--config", str(path)], capture_output=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == b"PEM\r\n\xff", "the file as it is, byte for byte"
    done = subprocess.run([AFFIDAVIT, "env", "--config", str(path), "--token", "t"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and f'export SSL_CERT_FILE="{expected}"' in done.stdout, done


def test_the_test_brokers_first_start_moves_off_a_port_taken_meanwhile(make_broker):
    """Test infrastructure: parallel workers can take a port between free_port() and the broker's
    bind; the first start then moves to new ports instead of failing the test."""
    broker = make_broker("sqlite", start=False)
    taken = broker.proxy_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen(1)
        broker.start()
    assert broker.proxy_port != taken and broker.starts == 1
    with broker.client() as client:
        assert client.get("https://unknown.example.test/x").status_code == 403


@pytest.mark.parametrize(("variable", "value"), [("AFFIDAVIT_CRYPTO__KEYS", "k1=file:/x"), ("AFFIDAVIT_AGENTS", "not json")])
def test_a_list_variable_that_is_not_json_is_a_clear_error_not_a_traceback(tmp_path, variable, value):
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}, variable: value}
    done = subprocess.run([AFFIDAVIT, "env"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert f"environment: {variable}: not valid JSON" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_database_that_cannot_be_reached_at_start_is_one_line_not_a_traceback(tmp_path, workers):
    from tests.support.broker import free_port

    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}
    env["AFFIDAVIT_DATABASE__URL"] = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nowhere"
    done = subprocess.run([AFFIDAVIT, "run", "--workers", workers], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "affidavit: cannot start: database.url postgresql+asyncpg://postgres@127.0.0.1:" in done.stderr
    assert "check that the database is up" in done.stderr and "Traceback" not in done.stderr


def test_a_database_that_refuses_writes_at_start_stops_the_start(make_broker):
    """A PostgreSQL standby (or a database read-only by default): the broker connected, its
    heartbeat failed with "read-only transaction", and it listened anyway, refusing every request
    while it seemed up. It now exits 1 and says where to point instead."""
    from sqlalchemy.engine import make_url

    broker = make_broker("postgresql", start=False)
    assert broker.command("db", "upgrade").returncode == 0
    name = make_url(broker.database_url).database
    subprocess.run(["psql", "postgresql://postgres@127.0.0.1:5432/postgres", "-qc",
                    f"ALTER DATABASE {name} SET default_transaction_read_only = on"], check=True, capture_output=True, timeout=60)
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(broker.config_path)], cwd=broker.workdir,
                          env=broker._env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "affidavit: cannot start: the journal refuses writes (" in done.stderr, done.stderr[-3000:]
    assert "read-only" in done.stderr and "point the URL at the primary" in done.stderr, done.stderr[-3000:]
    assert "listening" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize(
    ("where", "check"),
    [
        ("no-such-database", "the server has no database of that name; check the database name"),
        ("unresolvable-host", "its host name does not resolve; check the host"),
        ("refused-port", "nothing accepts connections at its host and port; check that the database is up"),
    ],
)
def test_a_read_command_that_cannot_reach_the_journal_names_the_url_and_what_to_check(tmp_path, request, where, check):
    from sqlalchemy.engine import make_url

    from tests.support.broker import free_port

    if where == "no-such-database":
        url = make_url(request.getfixturevalue("pg_admin_url")).set(database=f"ops_absent_{free_port()}")
    else:
        host, port = ("no-such-host.invalid", 5432) if where == "unresolvable-host" else ("127.0.0.1", free_port())
        url = make_url(f"postgresql+asyncpg://postgres@{host}:{port}/journal")
    url = url.set(password="s3cret-pw")
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_DATABASE__URL": url.render_as_string(hide_password=False)}
    done = subprocess.run([AFFIDAVIT, "invocations", "list"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert f"database.url is {url.render_as_string(hide_password=True)}: {check}" in done.stderr, done.stderr
    assert "then run the command again" in done.stderr and "s3cret-pw" not in done.stderr, done.stderr
    # `db upgrade` says what to check too, not only the driver's words.
    done = subprocess.run([AFFIDAVIT, "db", "upgrade"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1 and f"could not upgrade {url.render_as_string(hide_password=True)}: " in done.stderr
    assert f"; {check}" in done.stderr and "then run it again" in done.stderr and "s3cret-pw" not in done.stderr, done.stderr


def test_a_read_command_on_a_file_that_is_no_journal_names_it(tmp_path):
    (tmp_path / "notadb.db").write_text("[proxy]\nlisten = 1\n" * 100)
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_DATABASE__URL": f"sqlite+aiosqlite:///{tmp_path / 'notadb.db'}"}
    done = subprocess.run([AFFIDAVIT, "invocations", "list"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert f"database.url is sqlite+aiosqlite:///{tmp_path / 'notadb.db'}: check that it names the broker's journal" in done.stderr
    assert "see the error above" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "if it does, the journal's storage is damaged" in done.stderr and "restore the journal from a backup" in done.stderr


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_read_command_notes_a_journal_schema_older_or_newer_than_its_own(tmp_path, request, dialect):
    """Only `audit verify` used to say that a newer affidavit made the journal's schema; the read
    commands showed what they could with no word that a newer broker records more than they show,
    or that the journal was never upgraded to this version's schema."""
    from proxy.store import migrate
    from tests.conftest import database_url
    import asyncio

    from proxy.store.journal import on_engine

    url = database_url(dialect, tmp_path, request, migrated=True)
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_DATABASE__URL": url}

    async def stamp(engine, revision):
        from sqlalchemy import text

        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    commands = (["invocations", "list"], ["metrics"], ["secrets", "list"])
    for revision, said in ((migrate.head(), None), ("9999", "which a newer affidavit made"),
                           ("0011", f"older than this version's {migrate.head()}")):
        asyncio.run(on_engine(url, lambda engine: stamp(engine, revision)))
        for command in commands:
            done = subprocess.run([AFFIDAVIT, *command], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
            assert done.returncode == 0, (command, done.stderr)
            if said is None:
                assert "schema revision" not in done.stderr, (command, done.stderr)
            else:
                assert f"affidavit: note: the journal is at schema revision {revision}, {said}" in done.stderr, (command, done.stderr)
    # A journal really at an older schema: the read fails, and the note says why it may have.
    (tmp_path / "old").mkdir()
    old = database_url(dialect, tmp_path / "old", request)
    migrate.upgrade(old, "0003")
    done = subprocess.run([AFFIDAVIT, "invocations", "list"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**env, "AFFIDAVIT_DATABASE__URL": old})
    assert done.returncode == 1 and "the journal could not be read" in done.stderr, done.stderr
    assert "note: the journal is at schema revision 0003, older than this version's" in done.stderr, done.stderr
    assert "run `affidavit db upgrade` with their configuration" in done.stderr


def test_an_environment_variable_for_a_section_that_does_not_exist_is_refused(tmp_path):
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_PROXYY__LISTEN": "127.0.0.1:9999", "AFFIDAVIT_API_URL": "http://127.0.0.1:8081"}
    done = subprocess.run([AFFIDAVIT, "env"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert "environment: AFFIDAVIT_PROXYY__LISTEN: no such section (a typo?" in done.stderr
    assert "AFFIDAVIT_API_URL" not in done.stderr, "an agent shell's own variable is not a setting"
    # A variable a secret source names is a value, whatever it looks like.
    config = tmp_path / "affidavit.toml"
    config.write_text('[[agents]]\nname = "a"\ntoken = "env:A_TOKEN"\n\n'
                      '[[secrets]]\nname = "pay"\nfrom = "env:AFFIDAVIT_SECRET__PAY"\n')
    env = {**{k: v for k, v in env.items() if k != "AFFIDAVIT_PROXYY__LISTEN"}, "AFFIDAVIT_SECRET__PAY": "x"}
    done = subprocess.run([AFFIDAVIT, "env", "--config", str(config)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr


def test_a_broker_older_than_its_schema_says_so_instead_of_advising_an_upgrade(tmp_path, pg_admin_url):
    from tests.support.journal import query
    from tests.support.pg import fresh_database

    url, drop = fresh_database(pg_admin_url)
    try:
        env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
               "AFFIDAVIT_DATABASE__URL": url}
        upgraded = subprocess.run([AFFIDAVIT, "db", "upgrade"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert upgraded.returncode == 0, upgraded.stderr
        query(url, "UPDATE alembic_version SET version_num = '9999'")  # as a newer broker would leave it
        for command in (["run"], ["db", "upgrade"]):
            done = subprocess.run([AFFIDAVIT, *command], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
            assert done.returncode == 2, (command, done.stderr[-2000:])
            assert "the schema is at 9999, which a newer broker made" in done.stderr and "Traceback" not in done.stderr
            assert "Can't locate revision" not in done.stderr, done.stderr
    finally:
        drop()
    url, drop = fresh_database(pg_admin_url)  # never upgraded, and not to be upgraded at start
    try:
        env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
               "AFFIDAVIT_DATABASE__URL": url, "AFFIDAVIT_DATABASE__AUTO_UPGRADE": "false"}
        done = subprocess.run([AFFIDAVIT, "run"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "the database has no journal schema yet, this broker needs" in done.stderr, done.stderr[-2000:]
        assert f"database.url {redact_url(url)}: " in done.stderr, "it names the database it looked at"
        assert "Run `affidavit db upgrade` first" in done.stderr
    finally:
        drop()


def test_a_malformed_failpoints_variable_stops_the_start_in_one_line_and_nothing_else(tmp_path):
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_DATABASE__URL": f"sqlite+aiosqlite:///{tmp_path / 'j.db'}"}
    for spec, said in (("nosuch=kill", "unknown failpoint 'nosuch'"), ("during_tls=pause:soon", "is not name=action[@count]")):
        env["AFFIDAVIT_FAILPOINTS"] = spec
        started = subprocess.run([AFFIDAVIT, "run"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert started.returncode == 2 and "Traceback" not in started.stderr, started.stderr[-2000:]
        assert "affidavit: cannot start: AFFIDAVIT_FAILPOINTS: " in started.stderr and said in started.stderr, started.stderr
        other = subprocess.run([AFFIDAVIT, "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert other.returncode == 0 and "Traceback" not in other.stderr, other.stderr
    assert not (tmp_path / "j.db").exists(), "nothing was started"


@pytest.mark.parametrize("spec", ["during_tls=pause:inf", "during_tls=pause:nan", "during_tls=pause:-1",
                                  "during_tls=pause", "during_tls=kill:3", "during_tls=raise@0", "during_tls=kill@-1",
                                  "during_tls=kill@1.5"])
def test_a_failpoint_that_could_never_act_as_written_is_refused(spec):
    """A pause forever, a negative pause, a count that never fires: each would make a drill that
    proves nothing, so each is an error at start like an unknown name."""
    from proxy.failpoints import _load

    actions, problem = _load(spec)
    assert actions == {} and problem is not None and "is not name=action[@count]" in problem, (spec, problem)


def test_well_formed_failpoints_are_read_as_written():
    from proxy.failpoints import _load

    actions, problem = _load("during_tls=pause:0.5@2; after_lease=kill; heartbeat=raise@1; after_approval=pause:0")
    assert problem is None
    assert {name: (a.kind, a.seconds, a.remaining) for name, a in actions.items()} == {
        "during_tls": ("pause", 0.5, 2), "after_lease": ("kill", 0.0, None), "heartbeat": ("raise", 0.0, 1),
        "after_approval": ("pause", 0.0, None)}


@pytest.mark.parametrize("url, shown", [
    ("postgresql+asyncpg://affidavit:s3cr%40t@db.internal:5432/affidavit", "postgresql+asyncpg://affidavit:***@db.internal:5432/affidavit"),
    ("sqlite+aiosqlite:////srv/jürnal/a b.db?timeout=5", "sqlite+aiosqlite:////srv/jürnal/a b.db?timeout=5"),
    ("sqlite+aiosqlite:///relative.db", "sqlite+aiosqlite:///relative.db"),
    ("::not a url", "the given database"),
])
def test_a_database_url_in_messages_hides_its_password_and_shows_a_file_path_as_written(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_db_upgrade_says_what_it_did(tmp_path, pg_admin_url, dialect):
    """Created, upgraded, or nothing to do: an operator can tell them apart (and notice a journal
    created in the wrong directory)."""
    from proxy.store import migrate
    from tests.support.pg import fresh_database

    if dialect == "sqlite":
        journal = tmp_path / "jürnal Ω.db"  # shown as it is on disk, not percent-encoded
        url, drop = f"sqlite+aiosqlite:///{journal}", lambda: None
    else:
        url, drop = fresh_database(pg_admin_url)
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}, "AFFIDAVIT_DATABASE__URL": url}

    def upgrade() -> str:
        done = subprocess.run([AFFIDAVIT, "db", "upgrade"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    head, shown = migrate.head(), redact_url(url)
    try:
        if dialect == "sqlite":
            assert shown == f"sqlite+aiosqlite:///{journal}"
            assert upgrade() == f"affidavit: created the journal file {journal}; {shown} is at revision {head}"
        else:
            assert upgrade() == f"affidavit: created the journal's schema; {shown} is at revision {head}"
        assert upgrade() == f"affidavit: nothing to do; {shown} is at revision {head} already"
        older = "0007"
        assert migrate.known(older) and older != head
        if dialect == "sqlite":
            journal.unlink()
        else:
            drop()
            url, drop = fresh_database(pg_admin_url)
            env["AFFIDAVIT_DATABASE__URL"], shown = url, redact_url(url)
        migrate.upgrade(url, older)
        assert upgrade() == f"affidavit: upgraded from revision {older}; {shown} is at revision {head}"
    finally:
        drop()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_concurrent_db_upgrades_of_a_new_journal_make_it_once_and_say_so(tmp_path, pg_admin_url, dialect):
    """Two operators (or brokers with auto_upgrade) at once: one failed on the other's CREATE
    (duplicate key in pg_type; on SQLite "table invocations already exists"), or both said they
    had created the schema. One creates it; the others wait for it, then find nothing to do."""
    from proxy.store import migrate
    from tests.support.pg import fresh_database

    if dialect == "sqlite":
        journal = tmp_path / "journal.db"
        url, drop = f"sqlite+aiosqlite:///{journal}", lambda: None
    else:
        url, drop = fresh_database(pg_admin_url)
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}, "AFFIDAVIT_DATABASE__URL": url}
    try:
        runs = [subprocess.Popen([AFFIDAVIT, "db", "upgrade"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=tmp_path, env=env) for _ in range(6)]
        said = [run.communicate(timeout=120) for run in runs]
        assert [run.returncode for run in runs] == [0] * 6, said
        head, shown = migrate.head(), redact_url(url)
        created = f"created the journal file {journal}" if dialect == "sqlite" else "created the journal's schema"
        assert sorted(out.strip() for out, _ in said) == sorted(
            [f"affidavit: {created}; {shown} is at revision {head}"]
            + [f"affidavit: nothing to do; {shown} is at revision {head} already"] * 5), said
    finally:
        drop()


def test_db_upgrade_and_run_refuse_a_sqlite_schema_a_newer_broker_made(tmp_path):
    """The systemd unit runs `affidavit db upgrade` before every start (ExecStartPre), so after a
    rollback this is the message an operator reads; SQLite, upgraded at every start, says the same."""
    import sqlite3

    path = write(tmp_path, good(tmp_path))
    journal = tmp_path / "j.db"
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}, "BUILDER_TOKEN": "t"}
    upgraded = subprocess.run([AFFIDAVIT, "db", "upgrade", "-c", str(path)], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    with sqlite3.connect(journal) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")  # as a newer broker would leave it
    for command in (["db", "upgrade"], ["run"]):
        done = subprocess.run([AFFIDAVIT, *command, "-c", str(path)], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path, env=env)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert (f"database.url sqlite+aiosqlite:///{journal}: the schema is at 9999, which a newer broker made; "
                "this broker knows only up to") in done.stderr, done.stderr
        assert "Can't locate revision" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    with sqlite3.connect(journal) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999",)]


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]])
def test_a_ca_key_that_cannot_be_read_stops_the_start_naming_confdir(tmp_path, workers):
    """mitmproxy reads the CA only once it runs, and only logs what it cannot read: the broker
    would answer ready and fail every HTTPS request. It is read before anything listens."""
    confdir = tmp_path / "ca"
    confdir.mkdir()
    (confdir / "mitmproxy-ca.pem").write_text("garbage")
    path = write(tmp_path, good(tmp_path).replace("[proxy]\n", f'[proxy]\nconfdir = "{confdir}"\n', 1))
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "BUILDER_TOKEN": "t" * 16, "PAYMENTS_KEY": "k"}
    done = subprocess.run([AFFIDAVIT, "run", "-c", str(path), *workers], capture_output=True, text=True, timeout=90,
                          cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"cannot start: proxy.confdir {confdir}: the interception CA (mitmproxy-ca.pem) could not be read" in done.stderr
    assert "Traceback" not in done.stderr and "listening" not in done.stdout, (done.stdout, done.stderr[-2000:])


def test_a_confdir_with_the_ca_key_alone_gets_the_certificate_agents_trust(tmp_path):
    from mitmproxy.certs import CertStore

    from proxy.app import prepare_ca

    confdir = tmp_path / "ca"
    CertStore.create_store(confdir, "mitmproxy", 2048)
    expected = (confdir / "mitmproxy-ca-cert.pem").read_bytes()
    for name in ("mitmproxy-ca-cert.pem", "mitmproxy-ca-cert.cer", "mitmproxy-ca-cert.p12", "mitmproxy-ca.p12"):
        (confdir / name).unlink()
    settings = load_settings(write(tmp_path, good(tmp_path).replace("[proxy]\n", f'[proxy]\nconfdir = "{confdir}"\n', 1)))
    prepare_ca(settings)
    assert (confdir / "mitmproxy-ca-cert.pem").read_bytes() == expected, "the key's own certificate, not a new CA"


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]])
def test_the_proxy_and_the_side_api_on_one_port_is_said_so_not_blamed_on_another_broker(tmp_path, workers):
    port = free_port()
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_PROXY__LISTEN": f"127.0.0.1:{port}", "AFFIDAVIT_API__LISTEN": f"0.0.0.0:{port}",
           "AFFIDAVIT_DATABASE__URL": f"sqlite+aiosqlite:///{tmp_path / 'j.db'}"}
    done = subprocess.run([AFFIDAVIT, "run", *workers], capture_output=True, text=True, timeout=90, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"cannot start: proxy.listen (127.0.0.1:{port}) and api.listen (0.0.0.0:{port}) ask for the same port" in done.stderr
    assert "another broker" not in done.stderr, done.stderr


def test_a_missing_ca_bundle_and_a_doubled_key_id_are_named_once(tmp_path, monkeypatch):
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")},
           "AFFIDAVIT_UPSTREAM__CA_BUNDLE": str(tmp_path / "nowhere.pem")}
    done = subprocess.run([AFFIDAVIT, "run"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"cannot start: upstream.ca_bundle {tmp_path / 'nowhere.pem'}: No such file or directory" in done.stderr
    monkeypatch.setenv("AFFIDAVIT_CRYPTO__KEYS", '["k=env:A", "k=env:B"]')
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert "crypto.keys (from AFFIDAVIT_CRYPTO__KEYS): the name 'k' is used twice" in str(refused.value)
    assert "crypto.keys: crypto.keys" not in str(refused.value)


def test_reading_a_journal_that_was_never_upgraded_says_to_upgrade_it(make_broker, request, tmp_path):
    """A PostgreSQL database the broker never migrated (`auto_upgrade` is off there): the read
    commands say what to run, not only that a relation does not exist."""
    from tests.conftest import database_url

    broker = make_broker("postgresql", start=False, db_url=database_url("postgresql", tmp_path, request))
    for args in (("invocations", "list"), ("metrics",), ("invocations", "show", "act_01M8TRTD8RSQZTD7JJN9HZ5237")):
        done = broker.command(*args)
        err = done.stderr.decode()
        assert done.returncode == 1 and "does not exist" in err and "run `affidavit db upgrade`" in err, (args, err)


def test_a_token_a_proxy_url_cannot_hold_raw_is_taken_but_warned_about(tmp_path, monkeypatch, caplog):
    """`x y@z` works once percent-encoded, and breaks a proxy URL written raw (`affidavit env`
    prints `$(cat FILE)` for a file token): the start says so, without the token itself."""
    import logging

    from proxy.app import resolve_tokens

    settings = load_settings(write(tmp_path, good(tmp_path)))
    for token, warned in (("x y@z", True), ("Ab9-._~", False)):
        monkeypatch.setenv("BUILDER_TOKEN", token)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="affidavit"):
            tokens, _ = resolve_tokens(settings)
        assert tokens["builder"] == token
        said = " ".join(r.getMessage() for r in caplog.records)
        assert ("must percent-encode ( @)" in said) is warned, said
        assert token not in said or not warned


def test_a_short_token_is_taken_but_warned_about_by_key_never_by_value(tmp_path, monkeypatch, caplog):
    import logging

    from proxy.app import SHORT_TOKEN, resolve_tokens

    settings = load_settings(write(tmp_path, good(tmp_path)))
    for token, warned in (("k7Q", True), ("k" * (SHORT_TOKEN - 1), True), ("k" * SHORT_TOKEN, False)):
        monkeypatch.setenv("BUILDER_TOKEN", token)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="affidavit"):
            assert resolve_tokens(settings)[0]["builder"] == token
        said = " ".join(r.getMessage() for r in caplog.records)
        assert (f"agents[0].token (agent 'builder') is {len(token)} characters long" in said) is warned, said
        assert token not in said


def test_config_given_before_the_command_is_the_commands_and_the_commands_own_wins(tmp_path):
    """`affidavit -c PATH cmd` reads PATH, as `affidavit cmd -c PATH` does (it once answered
    "No such option: -c"); given in both places, the one after the command's name wins."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}
    there = tmp_path / "there.toml"
    there.write_text(f'[database]\nurl = "sqlite+aiosqlite:///{tmp_path / "nowhere" / "j.db"}"\n')
    missing = tmp_path / "missing.toml"
    for args, said in [
        (["-c", str(there), "invocations", "list"], f"the directory of {tmp_path / 'nowhere' / 'j.db'} does not exist"),
        (["--config", str(missing), "db", "upgrade"], f"{missing}: no such configuration file"),
        (["-c", str(missing), "invocations", "list", "-c", str(there)], "the directory of"),
    ]:
        done = subprocess.run([AFFIDAVIT, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert done.returncode in (1, 2) and said in done.stderr, (args, done.stderr)
        assert "No such option" not in done.stderr and "no --config and no affidavit.toml" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.toml"], "nothing was created"


@pytest.mark.parametrize("operator,reviewer,said", [
    ("op-token-1234567890", "builder-token-12345", "agents[0].token (agent 'builder') and agents[1].token (agent 'reviewer')"),
    ("builder-token-12345", "reviewer-token-1234", "agents[0].token (agent 'builder') and api.operator_token"),
    ("op-token-1234567890", "op-token-1234567890", "agents[1].token (agent 'reviewer') and api.operator_token"),
])
def test_a_token_two_holders_share_stops_the_start(tmp_path, operator, reviewer, said):
    """The side API knows its caller by the token alone: a token two agents share, or an agent's
    that is also the operator's, would let an agent read another's records or approve its own
    held requests. `affidavit run` refuses it, naming the keys and never the value."""
    text = good(tmp_path) + '\n[[agents]]\nname = "reviewer"\ntoken = "env:REVIEWER_TOKEN"\n'
    text = text.replace('[api]\n', '[api]\noperator_token = "env:OPERATOR_TOKEN"\n', 1)
    config = write(tmp_path, text)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}
    env.update(BUILDER_TOKEN="builder-token-12345", REVIEWER_TOKEN=reviewer, OPERATOR_TOKEN=operator,
               PAYMENTS_KEY="sk_canary_value")
    for workers in ("1", "2") if reviewer == operator else ("1",):  # the supervisor checks before any worker
        done = subprocess.run([AFFIDAVIT, "run", "-c", str(config), "--workers", workers], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=env)
        assert done.returncode == 2, (workers, done.returncode, done.stderr[-2000:])
        assert "these tokens have the same value: " + said in done.stderr, done.stderr
        assert "builder-token-12345" not in done.stderr + done.stdout and "op-token" not in done.stderr + done.stdout
        assert "listening" not in done.stdout


def test_a_configuration_file_that_is_not_utf8_or_not_a_file_is_named_not_a_traceback(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[proxy]\nlisten = "127.0.0.1:9090"\n[log]\nlevel = "caf\xe9"\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(latin1)
    assert str(refused.value) == (f"{latin1}: not UTF-8 text (byte 0xe9 on line 4); TOML files are UTF-8: save it as "
                                  "UTF-8")
    with pytest.raises(ConfigError, match="a directory, not a configuration file"):
        load_settings(tmp_path)
    assert load_settings(Path("/dev/null")).proxy.listen == "127.0.0.1:8080", "an empty file: the defaults"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AFFIDAVIT_")}
    for args in (["invocations", "list", "-c", str(latin1)], ["run", "-c", str(latin1)]):
        done = subprocess.run([AFFIDAVIT, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert done.stderr == f"affidavit: {latin1}: not UTF-8 text (byte 0xe9 on line 4); TOML files are UTF-8: save it as UTF-8\n"


def test_an_empty_journal_file_is_started_on_with_a_warning_that_says_what_it_means(tmp_path, caplog):
    """SQLite takes a 0-byte file for a new database: a journal truncated to nothing was replaced
    by an empty one without a word, and every earlier invocation id answered 404 (found by a probe)."""
    import logging

    from proxy.app import prepare_database

    settings = load_settings(write(tmp_path, good(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="affidavit"):
        prepare_database(settings)  # no file yet: a new journal, nothing to say
    assert "the file is empty" not in caplog.text
    (tmp_path / "j.db").unlink()
    (tmp_path / "j.db").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="affidavit"):
        prepare_database(settings)
    assert "the file is empty (0 bytes), so a new, empty journal starts in it" in caplog.text
    assert "restore the file from a backup" in caplog.text


@pytest.mark.parametrize("journal", ["none yet, in a directory it cannot write", "a file it cannot write",
                                     "a file in a directory it cannot write"])
def test_a_sqlite_journal_the_broker_cannot_write_stops_the_start_and_says_why(tmp_path, journal):
    """Before, a read-only journal file started a broker that refused every request (readiness
    said "unreachable"), and a new one in a read-only directory said to check that the database
    is up and reachable. The broker is root without CAP_DAC_OVERRIDE (setpriv), as a user without
    write access is."""
    import os
    import shutil

    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's override of file permissions"
    directory = tmp_path / "journal"
    directory.mkdir()
    url = f"sqlite+aiosqlite:///{directory / 'affidavit.db'}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}, "AFFIDAVIT_DATABASE__URL": url}
    proxy_port, api_port = free_ports(2)
    env |= {"AFFIDAVIT_PROXY__LISTEN": f"127.0.0.1:{proxy_port}", "AFFIDAVIT_API__LISTEN": f"127.0.0.1:{api_port}"}
    if journal != "none yet, in a directory it cannot write":
        assert subprocess.run([AFFIDAVIT, "db", "upgrade"], capture_output=True, timeout=60, cwd=tmp_path, env=env).returncode == 0
        for leftover in directory.glob("affidavit.db-*"):
            leftover.unlink()
    if "a file" in journal:
        (directory / "affidavit.db").chmod(0o444)
    if "directory" in journal:
        directory.chmod(0o555)
    try:
        done = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", AFFIDAVIT, "run"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    finally:
        directory.chmod(0o755)
    assert done.returncode == 1, done.stdout + done.stderr
    said = {
        "none yet, in a directory it cannot write": f"the directory {directory} is not writable by this user (uid 0), so "
                                                    "the journal cannot be created there",
        "a file it cannot write": f"the journal file {directory / 'affidavit.db'} is not readable and writable by this "
                                  "user (uid 0)",
        "a file in a directory it cannot write": f"the directory {directory} is not writable by this user (uid 0), so "
                                                 "the journal cannot keep its -wal and -shm files beside it",
    }[journal]
    assert f"affidavit: cannot start: database.url {url}: {said}. Nothing was started; give this user write access" in done.stderr, done.stderr
    assert "proxy listening" not in done.stdout and "Traceback" not in done.stderr
    assert journal != "none yet, in a directory it cannot write" or not list(directory.iterdir()), "nothing was created"


@pytest.mark.parametrize(("entry", "said"), [
    ("k 1=env:X", "the key id 'k 1' is not 1 to 64 letters, digits, '_', '.' or '-'"),
    ("k" * 65 + "=file:/k", "is not 1 to 64 letters"),
    ("k1=vault:X", "each key is 'ID=env:NAME' or 'ID=file:/path'"),
    ("k1", "each key is 'ID=env:NAME' or 'ID=file:/path'"),
])
def test_a_key_entry_that_is_refused_says_whether_the_id_or_the_source_is_wrong(tmp_path, monkeypatch, entry, said):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AFFIDAVIT_CRYPTO__KEYS", f'["{entry}"]')
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert said in str(refused.value), str(refused.value)
