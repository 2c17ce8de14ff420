"""The test harness's zygote (``zygote.py``): a forked rank behaves as an exec'd one where the tests can tell.

Exit codes (normal, ``sys.exit``, an uncaught exception, a signal), stdout and stderr, the rank's own environment,
working directory, argv, session and ``__main__``; ``communicate``'s timeout; and the fallback to exec where a
variable read at interpreter start-up differs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from . import zygote
from .harness import ROOT, worker_env

pytestmark = pytest.mark.skipif(os.environ.get("PROCGROUP_TEST_ZYGOTE") == "0", reason="zygote turned off")

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "rank", os.environ.get("RANK"), flush=True)
    print("sid", os.getsid(0) == os.getpid(), "main", __name__, "numpy", "numpy" in sys.modules, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise ValueError("boom from the rank")
    if mode == "sleep":
        time.sleep(60)
    """
)


def _spawn(tmp_path: Path, *args: str, env_extra: dict | None = None) -> zygote.Forked:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), *args]
    env = worker_env(3, 4, 1, "s", env_extra)
    assert zygote.usable(argv, env)
    return zygote.spawn(argv, env, str(tmp_path))


@pytest.mark.timeout(60)
def test_exit_codes_output_env_and_session(tmp_path: Path) -> None:
    p = _spawn(tmp_path, "ok")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, (out, err)
    assert f"argv ['ok'] cwd {tmp_path} rank 3" in out
    assert "sid True main __main__ numpy True" in out  # a session of its own; the script is __main__
    assert err == "to stderr\n"
    p = _spawn(tmp_path, "exit", "7")
    p.communicate(timeout=30)
    assert p.returncode == 7
    p = _spawn(tmp_path, "raise")
    _out, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "ValueError: boom from the rank" in err and "Traceback" in err


@pytest.mark.timeout(60)
def test_signals_timeouts_and_the_group_kill(tmp_path: Path) -> None:
    p = _spawn(tmp_path, "sleep")
    assert p.stdout is not None and p.stdout.readline().startswith("argv")  # read as it comes, like Popen's pipe
    with pytest.raises(subprocess.TimeoutExpired):
        p.communicate(timeout=0.3)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGKILL)  # what the harness does: the rank leads its own process group
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    p = _spawn(tmp_path, "sleep")
    p.terminate()
    assert p.wait(30) == -signal.SIGTERM


def test_a_different_startup_variable_is_exec_d(tmp_path: Path) -> None:
    argv = [sys.executable, str(tmp_path / "x.py")]
    env = worker_env(0, 1, 1, "s")
    _spawn(tmp_path, "exit", "0").wait(30)  # the zygote is up, with the harness's start-up variables
    assert zygote.usable(argv, env)
    assert not zygote.usable(argv, {**env, "PYTHONHASHSEED": "123"})
    assert not zygote.usable(argv, {**env, "OMP_NUM_THREADS": "2"})
    assert not zygote.usable([str(ROOT / "x"), "y"], env)
