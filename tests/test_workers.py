"""``affidavit run --workers N``: several broker processes on one port and one journal, started,
restarted and stopped by one supervisor. Real processes, real sockets, real PostgreSQL."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import database_url
from tests.support.broker import AFFIDAVIT, BrokerProcess
from tests.support.envelopes import check_envelope
from tests.support.journal import query
from tests.support.relay import TcpRelay

PAY = "https://api.payments.test"


def worker_pids(broker: BrokerProcess) -> list[int]:
    found = re.findall(r"workers share these ports \(pids ([0-9, ]+)\)", broker.logs())
    assert found, broker.logs()[-2000:]
    return [int(p) for p in found[-1].split(", ")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture
def pg_url(request, tmp_path):
    """Ask for it before make_broker: fixtures are torn down last in, first out, and the database
    must be dropped after the brokers on it have stopped."""
    return database_url("postgresql", tmp_path, request)


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_workers_share_one_port_one_ca_and_one_journal(make_broker, upstream, dialect):
    broker = make_broker(dialect, proxy={"workers": 3})
    pids = worker_pids(broker)
    assert len(set(pids)) == 3
    listeners = subprocess.run(["ss", "-ltnpH", f"sport = :{broker.proxy_port}"], capture_output=True, text=True).stdout
    assert sorted(int(p) for p in re.findall(r"pid=(\d+)", listeners)) == sorted(pids), listeners

    sent = 45
    for i in range(sent):  # a new connection (and TLS handshake against the broker's CA) each time
        with broker.client() as client:
            response = client.get(PAY + f"/h/status?code=200&n={i}")
        assert response.status_code == 200 and response.headers["affidavit-outcome"] == "committed", response.text

    rows = query(broker.database_url, "SELECT owner FROM invocations")
    owners: dict[str, int] = {}
    for (owner,) in rows:
        instance = owner.split("/", 1)[0]
        owners[instance] = owners.get(instance, 0) + 1
    assert sum(owners.values()) == sent, owners
    assert len(owners) == 3 and all(re.search(r"#w[0-2]$", o) for o in owners), (
        f"the kernel spread {sent} connections over every worker, each its own instance: {owners}")

    def committed(api: httpx.Client) -> tuple[float, str]:
        text = api.get("/metrics").text
        return sum(float(v) for v in re.findall(r'^affidavit_invocations_total\{[^}]*outcome="committed"[^}]*\} (\S+)$', text, re.M)), text

    with httpx.Client(base_url=broker.api_url, headers={"Authorization": f"Bearer {broker.operator_token}"}) as api:
        # An end is counted once its write has landed: the last delivery record is written behind.
        deadline = time.monotonic() + 5
        while committed(api)[0] != sent and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(5):  # whichever worker answers, it counts every worker's invocations
            counted, text = committed(api)
            assert counted == sent, text


def test_a_worker_killed_mid_request_is_restarted_and_its_record_recovered(pg_url, make_broker, upstream):
    broker = make_broker(db_url=pg_url, proxy={"workers": 2}, env={"AFFIDAVIT_FAILPOINTS": "after_dispatch_commit=kill"})
    before = worker_pids(broker)
    with broker.client() as client:
        with pytest.raises(httpx.HTTPError):
            client.post(PAY + "/h/ok", content=b'{"amount":1}')
    rows = query(broker.database_url, "SELECT invocation_id FROM invocations")
    assert len(rows) == 1
    record = broker.wait_for(rows[0][0], lambda r: r["retry"] is not None, timeout=20)
    assert (record["outcome"], record["code"]) == ("unknown", "REMOTE_OUTCOME_UNKNOWN"), record
    assert upstream.effects == 0, "killed after DISPATCH_STARTED, before the first byte"
    deadline = time.monotonic() + 20
    while "worker" not in broker.logs().split("restarting it")[-1] and time.monotonic() < deadline:
        time.sleep(0.1)
    restarted = [e for e in broker.log_entries() if "restarting it" in e["msg"]]
    assert len(restarted) == 1 and restarted[0]["exit"] == "was killed by signal 9 (SIGKILL)", restarted
    assert re.fullmatch(r"worker \d \(pid \d+\) was killed by signal 9 \(SIGKILL\); restarting it .*", restarted[0]["msg"])
    assert restarted[0]["level"] == "error" and restarted[0]["logger"] == "affidavit.workers" and restarted[0]["ts"]
    assert len(re.findall(r"affidavit: worker \d ready", broker.logs())) == 3, broker.logs()[-2000:]
    assert sum(alive(p) for p in before) == 1, "the killed worker is gone, its sibling still serves"
    assert broker.proc is not None and broker.proc.poll() is None


def test_a_worker_that_keeps_dying_stops_the_broker(pg_url, make_broker, upstream):
    broker = make_broker(db_url=pg_url, proxy={"workers": 2}, env={"AFFIDAVIT_FAILPOINTS": "after_dispatch_commit=kill"})
    assert broker.proc is not None
    deadline = time.monotonic() + 90
    while broker.proc.poll() is None and time.monotonic() < deadline:
        try:
            with broker.client(timeout=5) as client:
                client.post(PAY + "/h/ok", content=b"{}")
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert broker.proc.returncode == 1, broker.logs()[-3000:]
    stopped = [e for e in broker.log_entries() if "stopping the broker" in e["msg"]]
    assert len(stopped) == 1 and stopped[0]["level"] == "error", stopped
    assert re.match(r"workers died 5 times within 60s while serving \(worker \d: was killed by signal 9", stopped[0]["msg"])
    assert upstream.effects == 0


def test_workers_stopped_one_by_one_with_a_signal_are_restarted_and_stop_nothing(pg_url, make_broker, upstream):
    """SIGTERM to single workers, more often than five times a minute (an operator recycling
    them): each says which signal it got, each is restarted, and the broker serves on.
    Counted as deaths, five of them had stopped the broker ("workers died 5 times ... See the log
    above for why", with nothing above saying why)."""
    broker = make_broker(db_url=pg_url, proxy={"workers": 2})
    assert broker.proc is not None
    for n in range(6):
        ready = len(re.findall(r"affidavit: worker \d ready \(pid (\d+)\)", broker.logs()))
        pid = int(re.findall(r"affidavit: worker \d ready \(pid (\d+)\)", broker.logs())[-1])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while len(re.findall(r"affidavit: worker \d ready", broker.logs())) == ready and time.monotonic() < deadline:
            assert broker.proc.poll() is None, broker.logs()[-3000:]
            time.sleep(0.1)
        assert len(re.findall(r"affidavit: worker \d ready", broker.logs())) == ready + 1, broker.logs()[-3000:]
    with broker.client() as client:
        assert client.post(PAY + "/h/ok", content=b"{}").status_code == 200
    assert broker.proc.poll() is None
    entries = broker.log_entries()
    received = [e["msg"].split(";")[0] for e in entries if e["msg"].startswith("received SIG")]
    assert received == ["received SIGTERM: stopping"] * 6, received
    clean = [e for e in entries if "stopped cleanly" in e["msg"]]
    assert len(clean) == 6 and all(e["level"] == "warning" for e in clean), clean
    assert not [e for e in entries if "stopping the broker" in e["msg"] or "workers died" in e["msg"]]


def test_a_ctrl_c_to_the_process_group_drains_the_workers(pg_url, make_broker, upstream):
    """Ctrl-C in a terminal signals the whole process group: the workers got SIGINT themselves and
    then the supervisor's SIGTERM, which they took for a second signal, so they stopped without
    their drain. A worker leaves SIGINT and SIGHUP to its supervisor: the exchange in flight ends
    and is delivered."""
    import concurrent.futures

    broker = make_broker(db_url=pg_url, proxy={"workers": 2, "drain": "8s"})
    assert broker.proc is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool, broker.client(timeout=30) as client:
        pending = pool.submit(client.post, PAY + "/h/slow?delay=2", content=b"{}")
        upstream.wait_for_requests(1, timeout=10)
        os.killpg(broker.proc.pid, signal.SIGINT)
        answer = pending.result(timeout=30)
        assert broker.proc.wait(30) == 0, broker.logs()[-3000:]
    assert answer.status_code == 200 and "affidavit-code" not in answer.headers, (answer.status_code, answer.text[:300])
    assert "received SIGTERM again" not in broker.logs(), broker.logs()[-3000:]
    assert upstream.effects == 1


def test_a_worker_that_cannot_restart_through_an_outage_stops_nothing_and_serves_again(pg_url, make_broker, upstream):
    """A worker killed while the database is down cannot start again (every start checks the
    journal); its restarts wait longer each time and are not the crash loop that stops the broker:
    its sibling goes on (refusing, as one broker does in an outage), and once the database answers
    the worker starts and both serve."""
    server = make_url(pg_url)
    with TcpRelay(server.host or "127.0.0.1", server.port or 5432) as relay:
        relayed = server.set(host="127.0.0.1", port=relay.listen_port).render_as_string(hide_password=False)
        broker = make_broker(db_url=relayed, proxy={"workers": 2})
        assert broker.proc is not None
        first, second = worker_pids(broker)
        relay.cut()
        os.kill(second, signal.SIGKILL)
        failed = r"worker \d \(pid \d+\) exited with status 1 before it was ready \((\d+) start\(s\) in a row"
        deadline = time.monotonic() + 90
        while len(re.findall(failed, broker.logs())) < 5 and time.monotonic() < deadline:
            assert broker.proc.poll() is None, broker.logs()[-3000:]
            time.sleep(0.2)
        assert [int(n) for n in re.findall(failed, broker.logs())][:5] == [1, 2, 3, 4, 5], broker.logs()[-3000:]
        assert re.findall(r"trying again in (\d+) s", broker.logs())[:5] == ["1", "2", "4", "8", "16"]
        assert broker.proc.poll() is None and alive(first), "five failed restarts did not stop the broker"
        assert "stopping the broker" not in broker.logs()
        relay.restore()
        deadline = time.monotonic() + 60
        while len(re.findall(r"affidavit: worker \d ready", broker.logs())) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(re.findall(r"affidavit: worker \d ready", broker.logs())) == 3, broker.logs()[-3000:]
        for i in range(8):  # new connections: the kernel spreads them over both workers again
            with broker.client() as client:
                assert client.get(PAY + f"/h/status?code=200&n={i}").status_code == 200
        assert broker.stop() == 0


def test_sigterm_stops_every_worker_and_a_killed_supervisor_leaves_none(pg_url, make_broker, upstream, tmp_path):
    temp = tmp_path / "temp"  # the supervisor's metrics directory goes here, out of other tests' way
    temp.mkdir()
    broker = make_broker(db_url=pg_url, proxy={"workers": 2}, env={"TMPDIR": str(temp)})
    pids = worker_pids(broker)
    assert broker.stop() == 0
    assert wait_gone(pids) == []
    assert os.listdir(temp) == [], "a stopped supervisor removes its metrics directory"
    broker.start()
    pids = worker_pids(broker)
    assert broker.proc is not None
    killed = broker.proc.pid
    os.kill(killed, signal.SIGKILL)  # the supervisor only; its workers must notice
    assert wait_gone(pids, timeout=10) == [], "orphaned workers keep serving"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", broker.proxy_port)) != 0
    [left] = os.listdir(temp)  # SIGKILL gave it no chance to remove it; the next supervisor does
    assert left.startswith(f"affidavit-metrics-{killed}-"), left
    someone_elses = temp / "affidavit-metrics-1-live"  # pid 1 is alive: not a leftover
    someone_elses.mkdir()
    broker.start()
    assert broker.proc is not None
    [own] = [name for name in os.listdir(temp) if name != "affidavit-metrics-1-live"]
    assert own.startswith(f"affidavit-metrics-{broker.proc.pid}-"), os.listdir(temp)
    assert broker.stop() == 0
    assert os.listdir(temp) == ["affidavit-metrics-1-live"]


def test_workers_refuse_a_taken_port(pg_url, make_broker, upstream):
    broker = make_broker(db_url=pg_url, proxy={"workers": 2}, start=False)
    assert broker.command("db", "upgrade").returncode == 0
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", broker.proxy_port))
        holder.listen(1)
        done = subprocess.run([AFFIDAVIT, "run", "--config", str(broker.config_path)], cwd=broker.workdir,
                              env=broker._env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"affidavit: cannot start: proxy.listen 127.0.0.1:{broker.proxy_port}" in done.stderr, done.stderr
    assert "ready" not in done.stdout


def test_a_worker_that_fails_to_start_stops_the_start(pg_url, make_broker, upstream):
    broker = make_broker(db_url=pg_url, start=False, env={"AFFIDAVIT_FAILPOINTS": "worker_start=raise"})
    assert broker.command("db", "upgrade").returncode == 0
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(broker.config_path), "--workers", "2"], cwd=broker.workdir,
                          env=broker._env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(r"affidavit: cannot start: worker \d exited with status \d+ during start-up", done.stderr), done.stderr[-3000:]
    assert "proxy listening on" not in done.stdout
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", broker.proxy_port)) != 0, "no worker is left listening"


def test_a_starting_worker_has_a_heartbeat_before_it_serves(pg_url, make_broker, upstream):
    """A worker takes connections on the shared port before it is ready; its siblings' sweeps
    must see it alive by then, or they take its fresh records for a dead broker's."""
    # The pause is long: on a loaded machine a first beat can time out (5 s) and be written by
    # the retry, still well inside it; neither worker is ready before it ends.
    broker = make_broker(db_url=pg_url, start=False, env={"AFFIDAVIT_FAILPOINTS": "worker_start=pause:30"})
    assert broker.command("db", "upgrade").returncode == 0
    proc = subprocess.Popen([AFFIDAVIT, "run", "--config", str(broker.config_path), "--workers", "2"], cwd=broker.workdir,
                            env=broker._env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # listening: paused at worker_start, not ready
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", broker.proxy_port)) == 0:
                    break
            assert proc.poll() is None
            time.sleep(0.1)
        paused_until = time.monotonic() + 25
        while len(rows := query(broker.database_url, "SELECT instance FROM brokers")) < 2 and time.monotonic() < paused_until:
            time.sleep(0.2)
        seen_in_the_pause = time.monotonic() < paused_until
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=90)
    assert seen_in_the_pause, (rows, output[-3000:])
    assert sorted(r[0][-3:] for r in rows) == ["#w0", "#w1"], (rows, output[-3000:])


def test_a_stop_under_load_logs_no_error_for_the_connections_it_cuts(make_broker, upstream):
    """Connections arriving as the workers stop had their handlers cancelled before they ran, and
    each logged 'Exception in callback StreamReaderProtocol.connection_made' with a CancelledError
    traceback at level error (a probe saw 14-23 per stop): noise an operator would chase."""
    import base64
    import threading

    broker = make_broker(proxy={"workers": 2})
    auth = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode()).decode()
    request = (f"GET {upstream.url('/h/ok')} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: Basic {auth}\r\n"
               "Connection: close\r\n\r\n").encode()
    until = time.monotonic() + 3

    def connect_again_and_again() -> None:
        while time.monotonic() < until:
            try:
                with socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=3) as sock:
                    sock.sendall(request)
                    sock.recv(1000)
            except OSError:
                pass

    threads = [threading.Thread(target=connect_again_and_again) for _ in range(30)]
    for thread in threads:
        thread.start()
    time.sleep(1)
    assert broker.stop() == 0
    for thread in threads:
        thread.join(10)
    logs = broker.logs()
    errors = [line for line in logs.splitlines() if '"level":"error"' in line]
    assert errors == [], errors[:3]
    assert "Traceback" not in logs and "never awaited" not in logs and "affidavit: stopped" in logs


def test_the_workers_option_overrides_the_file_and_one_worker_is_the_plain_broker(make_broker, upstream):
    broker = make_broker(proxy={"workers": 1})
    assert "workers share these ports" not in broker.logs()
    with broker.client() as client:
        body = client.get("https://nowhere.example.test/")
    assert check_envelope(body.content)["error"]["code"] == "INVALID_TARGET"


def test_without_a_configuration_file_the_defaults_notice_is_said_once_not_per_worker(tmp_path):
    from tests.support.broker import free_ports

    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    proxy_port, api_port = free_ports(2)
    env.update(AFFIDAVIT_PROXY__LISTEN=f"127.0.0.1:{proxy_port}", AFFIDAVIT_API__LISTEN=f"127.0.0.1:{api_port}")
    proc = subprocess.Popen([AFFIDAVIT, "run", "--workers", "2"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            seen.append(line)
            if "workers share these ports" in line:
                break
    finally:
        proc.send_signal(signal.SIGHUP)  # its terminal closed: a clean stop of every worker, as SIGTERM
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    text = "".join(seen) + rest
    assert "workers share these ports" in text, text[-3000:]
    assert proc.returncode == 0 and text.rstrip().endswith("affidavit: stopped"), text[-3000:]
    assert text.count("using the built-in defaults") == 1, text[-3000:]
