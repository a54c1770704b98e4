"""CPU accounting from /proc, with no third-party dependency (psutil is not installed here).

Why /proc and not wall-clock throughput alone: on a noisy 2-core machine, req/s moves with
whatever else runs, but CPU *per request* of the proxy process is a much steadier figure of the
cost the proxy adds. We read ``utime+stime`` (plus ``cutime+cstime``, the CPU of children that
already exited) in clock ticks (usually 10 ms) and convert to seconds.

PostgreSQL is accounted in two ways:

* ``pg_own``: the backends connected to *our* benchmark database plus the server-wide
  background processes (WAL writer, checkpointer, background writer, ...). Other clients'
  backends are left out, so another engineer's tests hitting the same server do not show up
  as Affidavit's cost. This is the figure the report prints.
* ``pg_all``: every ``postgres`` process plus what the postmaster reaped from exited backends
  (its ``cutime+cstime``). Kept in the JSON for completeness; it includes foreign load.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")

# "postgres: 15/main: user dbname 127.0.0.1(5432) idle" - a client backend's process title.
_PG_CLIENT = re.compile(rb"^postgres: (?:[^:]+: )?(\S+) (\S+) (?:\S+\(\d+\)|\[local\]|\S+)")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(b")") + 2 :].decode().split()


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """CPU time (user+sys) of one process; with ``children``, also of its reaped children."""
    f = _stat_fields(pid)
    if f is None:
        return 0.0
    # After the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14).
    ticks = int(f[11]) + int(f[12])
    if children:
        ticks += int(f[13]) + int(f[14])
    return ticks / CLK_TCK


def ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat_fields(int(name))
            if f is not None:
                out[int(name)] = int(f[1])
    return out


def descendants(pid: int, parents: dict[int, int]) -> list[int]:
    """``pid`` and every live process below it, from the parent links in ``/proc/*/stat``
    (``/proc/<pid>/task/*/children`` would be cheaper, but not every kernel has it - the
    reference machine's does not). mitmdump and a broker on PostgreSQL are one process; on
    SQLite a broker has a journal writer child; ``affidavit run --workers N`` is a supervisor
    with N worker children (each with its writer on SQLite); nginx is master + worker."""
    found = [pid]
    frontier = {pid}
    while frontier:
        nxt = [child for child, parent in parents.items() if parent in frontier]
        found.extend(nxt)
        frontier = set(nxt)
    return found


@dataclass(frozen=True, slots=True)
class TreeCpu:
    seconds: float  # user+sys of every live process of the tree, plus what they reaped
    pids: list[int]  # the root first, then its live descendants


def trees_cpu(roots: dict[str, int]) -> dict[str, TreeCpu]:
    """CPU of several process trees (name -> root pid), from one scan of ``/proc``. A child
    that exited was reaped by its parent in the tree, so its CPU is in that parent's ``cutime``."""
    parents = ppid_map()
    out: dict[str, TreeCpu] = {}
    for name, root in roots.items():
        pids = descendants(root, parents)
        out[name] = TreeCpu(sum(cpu_seconds(p, children=True) for p in pids), pids)
    return out


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class PgCpu:
    own: float
    all: float


def postgres_cpu(database: str | None) -> PgCpu:
    """CPU seconds of the PostgreSQL server, see the module docstring for ``own`` vs ``all``."""
    own = 0.0
    total = 0.0
    db = database.encode() if database else None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/comm", "rb") as fh:
                if fh.read().strip() != b"postgres":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").strip()
        except OSError:
            continue
        f = _stat_fields(pid)
        if f is None:
            continue
        mine = (int(f[11]) + int(f[12])) / CLK_TCK
        is_postmaster = not cmdline.startswith(b"postgres:")
        if is_postmaster:
            # The postmaster reaps every exited backend: its cutime holds their CPU.
            total += mine + (int(f[13]) + int(f[14])) / CLK_TCK
            own += mine
            continue
        total += mine
        client = _PG_CLIENT.match(cmdline)
        if client is None:
            own += mine  # a background process: WAL writer, checkpointer, ...
        elif db is not None and client.group(2) == db:
            own += mine
    return PgCpu(own=own, all=total)


@dataclass(frozen=True, slots=True)
class MachineCpu:
    """Aggregate CPU of the whole machine (from /proc/stat), to estimate outside noise."""

    busy: float
    total: float


def machine_cpu() -> MachineCpu:
    with open("/proc/stat", "rb") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return MachineCpu(busy=(total - idle) / CLK_TCK, total=total / CLK_TCK)
