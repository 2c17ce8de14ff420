"""``procgroup.ray.run(fn, world_size)``: a function on N Ray actors with procgroup's API initialised.

For users who want Ray's scheduling without Ray Train.  The driver starts ``world_size`` actors, asks actor 0
for its node address and a free port, makes a :class:`~procgroup.ray._worker.JobSpec` (a fresh run id, a random
secret), and every actor forms procgroup's default group, calls ``fn(*args)``, and destroys the group.

Failure semantics: an actor whose ``fn`` raises records the failure in the job's store before leaving, so the
other ranks' pending and later procgroup calls fail within about a second with a PeerFailureError naming it
(procgroup's watchdog), instead of at their deadline; ``run`` then raises :class:`RayRunError` naming the
rank that failed first and carrying its traceback.  An actor that dies (its process exits) closes its
connections, which the peers see at once; ``run`` names its rank too.
"""

from __future__ import annotations

import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from ..errors import PeerFailureError, ProcGroupError
from . import _worker

__all__ = ["RayRunError", "WorkerFailure", "run"]

#: seconds ``run`` waits beyond ``timeout`` for the actors' results (actor start-up, teardown)
_GRACE = 60.0


@dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure as reported by its actor: ``kind`` (the exception's type name), ``message``,
    ``traceback`` (text), ``host``, and ``peer_failure`` (True when it only saw another rank fail)."""

    rank: int
    world_size: int
    kind: str
    message: str
    traceback: str
    host: str
    peer_failure: bool

    def describe(self) -> str:
        """The failure headed as mpi4py heads remote tracebacks."""
        return f"### Worker {self.rank} of {self.world_size} on {self.host}\n{self.traceback.rstrip()}"


class RayRunError(ProcGroupError):
    """``procgroup.ray.run``: a worker raised or died.  ``rank`` is the rank that failed first,
    ``failures`` every rank's :class:`WorkerFailure` (by rank)."""

    def __init__(self, message: str, rank: int, failures: Sequence[WorkerFailure] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = list(failures)


class _Worker:
    """The actor class's body (wrapped by ``ray.remote`` in :func:`run`): one rank of the job."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def address(self) -> tuple:
        """This node's address and a free port on it (asked of rank 0)."""
        return _worker.free_address()

    def call(self, spec: _worker.JobSpec, fn: Callable[..., Any], args: tuple) -> Any:
        """Join the job, run ``fn(*args)``, leave.  Returns ``("ok", result)`` or ``("err", WorkerFailure)``."""
        try:
            _worker.join(spec, self.rank)
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            return "err", self._failure(spec, e)
        try:
            return "ok", fn(*args)
        except BaseException as e:  # noqa: BLE001 - recorded for the peers, reported to the driver
            _worker.record_failure(self.rank, e)
            return "err", self._failure(spec, e)
        finally:
            _worker.leave()

    def _failure(self, spec: _worker.JobSpec, e: BaseException) -> WorkerFailure:
        return WorkerFailure(
            rank=self.rank,
            world_size=spec.world_size,
            kind=type(e).__name__,
            message=str(e),
            traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)),
            host=socket.gethostname(),
            peer_failure=isinstance(e, PeerFailureError),
        )


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    num_cpus_per_worker: float = 1,
    timeout: float = 300.0,
    args: Sequence[Any] = (),
    runtime_env: Optional[dict] = None,
) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` Ray actors, each one rank of a procgroup job; results by rank.

    Inside ``fn``, ``procgroup``'s API is initialised (``procgroup.get_rank()``, ``procgroup.all_reduce`` ...)
    and is destroyed when ``fn`` returns.  ``ray.init()`` is called if Ray is not initialised yet.
    ``num_cpus_per_worker``: each actor's CPU reservation; ``timeout`` (seconds): the procgroup deadline (init
    and each call); ``runtime_env``: passed to the actors (e.g. ``{"env_vars": {...}}``).  ``fn`` and ``args``
    must be picklable by Ray (cloudpickle).

    Raises RayRunError naming the first rank that raised or died, with its traceback (the others' failures
    in ``.failures``); ConfigError for ``world_size < 1``; ImportError when ray is not installed (install
    ``procgroup[ray]``).  The actors are killed afterwards in every case.
    """
    from ..errors import ConfigError

    if int(world_size) < 1:
        raise ConfigError(f"world_size={world_size!r} must be >= 1")
    import ray

    if not ray.is_initialized():
        ray.init()
    opts: dict = {"num_cpus": num_cpus_per_worker}
    if runtime_env is not None:
        opts["runtime_env"] = runtime_env
    actor_cls = ray.remote(_Worker).options(**opts)
    actors = [actor_cls.remote(r) for r in range(int(world_size))]
    try:
        addr, port = ray.get(actors[0].address.remote(), timeout=timeout + _GRACE)
        spec = _worker.new_job(addr, port, int(world_size), timeout)
        refs = [a.call.remote(spec, fn, tuple(args)) for a in actors]
        return _collect(ray, refs, int(world_size), timeout + _GRACE)
    finally:
        for a in actors:
            ray.kill(a)


def _collect(ray: Any, refs: List[Any], world_size: int, timeout: float) -> List[Any]:
    """Every rank's result, or RayRunError naming the first failure (by arrival, a real one before a peer's)."""
    results: List[Any] = [None] * world_size
    failures: List[WorkerFailure] = []
    index = {ref: r for r, ref in enumerate(refs)}
    pending = list(refs)
    t_end = time.monotonic() + timeout
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, t_end - time.monotonic()))
        if not ready:
            missing = sorted(index[p] for p in pending)
            raise RayRunError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s", missing[0])
        ref = ready[0]
        r = index[ref]
        try:
            status, value = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the actor died (RayActorError) or could not run the call
            status, value = "err", WorkerFailure(r, world_size, type(e).__name__, str(e), str(e), "?", False)
        if status == "ok":
            results[r] = value
        else:
            failures.append(value)
    if failures:
        first = next((f for f in failures if not f.peer_failure), failures[0])
        raise RayRunError(
            f"rank {first.rank} of {world_size} failed: {first.kind}: {first.message}\n{first.describe()}",
            first.rank,
            sorted(failures, key=lambda f: f.rank),
        )
    return results
