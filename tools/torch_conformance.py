"""Run torch's own distributed conformance suite with BACKEND=gloo and BACKEND=procgroup, side by side.

torch ships ``torch/testing/_internal/distributed/distributed_test.py``; its ``DistributedTest._DistTestBase``
holds ~285 tests of every collective, point-to-point op, group and DDP path, run against the backend named by
the ``BACKEND`` environment variable at ``WORLD_SIZE`` ranks (pytorch's own
``test/distributed/test_distributed_spawn.py`` mixes it into ``TestDistBackend`` the same way as here).

Full comparison (long: every test starts WORLD_SIZE processes)::

    PYTHONPATH=$PWD/src python tools/torch_conformance.py --world-sizes 2 3 --out benchmarks/results/torch/conformance

A subset: ``--tests test_all_reduce_sum test_broadcast`` or ``--match all_reduce``.  Writes ``<out>.json`` (every
result, with the failure reason) and ``<out>.md`` (the side-by-side table: test, then gloo / procgroup per world
size, each pass / fail / skip / timeout).  Needs torch and the ``expecttest`` package (torch's test utilities
import it).

How "procgroup" is made to look like gloo to the suite (runtime only; no torch file is edited):

* the suite branches on the literal backend name: ``BACKEND != "gloo"`` skips (timeouts, batch p2p on CPU, ...)
  and ``require_backend_is_available({"gloo"})``.  For BACKEND=procgroup the runner loads the suite's source, turns
  those comparisons into membership tests of ``("gloo", "procgroup")``, and executes it as the module
  ``torch.testing._internal.distributed.distributed_test``.  For BACKEND=gloo the module is imported untouched.
* ``DistTestCases`` (its capability tables) gets "procgroup" wherever it lists "gloo", and under "plugin".
* ``import procgroup.torch`` registers the backend in this process; forked ranks inherit it (``--spawn`` ranks
  re-import this module, which registers it again).

Ranks are forked by default (torch's suite takes ~15 s to import on a loaded machine, and spawn re-imports it in
every rank of every test); ``--spawn`` uses torch's own spawn path, as pytorch's CI does.  Each test has a deadline
(``--timeout``, passed to the suite as DISTRIBUTED_TESTS_DEFAULT_TIMEOUT); a worker that goes silent past it is
killed, the test recorded as ``timeout``, and the run goes on with the next test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import unittest
from pathlib import Path
from typing import Any

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
BACKENDS = ("gloo", "procgroup")
GLOO_LIKE = ("gloo", "procgroup")
#: worker-mode marker, set by the runner in the worker's environment (inherited by spawned ranks)
WORKER_ENV = "PROCGROUP_CONFORMANCE_WORKER"

#: the fixed representative subset CI runs (tests/torch_conformance): collectives, p2p, groups, async, DDP
CI_SUBSET = (
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_full_group_max",
    "test_broadcast",
    "test_reduce_sum",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_gather",
    "test_scatter",
    "test_all_gather_object_default_pg",
    "test_broadcast_full_group",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_isend",
    "test_barrier",
    "test_all_gather_object_subgroup",
    "test_DistributedDataParallel_requires_grad",
    "test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_rank_0_timeout",
)


def _patch_capability_tables() -> None:
    """Add "procgroup" to every DistTestCases table that lists "gloo" (and to "plugin")."""
    from torch.testing._internal.common_distributed import DistTestCases

    for table in (DistTestCases.skip_collective, DistTestCases.backend_feature):
        for names in table.values():
            if "gloo" in names:
                names.add("procgroup")
    DistTestCases.backend_feature["plugin"].add("procgroup")


def _load_suite(backend: str) -> types.ModuleType:
    """Import torch's suite for ``backend``; for procgroup, with its gloo-name comparisons widened (see above)."""
    if backend == "gloo":
        import importlib

        return importlib.import_module(SUITE_MODULE)
    import importlib.util

    import procgroup.torch  # noqa: F401  registers the "procgroup" backend name

    _patch_capability_tables()
    spec = importlib.util.find_spec(SUITE_MODULE)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    # the only source rewrites: literal gloo-name checks become "gloo or procgroup" checks
    source = source.replace('BACKEND != "gloo"', f"BACKEND not in {GLOO_LIKE!r}")
    source = source.replace('BACKEND == "gloo"', f"BACKEND in {GLOO_LIKE!r}")
    source = source.replace(
        'require_backend_is_available({"gloo"})', 'require_backend_is_available({"gloo", "procgroup"})'
    )
    module = types.ModuleType(SUITE_MODULE)
    module.__file__ = spec.origin
    sys.modules[SUITE_MODULE] = module
    # dont_inherit: this file's "from __future__ import annotations" must not turn the suite's annotations into
    # strings (DDP checks a comm hook's annotation against dist.GradBucket itself)
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - torch's own file
    return module


def _build_test_class(backend: str) -> type:
    suite = _load_suite(backend)
    import torch

    class TestDistBackendWithFork(suite.TestDistBackend, suite.DistributedTest._DistTestBase):  # type: ignore
        """torch's _DistTestBase on ``backend``; ranks forked (or spawned with --spawn), as test_distributed_spawn."""

        def setUp(self) -> None:
            super().setUp()
            if os.environ.get("PROCGROUP_CONFORMANCE_SPAWN") == "1":
                self._spawn_processes()
            else:
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    TestDistBackendWithFork.__module__ = __name__
    TestDistBackendWithFork.__qualname__ = "TestDistBackendWithFork"
    return TestDistBackendWithFork


if os.environ.get(WORKER_ENV) == "1":  # worker (and spawned ranks): the class must be importable by name
    TestDistBackendWithFork = _build_test_class(os.environ["BACKEND"])


def list_tests() -> list[str]:
    """Names of every test in torch's _DistTestBase (imports the unmodified suite with a placeholder BACKEND)."""
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
    import importlib

    base = importlib.import_module(SUITE_MODULE).DistributedTest._DistTestBase
    return sorted(n for n in dir(base) if n.startswith("test_"))


class _LineResult(unittest.TestResult):
    """Appends one JSON line per test (and a "start" line before it) to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path
        self._t0 = 0.0

    def _write(self, test: unittest.TestCase, status: str, reason: str = "") -> None:
        line = {
            "test": test.id().split(".")[-1],
            "status": status,
            "reason": reason[-2000:],
            "seconds": round(time.monotonic() - self._t0, 2),
        }
        with open(self._path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._t0 = time.monotonic()
        self._write(test, "start")

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._write(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._write(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._write(test, "fail", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._write(test, "skip", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._write(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._write(test, "fail", "unexpected success")


def _worker(names: list[str], out: str) -> None:
    cls = sys.modules[__name__].__dict__["TestDistBackendWithFork"]
    for n in names:
        if not hasattr(cls, n):
            with open(out, "a") as f:
                f.write(json.dumps({"test": n, "status": "fail", "reason": "no such test in this torch"}) + "\n")
    suite = unittest.TestSuite(cls(n) for n in names if hasattr(cls, n))
    suite.run(_LineResult(out))


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_config(
    backend: str, world_size: int, names: list[str], timeout: float, spawn: bool, log: Path
) -> dict[str, dict[str, Any]]:
    """Run ``names`` on ``backend`` at ``world_size`` in worker processes; returns {test: {status, reason, seconds}}.

    A worker silent for ``timeout`` + 60 s is killed (its process group) and its current test recorded as
    ``timeout``; the next worker resumes after it.  Never raises for a test outcome.
    """
    results: dict[str, dict[str, Any]] = {}
    remaining = list(names)
    with tempfile.TemporaryDirectory(prefix="pg-conf-") as tmp:
        lines = Path(tmp) / "results.jsonl"
        while remaining:
            env = dict(
                os.environ,
                BACKEND=backend,
                WORLD_SIZE=str(world_size),
                TEMP_DIR=tmp,
                DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(int(timeout)),
                **{WORKER_ENV: "1"},
            )
            env["PROCGROUP_CONFORMANCE_SPAWN"] = "1" if spawn else "0"
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
            cmd = [sys.executable, "-c", f"import torch_conformance as m; m._worker({remaining!r}, {str(lines)!r})"]
            with open(log, "a") as logf:
                proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
                last_size, last_change = -1, time.monotonic()
                while proc.poll() is None:
                    time.sleep(1.0)
                    size = lines.stat().st_size if lines.exists() else 0
                    if size != last_size:
                        last_size, last_change = size, time.monotonic()
                    elif time.monotonic() - last_change > timeout + 60:
                        os.killpg(proc.pid, 9)
                        proc.wait()
            started = None
            for rec in _read_lines(lines):
                if rec["status"] == "start":
                    started = rec["test"]
                else:
                    results[rec["test"]] = rec
                    started = None
            if started is not None:
                results[started] = {
                    "test": started,
                    "status": "timeout",
                    "reason": f"worker silent for more than {timeout + 60:.0f} s (or it crashed)",
                }
            done = set(results)
            if not any(n not in done for n in remaining) or (
                started is None and proc.returncode != 0 and not _read_lines(lines)
            ):
                for n in remaining:
                    results.setdefault(
                        n,
                        {
                            "test": n,
                            "status": "fail",
                            "reason": f"worker exited {proc.returncode} before the test; see {log}",
                        },
                    )
                break
            remaining = [n for n in remaining if n not in done]
            lines.unlink(missing_ok=True)
    return results


def _short(reason: str) -> str:
    """The exception line of a failure report (the last line naming an Error/Exception), else its last line."""
    import re

    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    lines = [ln for ln in lines if "PYTORCH_PRINT_REPRO" not in ln and not ln.startswith(("python ", "To execute"))]
    named = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Timeout)\b", ln)]
    return ((named or lines or [""])[-1])[:240].replace("|", "\\|")


def write_report(table: dict[str, dict[str, dict[str, Any]]], configs: list[str], out: Path) -> dict[str, Any]:
    """Write ``out``.json and ``out``.md from {config: {test: result}}; returns the summary dict."""
    tests = sorted({t for res in table.values() for t in res})
    summary: dict[str, Any] = {"configs": {}, "gloo_pass_procgroup_not": []}
    for c in configs:
        counts: dict[str, int] = {}
        for r in table.get(c, {}).values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        summary["configs"][c] = counts
    for c in configs:
        if not c.startswith("gloo"):
            continue
        pc = c.replace("gloo", "procgroup")
        for t in tests:
            g, p = table.get(c, {}).get(t), table.get(pc, {}).get(t)
            if g and p and g["status"] == "pass" and p["status"] != "pass":
                summary["gloo_pass_procgroup_not"].append(
                    {"config": pc, "test": t, "status": p["status"], "reason": _short(p.get("reason", ""))}
                )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "results": table}, indent=1))
    md = [
        "# torch distributed_test: gloo vs procgroup",
        "",
        "| config | pass | fail | skip | timeout |",
        "|---|---|---|---|---|",
    ]
    for c in configs:
        n = summary["configs"][c]
        md.append(f"| {c} | {n.get('pass', 0)} | {n.get('fail', 0)} | {n.get('skip', 0)} | {n.get('timeout', 0)} |")
    md += ["", "## gloo pass, procgroup not", ""]
    if summary["gloo_pass_procgroup_not"]:
        md += ["| config | test | procgroup | reason |", "|---|---|---|---|"]
        md += [
            f"| {e['config']} | {e['test']} | {e['status']} | {e['reason']} |"
            for e in summary["gloo_pass_procgroup_not"]
        ]
    else:
        md.append("none")
    md += ["", "## every test", "", "| test | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for t in tests:
        md.append(f"| {t} | " + " | ".join(table.get(c, {}).get(t, {}).get("status", "-") for c in configs) + " |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command line: run the selected tests on each backend and world size, write the table; exit 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--tests", nargs="*", help="test names (default: all)")
    ap.add_argument("--match", help="only tests whose name contains this")
    ap.add_argument("--ci-subset", action="store_true", help="only the fixed subset CI runs")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-test deadline in seconds")
    ap.add_argument("--chunk", type=int, default=30, help="tests per worker, alternating backends")
    ap.add_argument("--spawn", action="store_true", help="spawn ranks (torch's CI way) instead of forking")
    ap.add_argument("--out", default="benchmarks/results/torch/conformance", help="output path without suffix")
    args = ap.parse_args(argv)
    names = list(CI_SUBSET) if args.ci_subset else (args.tests or list_tests())
    if args.match:
        names = [n for n in names if args.match in n]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    table: dict[str, dict[str, dict[str, Any]]] = {}
    configs = []
    for ws in args.world_sizes:
        # chunks of tests, gloo then procgroup on each: same machine state, and a cut-off run leaves a fair table
        for start in range(0, len(names), args.chunk):
            chunk = names[start : start + args.chunk]
            for backend in args.backends:
                c = f"{backend} ws={ws}"
                if c not in configs:
                    configs.append(c)
                t0 = time.monotonic()
                table.setdefault(c, {}).update(run_config(backend, ws, chunk, args.timeout, args.spawn, log))
                print(f"{c}: tests {start}..{start + len(chunk) - 1} in {time.monotonic() - t0:.0f} s", flush=True)
                write_report(table, configs, out)
    summary = write_report(table, configs, out)
    print(json.dumps(summary["configs"]))
    for e in summary["gloo_pass_procgroup_not"]:
        print(f"gloo pass, procgroup {e['status']}: {e['config']} {e['test']}: {e['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
