"""``procgroup top``: a live view of a running job, one row per rank, from the status records its ranks publish.

Every rank publishes a small JSON record to the job's store every second (:mod:`procgroup.telemetry`);
this module reads them and draws one table: host, pid, state, the collective in flight and its group, its
sequence number, time in it (or, between collectives, time in the rank's own code), bytes sent per second,
RSS and CPU %.  Ranks that hold the others up are highlighted (see :func:`assess`).

Attach by run id (the run-info file ``procgroup run`` leaves on this machine, :mod:`.runinfo`), or by store
address with the job's secret.  ``--once`` prints the table once as plain text, ``--json`` as JSON; otherwise
the table refreshes in the terminal (ANSI, alternate screen) until ``q`` or Ctrl-C.

Layers: :func:`assess` and :func:`render` are pure (records in, verdicts and lines out); :class:`Reader` is
the I/O (one store connection); :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import select
import shutil
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..config import ENV, env_str
from ..deadline import Deadline
from ..errors import ConfigError, ProcGroupError
from ..telemetry import RECORD_VERSION, top_key
from .runinfo import RunInfo, find_run, running_jobs

__all__ = [
    "Target",
    "Row",
    "Snapshot",
    "assess",
    "make_rows",
    "render",
    "snapshot_json",
    "Reader",
    "reattach",
    "live",
    "build_parser",
    "main",
    "DEFAULT_STUCK_AFTER",
]

#: seconds a rank must have waited in a collective before the ranks it waits for are highlighted
DEFAULT_STUCK_AFTER = 2.0
#: a record older than this many of its rank's intervals (and at least STALE_MIN seconds) is stale
STALE_INTERVALS = 3.0
STALE_MIN = 3.0
#: the highlight of a stuck row: bold, red, reverse video
HIGHLIGHT = "\x1b[1;31;7m"
RESET = "\x1b[0m"


@dataclass(frozen=True)
class Target:
    """Where the job's store is and how to prove the job's secret."""

    host: str
    port: int
    secret: str
    run_id: Optional[str] = None
    world_size: Optional[int] = None
    #: the agent of a job found by its run-info file (its next generation can be found again)
    agent_pid: Optional[int] = None

    @property
    def store(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Row:
    """One rank's line of the table (from its record, or its absence)."""

    rank: int
    host: str
    pid: Optional[int]
    #: op (in a collective) | compute (in its own code) | failed (its last collective failed)
    #: | stale (no fresh record) | missing (never published)
    state: str
    op: Optional[str]  # the collective's call, e.g. 'all_reduce(float32, 4, SUM)'
    group: Optional[str]
    seq: Optional[int]  # the seq in flight, else the last completed seq of the default group
    secs: Optional[float]  # time in the current op, else since the last collective ended (now, not at publish)
    bps: Optional[float]
    rss: Optional[int]
    cpu: Optional[float]
    age: Optional[float]  # seconds since the record was written


@dataclass(frozen=True)
class Snapshot:
    """One refresh: the rows, the verdicts (rank -> why it is highlighted) and where they came from."""

    target: Target
    time: float
    world_size: int
    rows: List[Row]
    stuck: Dict[int, str]
    stuck_after: float


def _stale_after(rec: Mapping[str, Any]) -> float:
    try:
        ival = float(rec.get("ival") or 1.0)
    except (TypeError, ValueError):
        ival = 1.0
    return max(STALE_INTERVALS * ival, STALE_MIN)


def _age(rec: Mapping[str, Any], now: float) -> float:
    return max(0.0, now - float(rec.get("t") or now))


def make_rows(records: Mapping[int, Optional[Mapping[str, Any]]], world: int, now: float) -> List[Row]:
    """The table's rows, rank by rank (``records``: rank -> its record, None or absent when there is none)."""
    rows = []
    for r in range(world):
        rec = records.get(r)
        if rec is None:
            rows.append(Row(r, "?", None, "missing", None, None, None, None, None, None, None, None))
            continue
        age = _age(rec, now)
        op = rec.get("op")
        state = str(rec.get("state") or "?")
        if age > _stale_after(rec):
            state = "stale"
        if op:
            secs: Optional[float] = float(op.get("secs") or 0.0) + age
            what, group, seq = op.get("sig"), op.get("group"), op.get("seq")
        else:
            idle = rec.get("idle")
            secs = float(idle) + age if idle is not None else None
            what, group, seq = None, None, rec.get("last")
        rows.append(
            Row(
                rank=r,
                host=str(rec.get("host") or "?"),
                pid=rec.get("pid"),
                state=state,
                op=what,
                group=group,
                seq=seq,
                secs=secs,
                bps=rec.get("bps"),
                rss=rec.get("rss"),
                cpu=rec.get("cpu"),
                age=age,
            )
        )
    return rows


def _ranks(rs: Sequence[int]) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(str(r) for r in rs)


def _reached(rec: Optional[Mapping[str, Any]], gid: int, seq: int) -> bool:
    """Whether the rank of ``rec`` has called (or finished) collective ``seq`` of group ``gid``."""
    if rec is None:
        return False
    g = (rec.get("g") or {}).get(str(gid))
    if not g:
        return False
    last, inflight = g[0], g[1]
    return (inflight is not None and inflight >= seq) or (last is not None and last >= seq)


def assess(
    records: Mapping[int, Optional[Mapping[str, Any]]],
    world: int,
    now: float,
    stuck_after: float = DEFAULT_STUCK_AFTER,
) -> Dict[int, str]:
    """Which ranks to highlight, and why (rank -> reason); pure.

    * A rank that others have waited for at least ``stuck_after`` seconds: members of a group that are in
      its collective number ``seq``, while this rank has not called it yet ("ranks 0, 1, 3 have waited 12.3s
      for it in all_reduce(...) (seq 5, group WORLD)").  This names the straggler, not the waiters.
    * A rank still in a collective ``stuck_after`` seconds after every other member completed it.
    * A rank whose record is stale (its process is stopped, dead, or holds the GIL), or missing while
      other ranks have published.
    * A rank whose last collective failed.
    """
    why: Dict[int, str] = {}
    waited: Dict[int, List[tuple[int, float, Mapping[str, Any]]]] = {}
    any_record = any(records.get(r) is not None for r in range(world))
    for w in range(world):
        rec = records.get(w)
        if rec is None:
            if any_record:
                why[w] = "has not published a status record (not started, dead, or PROCGROUP_TOP_INTERVAL=0)"
            continue
        age = _age(rec, now)
        if age > _stale_after(rec):
            why[w] = f"no status record for {age:.1f}s (the process is stopped, dead, or holds the GIL)"
            continue
        if rec.get("state") == "failed":
            why[w] = "its last collective failed"
        op = rec.get("op")
        if not op:
            continue
        elapsed = float(op.get("secs") or 0.0) + age
        if elapsed < stuck_after:
            continue
        gid, seq = int(op.get("gid", 0)), int(op.get("seq", 0))
        members = op.get("members")
        members = list(range(world)) if members is None else [int(m) for m in members]
        behind = [m for m in members if m != w and not _reached(records.get(m), gid, seq)]
        for m in behind:
            waited.setdefault(m, []).append((w, elapsed, op))
        others = [records.get(m) for m in members if m != w]
        if others and all(o is not None and _completed(o, gid, seq) for o in others):
            why[w] = (
                f"still in {op.get('sig')} (seq {seq}, group {op.get('group')}) {elapsed:.1f}s after every "
                "other member completed it"
            )
    for m, ws in waited.items():
        if m in why and why[m].startswith("no status record"):
            why[m] += "; " + _waited_text(ws)
            continue
        why[m] = _waited_text(ws) + (f"; {why[m]}" if m in why else "")
    return dict(sorted(why.items()))


def _completed(rec: Mapping[str, Any], gid: int, seq: int) -> bool:
    g = (rec.get("g") or {}).get(str(gid))
    return g is not None and len(g) > 0 and g[0] is not None and g[0] >= seq


def _waited_text(ws: List[tuple[int, float, Mapping[str, Any]]]) -> str:
    longest = max(ws, key=lambda x: x[1])
    op = longest[2]
    verb = "has" if len(ws) == 1 else "have"
    return (
        f"{_ranks([w for w, _, _ in ws])} {verb} waited {longest[1]:.1f}s for it in {op.get('sig')} "
        f"(seq {op.get('seq')}, group {op.get('group')})"
    )


# ------------------------------------------------------------------------------------------------ text


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return "-"  # pragma: no cover - the loop always returns


def _secs(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: max(0, n - 1)] + "~"


#: (title, width, right-aligned)
_COLUMNS = (
    ("RANK", 5, True),
    ("HOST", 12, False),
    ("PID", 7, True),
    ("STATE", 7, False),
    ("OP", 30, False),
    ("GROUP", 8, False),
    ("SEQ", 6, True),
    ("TIME", 7, True),
    ("SENT/s", 8, True),
    ("RSS", 7, True),
    ("CPU%", 6, True),
)


def _line(cells: Sequence[str], mark: str) -> str:
    parts = []
    for (_, w, right), c in zip(_COLUMNS, cells):
        c = _cut(c, w)
        parts.append(c.rjust(w) if right else c.ljust(w))
    return mark + " " + " ".join(parts)


def _cells(row: Row) -> List[str]:
    return [
        str(row.rank),
        row.host,
        "-" if row.pid is None else str(row.pid),
        row.state,
        row.op or "-",
        row.group or "-",
        "-" if row.seq is None else str(row.seq),
        _secs(row.secs),
        _bytes(row.bps),
        _bytes(row.rss),
        "-" if row.cpu is None else f"{row.cpu:.1f}",
    ]


def render(snap: Snapshot, width: Optional[int] = None, color: bool = False, footer: str = "") -> List[str]:
    """The table as lines: a header, one row per rank (stuck ones marked ``!``, and in ``color`` shown in
    reverse red), then one line per stuck rank saying why.  ``width`` cuts every line to that many columns."""
    t = snap.target
    head = f"procgroup top - run {t.run_id or '?'} - store {t.store} - {snap.world_size} ranks - " + time.strftime(
        "%H:%M:%S", time.localtime(snap.time)
    )
    if footer:
        head += f" - {footer}"
    lines: List[tuple[str, bool]] = [(head, False), (_line([c[0] for c in _COLUMNS], " "), False)]
    for row in snap.rows:
        stuck = row.rank in snap.stuck
        lines.append((_line(_cells(row), "!" if stuck else " "), stuck))
    if snap.stuck:
        lines.append(("", False))
        for r, why in snap.stuck.items():
            lines.append((f"! rank {r}: {why}", False))
    elif snap.rows and all(r.state == "missing" for r in snap.rows):
        lines.append(("", False))
        lines.append(("no rank has published a status record yet", False))
    out = []
    for text, hl in lines:
        if width is not None:
            text = text[:width]
        if color and hl:
            text = HIGHLIGHT + text.ljust(width or 0) + RESET
        out.append(text)
    return out


def snapshot_json(snap: Snapshot) -> Dict[str, Any]:
    """The snapshot for ``--json``: the job, one object per rank (with ``stuck`` and ``why``), the stuck ranks."""
    return {
        "run_id": snap.target.run_id,
        "store": snap.target.store,
        "time": snap.time,
        "world_size": snap.world_size,
        "stuck_after": snap.stuck_after,
        "ranks": [
            {
                "rank": r.rank,
                "host": r.host,
                "pid": r.pid,
                "state": r.state,
                "op": r.op,
                "group": r.group,
                "seq": r.seq,
                "secs": None if r.secs is None else round(r.secs, 3),
                "sent_bytes_per_s": r.bps,
                "rss_bytes": r.rss,
                "cpu_percent": r.cpu,
                "record_age": None if r.age is None else round(r.age, 3),
                "stuck": r.rank in snap.stuck,
                "why": snap.stuck.get(r.rank),
            }
            for r in snap.rows
        ],
        "stuck": [{"rank": r, "why": w} for r, w in snap.stuck.items()],
    }


# ------------------------------------------------------------------------------------------------ I/O


class Reader:
    """One connection to the job's store; :meth:`snapshot` reads every rank's record.

    Raises ConnectError/AuthenticationError (from the store client) when the store cannot be reached or the
    secret is wrong.
    """

    def __init__(self, target: Target, timeout: float = 10.0) -> None:
        from ..store import TCPStore  # noqa: PLC0415 - the launcher may use the library; only top needs it

        self.target = target
        self.world = target.world_size
        self.store = TCPStore(target.host, target.port, secret=target.secret, timeout=timeout, connect_timeout=timeout)
        self._present: set[int] = set()

    def close(self) -> None:
        """Close the connection."""
        self.store.close()

    def records(self) -> Dict[int, Optional[Dict[str, Any]]]:
        """rank -> its latest record (None: none yet); learns the world size from rank 0's record if needed."""
        if self.world is None:
            if not self.store.check([top_key(0)]):
                return {}
            self.world = int(json.loads(self.store.get(top_key(0), timeout=2.0))["world"])
        for r in range(self.world):
            if r not in self._present and self.store.check([top_key(r)]):
                self._present.add(r)
        ranks = sorted(self._present)
        out: Dict[int, Optional[Dict[str, Any]]] = {r: None for r in range(self.world)}
        if ranks:
            for r, raw in zip(ranks, self.store.multi_get([top_key(r) for r in ranks], timeout=2.0)):
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("v") == RECORD_VERSION:
                    out[r] = rec
        return out

    def snapshot(self, stuck_after: float) -> Snapshot:
        """Read every record now and assess them."""
        recs = self.records()
        now = time.time()
        world = self.world or 0
        return Snapshot(
            self.target, now, world, make_rows(recs, world, now), assess(recs, world, now, stuck_after), stuck_after
        )

    def wait_complete(self, deadline: Deadline, stuck_after: float) -> Snapshot:
        """Snapshots until every rank has a record or ``deadline`` passes; the last one."""
        while True:
            snap = self.snapshot(stuck_after)
            if (snap.world_size and all(r.state != "missing" for r in snap.rows)) or deadline.expired():
                return snap
            time.sleep(min(0.2, max(0.0, deadline.remaining())))


def reattach(target: Target, environ: Mapping[str, str], timeout: float) -> Optional[Reader]:
    """After the store went away: a reader of the same job's next generation (``--max-restarts``: the agent starts
    new workers, whose rank 0 opens a new store), or None when the job has ended (its run-info file is gone) or
    no store came up within ``timeout`` seconds.  Only a job found by its run-info file can be followed."""
    if target.agent_pid is None:
        return None
    deadline = Deadline.after(timeout)
    while not deadline.expired():
        try:
            info = find_run(target.run_id, environ, agent_pid=target.agent_pid)
        except ConfigError:
            return None
        try:
            return Reader(_target_of(info), max(0.5, deadline.remaining()))
        except ProcGroupError:
            time.sleep(min(0.2, max(0.0, deadline.remaining())))
    return None


def live(
    reader: Reader,
    interval: float,
    stuck_after: float,
    out: IO[str],
    fd: int,
    follow: Optional[Callable[[], Optional[Reader]]] = None,
) -> int:
    """Redraw the table every ``interval`` s on the terminal ``fd`` until ``q``, Ctrl-C or the end of the job (its
    store goes away and ``follow()``, e.g. :func:`reattach`, finds no next generation; said on stderr); returns 0.
    Readers that ``follow`` returns are closed here."""
    import termios  # noqa: PLC0415 - POSIX terminals only
    import tty  # noqa: PLC0415

    old = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    out.write("\x1b[?1049h\x1b[?25l")
    ended: Optional[str] = None
    opened: Optional[Reader] = None
    try:
        while True:
            try:
                snap = reader.snapshot(stuck_after)
            except ProcGroupError as e:
                nxt = follow() if follow is not None else None
                if nxt is None:
                    ended = str(e)
                    break
                if opened is not None:
                    opened.close()
                reader = opened = nxt
                continue
            size = shutil.get_terminal_size()
            lines = render(snap, size.columns, color=True, footer=f"every {interval:g}s, q quits")[: size.lines]
            out.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in lines[:-1]) + lines[-1] + "\x1b[K\x1b[J")
            out.flush()
            ready, _, _ = select.select([fd], [], [], interval)
            if ready and os.read(fd, 64).lower().find(b"q") >= 0:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if opened is not None:
            opened.close()
        out.write("\x1b[?25h\x1b[?1049l")
        out.flush()
        termios.tcsetattr(fd, termios.TCSADRAIN, old)
    if ended is not None:
        sys.stderr.write(f"procgroup top: the job has ended (its store went away: {ended})\n")
    return 0


# ------------------------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``procgroup top``."""
    p = argparse.ArgumentParser(
        prog="procgroup top",
        allow_abbrev=False,
        description=(
            "Live view of a running job: one row per rank with its host, pid, state, the collective in flight, "
            "its group, sequence number and time in it, bytes sent per second, RSS and CPU %. Ranks that hold "
            "the others up are highlighted. The ranks publish their status every second "
            f"({ENV.TOP_INTERVAL}; 0 turns it off)."
        ),
        epilog=(
            "Examples: procgroup top (the only job on this machine) | procgroup top 3f2a9c1b7d4e --once | "
            f"{ENV.SECRET}=... procgroup top --store h1:29500 --json"
        ),
    )
    p.add_argument("run_id", nargs="?", metavar="RUN_ID", help="the job's run id (default: the only running job)")
    p.add_argument("--store", metavar="HOST:PORT", help="attach by the workers' store address (MASTER_ADDR:PORT)")
    p.add_argument(
        "--secret-file", metavar="FILE", help=f"with --store: read the job secret from FILE (default ${ENV.SECRET})"
    )
    p.add_argument("--agent-pid", type=int, metavar="PID", help="pick one of several jobs with the same run id")
    p.add_argument("--list", action="store_true", help="list the running jobs started on this machine and exit")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--once", action="store_true", help="print the table once as plain text and exit")
    g.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh interval of the live view")
    p.add_argument(
        "--stuck-after",
        type=float,
        default=DEFAULT_STUCK_AFTER,
        metavar="S",
        help=f"highlight ranks the others have waited for this long (default {DEFAULT_STUCK_AFTER:g} s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="how long to try to reach the store, and (--once, --json) to wait for every rank's record",
    )
    return p


def _split_store(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ConfigError(f"--store {value!r}: give HOST:PORT, e.g. --store 127.0.0.1:29500")
    try:
        return host, int(port)
    except ValueError:
        raise ConfigError(f"--store {value!r}: port {port!r} is not a number") from None


def resolve_target(ns: argparse.Namespace, environ: Mapping[str, str]) -> Target:
    """The job to attach to: ``--store`` (with ``PROCGROUP_SECRET`` or ``--secret-file``), else the run-info file
    of ``RUN_ID`` (or of the only running job).  Raises ConfigError saying what to give."""
    if ns.store is not None:
        host, port = _split_store(ns.store)
        secret = env_str(ENV.SECRET, environ)
        if ns.secret_file is not None:
            from .slurm import read_secret_file  # noqa: PLC0415

            secret = read_secret_file(ns.secret_file)
            if secret is None:
                raise ConfigError(f"--secret-file {ns.secret_file!r}: no such file")
        if secret is None:
            raise ConfigError(
                f"--store {ns.store}: the store checks the job secret; set {ENV.SECRET} or pass --secret-file FILE"
            )
        return Target(host, port, secret, run_id=ns.run_id)
    if ns.secret_file is not None:
        raise ConfigError("--secret-file goes with --store; a run id's run-info file carries the secret itself")
    return _target_of(find_run(ns.run_id, environ, agent_pid=ns.agent_pid))


def _target_of(info: RunInfo) -> Target:
    return Target(
        info.store_addr,
        info.store_port,
        info.secret,
        run_id=info.run_id,
        world_size=info.world_size,
        agent_pid=info.agent_pid,
    )


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """``procgroup top``: 0 on success, 1 when the job cannot be reached, 2 for bad arguments."""
    env = os.environ if environ is None else environ
    p = build_parser()
    ns = p.parse_args(argv)
    if not ns.interval > 0 or not ns.timeout > 0 or not ns.stuck_after >= 0:
        p.error("--interval and --timeout must be > 0 seconds, --stuck-after >= 0")
    live_view = not (ns.once or ns.json or ns.list)
    if live_view and not (sys.stdout.isatty() and sys.stdin.isatty()):
        p.error("the live view needs a terminal; use --once (text) or --json for a pipe or a file")
    target: Optional[Target] = None
    try:
        if ns.list:
            jobs = running_jobs(env)
            for j in jobs:
                print(j.describe())
            if not jobs:
                print("no running jobs started by `procgroup run` on this machine")
            return 0
        target = resolve_target(ns, env)
        reader = Reader(target, ns.timeout)
    except ConfigError as e:
        sys.stderr.write(f"procgroup top: error: {e}\n")
        return 1
    except ProcGroupError as e:
        where = target.store if target is not None else "?"
        sys.stderr.write(f"procgroup top: error: cannot reach the job's store at {where}: {e}\n")
        return 1
    try:
        if live_view:
            follow = functools.partial(reattach, target, env, ns.timeout)
            return live(reader, ns.interval, ns.stuck_after, sys.stdout, sys.stdin.fileno(), follow)
        snap = reader.wait_complete(Deadline.after(ns.timeout), ns.stuck_after)
        if ns.json:
            print(json.dumps(snapshot_json(snap), indent=1))
        else:
            print("\n".join(render(snap)))
        return 0
    except ProcGroupError as e:
        sys.stderr.write(f"procgroup top: error: reading the job's store at {target.store}: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        reader.close()
