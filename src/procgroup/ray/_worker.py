"""What runs inside a Ray worker process: join the procgroup job, record a failure, leave.

Shared by :func:`procgroup.ray.run` and the Ray Train backend config.  Nothing here imports ray: these
functions run in Ray's actors but only use procgroup's own API, so they are testable without Ray.

A job is described by a :class:`JobSpec` that the driver makes once (worker 0's address, a free port on it,
a fresh run id and a random secret) and sends to every worker.  :func:`join` exports the run id and the secret
as ``PROCGROUP_RUN_ID`` / ``PROCGROUP_SECRET`` in the worker's environment (the variables a launcher sets for
its children: the worker process is Ray's, started for this job) and forms the group over
``tcp://addr:port``; rank 0 hosts the store.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..config import ENV

__all__ = ["JobSpec", "free_address", "join", "leave", "record_failure", "new_job"]


@dataclass(frozen=True)
class JobSpec:
    """How the workers of one job find each other.

    ``addr``/``port``: where rank 0 hosts the store; ``world_size``: number of workers; ``run_id``: the job id
    (store keys, shared-memory names); ``secret``: the hex key every store and transport connection proves;
    ``timeout``: seconds, the deadline of init and every later call's default.
    """

    addr: str
    port: int
    world_size: int
    run_id: str
    secret: str
    timeout: float

    @property
    def init_method(self) -> str:
        """The ``tcp://`` init method of this job (IPv6 addresses bracketed)."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"tcp://{host}:{self.port}"


def free_address() -> Tuple[str, int]:
    """This node's address as Ray knows it, and a TCP port free on it now (racy by nature, like torch's).

    Called in worker 0; falls back to the address of the default route when Ray is not running here.
    """
    from ..netutil import free_port

    try:
        import ray.util

        addr = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests): the host's own address
        addr = socket.gethostbyname(socket.gethostname())
    return addr, free_port(addr)


def new_job(addr: str, port: int, world_size: int, timeout: float, run_id: Optional[str] = None) -> JobSpec:
    """A :class:`JobSpec` with a fresh run id (unless given) and a fresh random secret."""
    import uuid

    from ..protocol.auth import new_secret

    return JobSpec(
        addr=addr,
        port=int(port),
        world_size=int(world_size),
        run_id=run_id or f"ray-{uuid.uuid4().hex[:12]}",
        secret=new_secret(),
        timeout=float(timeout),
    )


def join(spec: JobSpec, rank: int) -> None:
    """Form procgroup's default group in this process as ``rank`` of ``spec``; returns when all have joined.

    Sets ``PROCGROUP_RUN_ID`` and ``PROCGROUP_SECRET`` in this process's environment first.  Raises what
    :func:`procgroup.init_process_group` raises (RendezvousTimeoutError after ``spec.timeout`` seconds when
    a worker never joins, ProcGroupError when a group already exists in this process).
    """
    import procgroup as dist

    os.environ[ENV.RUN_ID] = spec.run_id
    os.environ[ENV.SECRET] = spec.secret
    dist.init_process_group(
        init_method=spec.init_method, rank=int(rank), world_size=spec.world_size, timeout=spec.timeout
    )


def record_failure(rank: int, exc: BaseException) -> None:
    """Record ``exc`` as the job's first failure (unless another rank's came first), naming ``rank``.

    procgroup's watchdog on every other rank reads that record within its interval (0.5 s) and fails their
    pending and later calls with a PeerFailureError naming ``rank``, instead of at their deadline: in a Ray
    actor a raising function leaves the process, and so its connections, alive.  Never raises (the store
    may already be gone); does nothing when no group exists.
    """
    from ..errors import PeerFailureError

    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    try:
        store, first_failure = _failure_recorder()
        if store is None:
            return
        first_failure(store, PeerFailureError(f"rank {rank} raised {text}", peer=int(rank)))
    except Exception:  # noqa: BLE001 - best effort while failing anyway
        pass


def _failure_recorder() -> Tuple[Any, Any]:
    """The default group's store and procgroup's first-failure recorder (None store: no group here)."""
    from ..state import _state
    from ..watchdog import first_failure

    return _state.prefix_store, first_failure


def leave() -> None:
    """Destroy procgroup's group in this process, if any (never raises: logged instead)."""
    import logging

    import procgroup as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - shutting down
        logging.getLogger("procgroup.ray").warning("destroy_process_group: %s", e)
