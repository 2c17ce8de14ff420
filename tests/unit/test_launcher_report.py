"""Root-cause selection, exit codes and the summary table of ``procgroup run`` (pure data)."""

from __future__ import annotations

import json
import signal

from procgroup.launcher.report import (
    Outcome,
    RunResult,
    WorkerResult,
    format_root_cause,
    format_summary,
    load_error_file,
)

T0 = 1_000_000.0


def w(rank: int, rc: int, end: float = 1.0, *, sig_by_agent=None, sig_at=None, error=None, tail=()):  # type: ignore[no-untyped-def]
    return WorkerResult(
        rank=rank,
        local_rank=rank,
        host="h",
        pid=100 + rank,
        returncode=rc,
        start_time=T0,
        end_time=T0 + end,
        signaled_by_agent=sig_by_agent,
        signaled_at=sig_at,
        error=error,
        stderr_tail=tuple(tail),
    )


def err(ts: float, msg: str = "boom") -> dict:
    return {
        "exc_type": "ValueError",
        "message": msg,
        "timestamp": T0 + ts,
        "traceback": f'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: {msg}\n',
    }


def test_success_is_compact_and_exit_0():
    run = RunResult(workers=tuple(w(r, 0) for r in range(3)), host="h", run_id="j")
    assert not run.is_failed() and run.exit_code == 0 and run.root_cause is None
    assert format_root_cause(run) == ""
    s = format_summary(run)
    assert "3 worker(s) on h succeeded" in s and s.count(" ok") == 3


def test_big_success_collapses():
    run = RunResult(workers=tuple(w(r, 0) for r in range(64)), host="h")
    s = format_summary(run)
    assert "ranks [0-63]: ok" in s and len(s.splitlines()) == 2


def test_root_cause_is_first_by_error_timestamp_not_by_reap_order():
    a = w(0, 1, end=2.0, error=err(0.5, "first"))  # reaped later, but raised first
    b = w(1, 1, end=1.0, error=err(0.9, "second"))
    run = RunResult(workers=(b, a), host="h")
    assert run.root_cause is a and run.exit_code == 1
    text = format_root_cause(run)
    assert text.startswith("### Root cause: rank 0 (local 0) on host h, pid 100, exit code 1")
    assert "ValueError: first" in text
    assert "rank 1 (local 1) pid 101: failed on its own 0.40s after the root cause" in text


def test_terminated_ranks_are_not_failures():
    root = w(2, 1, error=err(0.5))
    t = w(0, -signal.SIGTERM, sig_by_agent=signal.SIGTERM, sig_at=T0 + 0.6)
    run = RunResult(workers=(t, root), host="h")
    assert t.outcome is Outcome.TERMINATED and run.root_cause is root
    assert "rank 0 (local 0) pid 100: terminated by the launcher (SIGTERM)" in format_root_cause(run)


def test_raised_before_the_signal_counts_as_own_failure_with_its_own_exit_code():
    x = w(1, -signal.SIGTERM, sig_by_agent=signal.SIGTERM, sig_at=T0 + 0.6, error=err(0.4))
    assert x.outcome is Outcome.FAILED
    run = RunResult(workers=(x,), host="h")
    assert run.exit_code == 1  # the bootstrap's exit code, not 128+SIGTERM


def test_signal_root_cause_uses_stderr_tail_and_128_plus_signal():
    k = w(1, -signal.SIGSEGV, tail=[f"line {i}" for i in range(30)])
    run = RunResult(workers=(w(0, 0), k), host="h")
    assert run.exit_code == 128 + signal.SIGSEGV
    text = format_root_cause(run)
    assert "signal SIGSEGV" in text.splitlines()[0]
    assert "| line 29" in text and "| line 9" not in text  # the last 20 lines


def test_sigkill_without_output_mentions_oom():
    run = RunResult(workers=(w(0, -9),), host="h")
    assert "out-of-memory" in format_root_cause(run)


def test_interrupted():
    t = w(0, -signal.SIGINT, sig_by_agent=signal.SIGINT, sig_at=T0)
    run = RunResult(workers=(t,), host="h", interrupted_by=signal.SIGINT)
    assert run.exit_code == 130 and run.is_failed()
    assert "received SIGINT" in format_root_cause(run)
    assert "interrupted by SIGINT" in format_summary(run)


def test_error_file_formats(tmp_path):
    p = tmp_path / "e.json"
    p.write_text(json.dumps(err(1.0)))
    assert load_error_file(str(p))["exc_type"] == "ValueError"
    assert load_error_file(str(p), not_before=T0 + 100) is None  # stale: from an earlier run
    p.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: x",
                    "extraInfo": {"py_callstack": "Traceback...\nRuntimeError: x", "timestamp": str(int(T0))},
                }
            }
        )
    )
    d = load_error_file(str(p))
    assert d["traceback"].endswith("RuntimeError: x") and d["timestamp"] == T0  # torch elastic @record
    p.write_text("{half")
    assert load_error_file(str(p)) is None
    assert load_error_file(str(tmp_path / "missing.json")) is None
