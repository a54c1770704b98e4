"""Instructions per request: each proxy under valgrind's callgrind, counted over N sequential
requests. A count of instructions does not drift with the machine's speed or with what else runs
on it, so two builds can be told apart by a few percent where ``run.py``'s rates cannot (two
instances of one binary differed by 30% there). It measures the proxy's own CPU work only: not
waits, not PostgreSQL's work, not the kernel's.

    python bench/instructions.py                                   # lean, affidavit-pg; http, https
    python bench/instructions.py --targets bare,lean,affidavit-pg,affidavit-sqlite
    python bench/instructions.py --baseline /tmp/base/.venv/bin/affidavit   # A/B two builds

How: every target starts under ``valgrind --tool=callgrind --instr-atstart=no`` (the broker as
``<venv>/bin/python -O -m proxy run``, so that valgrind wraps the serving process, not a launcher
that re-executes itself). Start-up and a warm-up of one keep-alive connection are not counted;
then ``callgrind_control`` zeroes the counters and switches instrumentation on, one client sends
N requests one after another on that connection, and a dump gives the instructions executed
(``Ir``) by the target's whole process tree (the SQLite journal's writer process included).
Affidavit targets must have recorded exactly warm-up + N invocations, or the run fails.

Slow: under callgrind the broker starts in about a minute and a counted request takes ~0.1 s.
Timers that fire during the counted window (the side API's replay tally, lease renewals) are
counted with it; they are the same for two builds and small next to N requests' work.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import http.client
import json
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    from project_venv import reexec_in_project_venv

    reexec_in_project_venv(__file__)

import procstat  # noqa: E402
import services  # noqa: E402
from services import Pki, StartError, Target, Upstream  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGETS = ("bare", "lean", "affidavit-pg", "affidavit-sqlite")
REPLY_TIMEOUT = 120.0  # seconds for one request under callgrind


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/instructions.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="lean,affidavit-pg", help=f"comma list of {','.join(TARGETS)} [lean,affidavit-pg]")
    p.add_argument("--paths", default="http,https", help="comma list of http,https [both]")
    p.add_argument("--requests", type=int, default=200, help="counted requests per target and path [200]")
    p.add_argument("--warmup", type=int, default=30, help="uncounted requests before them, same connection [30]")
    p.add_argument("--upstream", choices=["auto", "nginx", "asyncio"], default="auto")
    p.add_argument("--mitmdump", help="mitmdump binary (default: the project's venv)")
    p.add_argument("--affidavit", help="affidavit binary (default: the project's venv)")
    p.add_argument("--baseline", help="a second affidavit binary, counted as <target>@base")
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs, callgrind dumps)")
    a = p.parse_args(argv)
    a.targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    a.paths = [x.strip() for x in a.paths.split(",") if x.strip()]
    if any(t not in TARGETS for t in a.targets) or any(x not in ("http", "https") for x in a.paths):
        p.error(f"--targets takes {','.join(TARGETS)}; --paths takes http,https")
    if a.requests < 1 or a.warmup < 1:
        p.error("--requests and --warmup must be >= 1")
    if a.baseline:
        a.targets += [f"{t}@base" for t in a.targets if t.startswith("affidavit")]
    return a


# -- callgrind ---------------------------------------------------------------------------------


class Callgrind:
    """The command prefix for targets, and the counters of a running target's process tree."""

    def __init__(self, out_dir: Path) -> None:
        valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
        if not valgrind or not control:
            raise StartError("valgrind and callgrind_control are needed (Debian: apt-get install valgrind)")
        self.control = control
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.wrap = [
            valgrind, "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes",
            f"--callgrind-out-file={out_dir}/cg.%p",
        ]  # fmt: skip

    def _tell(self, pids: list[int], *args: str) -> None:
        for pid in pids:
            subprocess.run([self.control, *args, str(pid)], check=True, capture_output=True, timeout=120)

    def start_counting(self, pids: list[int]) -> None:
        self._tell(pids, "--zero")
        self._tell(pids, "--instr=on")

    def stop_counting(self, pids: list[int]) -> int:
        """Dump every process's counters since ``start_counting``, stop counting, and return
        their sum. (A dump after ``--instr=off`` reads 0; switching off writes a last, tiny part
        of its own, a few hundred to a few hundred thousand instructions, counted too.)"""
        before = {p: set(self.out_dir.glob(f"cg.{p}.*")) for p in pids}
        self._tell(pids, "--dump")
        self._tell(pids, "--instr=off")
        total = 0
        for pid in pids:
            new = set(self.out_dir.glob(f"cg.{pid}.*")) - before[pid]
            if not new:
                raise RuntimeError(f"callgrind: no new dump of pid {pid} in {self.out_dir}")
            total += sum(_total_ir(part) for part in new)
        return total


def _total_ir(dump: Path) -> int:
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"callgrind: no totals in {dump}")


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (under ``--trace-children=yes`` each is counted)."""
    return procstat.descendants(pid, procstat.ppid_map())


# -- a sequential client -------------------------------------------------------------------------


class Client:
    """One keep-alive connection through the proxy, as an agent opens it (``CONNECT`` with
    ``Proxy-Authorization`` for HTTPS, absolute-form requests for HTTP)."""

    def __init__(self, target: Target, upstream: Upstream, path: str) -> None:
        auth = "Basic " + base64.b64encode(f"{services.AGENT}:{services.TOKEN}".encode()).decode()
        self.headers = {"User-Agent": "affidavit-bench", "Accept": "*/*"}
        if path == "http":
            self.conn: http.client.HTTPConnection = http.client.HTTPConnection(
                "127.0.0.1", target.port, timeout=REPLY_TIMEOUT
            )
            self.url = f"http://127.0.0.1:{upstream.http_port}/"
            self.headers["Proxy-Authorization"] = auth
        else:
            ctx = ssl.create_default_context(cafile=str(target.ca))
            self.conn = http.client.HTTPSConnection("127.0.0.1", target.port, timeout=REPLY_TIMEOUT, context=ctx)
            self.conn.set_tunnel("localhost", upstream.https_port, headers={"Proxy-Authorization": auth})
            self.url = "/"

    def send(self, n: int) -> None:
        for i in range(n):
            self.conn.request("GET", self.url, headers=self.headers)
            resp = self.conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"request {i + 1} answered {resp.status}: {body[:200]!r}")

    def close(self) -> None:
        self.conn.close()


# -- the run -------------------------------------------------------------------------------------


def start(name: str, args: argparse.Namespace, tmp: Path, pki: Pki, upstream: Upstream, wrap: list[str]) -> Target:
    base = name.removesuffix("@base")
    if base == "bare":
        mitmdump = services.find_tool("mitmdump", args.mitmdump)
        if not mitmdump:
            raise StartError("no mitmdump binary found (use --mitmdump)")
        return services.start_bare(tmp, pki, mitmdump, wrap=wrap, timeout=600)
    if base == "lean":
        return services.start_lean(tmp, pki, wrap=wrap, timeout=600)
    binary = args.baseline if name.endswith("@base") else services.find_tool("affidavit", args.affidavit)
    if not binary:
        raise StartError("no affidavit binary found (use --affidavit)")
    return services.start_affidavit(
        name, tmp, pki, binary, upstream, "pg" if base == "affidavit-pg" else "sqlite", wrap=wrap, timeout=600
    )


def count_one(target: Target, path: str, args: argparse.Namespace, upstream: Upstream, cg: Callgrind) -> dict[str, Any]:
    before = target.count_invocations() if target.count_invocations else None
    client = Client(target, upstream, path)
    try:
        client.send(args.warmup)
        pids = tree(target.child.pid)
        cg.start_counting(pids)
        t0 = time.monotonic()
        client.send(args.requests)
        seconds = time.monotonic() - t0
        instructions = cg.stop_counting(pids)
    finally:
        client.close()
    record: dict[str, Any] = {
        "target": target.name,
        "path": path,
        "requests": args.requests,
        "instructions": instructions,
        "per_request": instructions / args.requests,
        "processes": len(pids),
        "seconds_under_callgrind": round(seconds, 1),
    }
    if before is not None and target.count_invocations:
        grown = target.count_invocations() - before
        record["journal_growth"] = grown
        if grown != args.warmup + args.requests:
            raise RuntimeError(
                f"{target.name} {path}: the journal grew by {grown} invocations for "
                f"{args.warmup + args.requests} requests sent"
            )
    return record


def report(records: list[dict[str, Any]]) -> None:
    """One line per cell, with its ratio to ``lean`` and ``bare`` of the same path and, for a
    ``--baseline`` pair, the ratio of the build under test to the baseline."""
    by = {(r["target"], r["path"]): r["per_request"] for r in records}
    refs = [t for t in ("lean", "bare") if any(k[0] == t for k in by)]
    has_base = any(k[0].endswith("@base") for k in by)
    head = f"{'target':<22} {'path':<6} {'instructions/request':>21}" + "".join(f" {'x ' + t:>8}" for t in refs)
    head += f" {'x base':>8}" if has_base else ""
    print(head)
    print("-" * len(head))
    for r in records:
        cols = "".join(
            f" {r['per_request'] / by[(t, r['path'])]:>8.2f}" if (t, r["path"]) in by else f" {'-':>8}" for t in refs
        )
        if has_base:
            base = by.get((r["target"] + "@base", r["path"]))
            cols += f" {r['per_request'] / base:>8.3f}" if base else f" {'-':>8}"
        print(f"{r['target']:<22} {r['path']:<6} {r['per_request']:>21,.0f}{cols}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    tmp = Path(tempfile.mkdtemp(prefix="affidavit-instr-"))
    keep = args.keep_tmp
    records: list[dict[str, Any]] = []
    failed: list[str] = []
    upstream: Upstream | None = None
    try:
        cg = Callgrind(tmp / "callgrind")
        pki = services.make_pki(tmp / "pki")
        upstream = services.start_upstream(args.upstream, tmp, pki)
        print(f"upstream: {upstream.kind}; {args.warmup} warm-up + {args.requests} counted requests per cell", flush=True)
        for name in args.targets:
            t0 = time.monotonic()
            try:
                target = start(name, args, tmp, pki, upstream, cg.wrap)
            except StartError as exc:
                failed.append(f"{name} did not start: {exc}")
                print(f"FAIL {failed[-1]}", flush=True)
                continue
            print(f"  started {name} under callgrind in {time.monotonic() - t0:.0f}s", flush=True)
            try:
                for path in args.paths:
                    try:
                        records.append(count_one(target, path, args, upstream, cg))
                    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                        failed.append(f"{name} {path}: {exc}")
                        print(f"FAIL {failed[-1]}", flush=True)
                        continue
                    r = records[-1]
                    print(f"  {name} {path}: {r['per_request']:,.0f} instructions/request", flush=True)
            finally:
                failed += services.stop_target(target)
    except StartError as exc:
        failed.append(str(exc))
    finally:
        if upstream is not None:
            upstream.child.stop()
    print()
    report(records)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"instructions-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    meta = {"started": started.isoformat(), "args": {k: str(v) for k, v in vars(args).items()}}
    out.write_text(json.dumps({"meta": meta, "records": records, "failed": failed}, indent=2))
    print(f"\nresults: {out}")
    if failed:
        keep = True
        print("FAIL:\n" + "\n".join(f"  - {f.splitlines()[0]}" for f in failed))
    if keep:
        print(f"temp dir kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
