"""``srun --ntasks-per-node=1 procgroup run ...``: one agent per node of a Slurm step.

:func:`detect_srun_step` reads the step's variables (pure, unit-tested with
the environments captured in ``tests/data/env``):

==============  ===============================================================
node rank       ``SLURM_NODEID`` (relative to the step's nodes)
nnodes          ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``)
master          first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``)
agents' port    :func:`procgroup.identity.derive_port` of the job and step ids
run id          ``JOBID.STEPID``
==============  ===============================================================

The job secret.  srun gives the tasks of a step no channel to share a
secret, and one derived from public values (the job id) would stop
accidents but not an attacker.  So:

1. ``PROCGROUP_SECRET`` when set (srun forwards the submitting shell's
   environment by default), or ``--secret-file``;
2. otherwise node 0's agent generates one and writes it to
   :func:`secret_path` -- ``.procgroup-secret-JOBID.STEPID`` in the working
   directory, which a Slurm job shares between its nodes -- created 0600 under a
   temporary name and renamed into place (a reader never sees half a secret,
   and a stale file from a requeued job is replaced, not appended to).  The
   other agents wait for it (up to ``--join-timeout``), and re-read it if the
   store rejects the one they read (a stale file read before node 0 replaced
   it).  Node 0 deletes it as soon as every agent has joined.  If the
   directory is not shared, the other agents time out with an error that
   says to export ``PROCGROUP_SECRET`` instead.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ..config import SLURM, env_int, env_str
from ..deadline import Deadline
from ..errors import ConfigError, DistTimeoutError
from ..identity import derive_port, expand_hostlist, parse_tasks_per_node
from ..secretfile import read_named_secret

__all__ = ["SrunStep", "detect_srun_step", "secret_path", "write_secret_file", "read_secret_file", "wait_secret_file"]

SECRET_FILE_PREFIX = ".procgroup-secret-"
#: how often the other nodes look for node 0's secret file
SECRET_POLL_S = 0.2


@dataclass(frozen=True)
class SrunStep:
    """What the agents of one srun step agree on without talking."""

    job_id: str
    step_id: int
    node_rank: int
    nnodes: int
    hosts: tuple[str, ...]
    master_addr: str
    master_port: int
    notes: tuple[str, ...] = ()

    @property
    def run_id(self) -> str:
        return f"{self.job_id}.{self.step_id}"


def detect_srun_step(environ: Mapping[str, str]) -> Optional[SrunStep]:
    """The srun step this process is a task of, or None (not under srun: an sbatch/salloc shell is not).

    Raises :class:`ConfigError` when srun placed more than one task on this
    node (one ``procgroup run`` per node is the model) or a variable is bad.
    """
    if env_str(SLURM.PROCID, environ) is None:
        return None
    step_var = SLURM.STEP_ID if env_str(SLURM.STEP_ID, environ) is not None else SLURM.STEPID
    step = env_int(step_var, environ, minimum=0)
    job = env_str(SLURM.JOB_ID, environ) or env_str(SLURM.JOBID, environ)
    if step is None or job is None:
        return None
    node = env_int(SLURM.NODEID, environ, minimum=0)
    if node is None:
        raise ConfigError(
            f"under srun (step {job}.{step}) but {SLURM.NODEID} is not set; pass --nnodes, --node-rank "
            "and --master-addr yourself"
        )
    nvar = SLURM.STEP_NUM_NODES if env_str(SLURM.STEP_NUM_NODES, environ) is not None else SLURM.NNODES
    nnodes = env_int(nvar, environ, minimum=1)
    if nnodes is None:
        raise ConfigError(
            f"under srun (step {job}.{step}) but neither {SLURM.STEP_NUM_NODES} nor {SLURM.NNODES} "
            "is set; pass --nnodes yourself"
        )
    if node >= nnodes:
        raise ConfigError(f"{SLURM.NODEID}={node} is out of range for {nvar}={nnodes}")
    tvar = SLURM.STEP_TASKS_PER_NODE if env_str(SLURM.STEP_TASKS_PER_NODE, environ) is not None else None
    if tvar is not None:
        counts = parse_tasks_per_node(env_str(tvar, environ) or "", var=tvar)
        if node < len(counts) and counts[node] != 1:
            raise ConfigError(
                f"srun started {counts[node]} tasks on this node ({tvar}={env_str(tvar, environ)}), but "
                "`procgroup run` is one agent per node that starts the workers itself: use "
                "`srun --ntasks-per-node=1 procgroup run --nproc-per-node N ...`"
            )
    hvar = SLURM.STEP_NODELIST if env_str(SLURM.STEP_NODELIST, environ) is not None else SLURM.JOB_NODELIST
    spec = env_str(hvar, environ)
    if spec is None:
        raise ConfigError(
            f"under srun (step {job}.{step}) but {SLURM.STEP_NODELIST} is not set; "
            "pass --master-addr (node 0's host) yourself"
        )
    hosts = tuple(expand_hostlist(spec, var=hvar))
    port = derive_port(job, step)
    notes = (
        f"node rank {node} of {nnodes} from {SLURM.NODEID}={node}, {nvar}={nnodes}",
        f"master {hosts[0]}:{port}: first host of {hvar}={spec}, port derived from "
        f"{SLURM.JOB_ID}={job} and step {step} (set --master-port to choose another)",
    )
    return SrunStep(
        job_id=job,
        step_id=step,
        node_rank=node,
        nnodes=nnodes,
        hosts=hosts,
        master_addr=hosts[0],
        master_port=port,
        notes=notes,
    )


def secret_path(run_id: str, directory: Optional[str] = None) -> str:
    return os.path.join(directory or os.getcwd(), SECRET_FILE_PREFIX + run_id)


def write_secret_file(path: str, secret: Optional[str] = None) -> str:
    """Write a fresh secret (or ``secret``) to ``path``, mode 0600, atomically; returns it."""
    value = secret or secrets.token_hex(32)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ConfigError(
            f"cannot write the job secret to {tmp!r} ({e.strerror or e}): srun mode shares it through the working "
            "directory; run from a writable shared directory, or export PROCGROUP_SECRET before srun"
        ) from e
    try:
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return value


def read_secret_file(path: str, what: str = "--secret-file") -> Optional[str]:
    """The secret in ``path``; None when the file does not exist (yet); ConfigError when unreadable or empty."""
    return read_named_secret(path, what, label=f"{what} {path!r}")


def wait_secret_file(
    path: str, deadline: Deadline, interrupted: Callable[[], bool], wait: Callable[[float], None]
) -> str:
    """Wait for node 0's secret file (srun mode, nodes 1..M-1)."""
    while True:
        try:
            value = read_secret_file(path, "the job secret file")
        except ConfigError:
            value = None  # empty: node 0 is writing it (cannot happen with rename, but NFS...)
        if value is not None:
            return value
        if interrupted():
            raise InterruptedError
        if deadline.expired():
            raise DistTimeoutError(
                f"node 0's agent did not write the job secret to {path!r} within {deadline.elapsed():.1f}s: "
                "is the working directory shared between the nodes, and did node 0 start? Export "
                "PROCGROUP_SECRET before srun (srun forwards it), or pass --secret-file on a shared filesystem"
            )
        wait(min(SECRET_POLL_S, max(0.0, deadline.remaining())))
