"""The nccl backend's engine: device tensors through torch's own NCCL, one torch group per procgroup group.

:class:`TorchDeviceEngine` is the world's :class:`~procgroup.backends.base.CollectiveEngine`.  It declines
every dtype-keyed call (CPU data keeps procgroup's own algorithms and transports, as torch's
``"cpu:gloo,cuda:nccl"``) and carries the tensors of its device type through a torch backend built per
procgroup group, lazily, on the group's first device operation, over procgroup's store
(:class:`~procgroup.torch._store.ProcgroupTorchStore` under a :class:`torch.distributed.PrefixStore` named by
the job, the group id and its generation, so a destroyed and recreated group never meets old keys).

``device_type``/``kind`` are constructor parameters: ("cuda", "nccl") for ``backend="nccl"``; the tests run
the same code as ("cpu", "gloo") on machines without a GPU (``tests/backends/torch_gloo``).

Waiting (:meth:`TorchDeviceEngine.wait`): a torch Work is polled with ``is_completed()`` (for 200 us yielding
the CPU between polls, then sleeping from 20 us doubling to 1 ms), so a sync call returns once its result is
complete on the device.  Between polls: the
call's deadline (DistTimeoutError; the torch group is then aborted and the procgroup group breaks), and
every ~2 ms one posted receive per peer on procgroup's transport that never matches (:data:`PROBE_TAG`): it
fails when the transport is aborted (the watchdog found a mismatch or a failure through the store), closed,
or when that peer died, so the wait raises the same error, naming the peer, as the cpu backend's waits.
torch is imported only when such a world forms.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ... import algorithms as alg
from ...deadline import Deadline
from ...errors import BrokenError, ConfigError, DistTimeoutError, ProcGroupError
from ...tags import P2P_TAG_LIMIT, p2p_tag
from ...transport.base import Request
from ..base import CollectiveEngine
from .devices import RECORD_BYTES, check_one_device_per_rank, decode_record, encode_record

__all__ = ["TorchDeviceEngine", "PROBE_TAG", "cuda_device_id"]

logger = logging.getLogger("procgroup")

#: the transport tag of the liveness probes: a p2p tag whose dtype code (31) no dtype has, so nothing matches it
PROBE_TAG = p2p_tag(0, P2P_TAG_LIMIT - 1, 31, 0)
#: a wait first polls the work this long (yielding the CPU between polls), then sleeps NAP_MIN_S doubling to NAP_MAX_S
SPIN_S = 200e-6
NAP_MIN_S = 20e-6
NAP_MAX_S = 1e-3
_sched_yield = getattr(os, "sched_yield", lambda: None)
PROBE_EVERY_S = 2e-3
#: torch's NCCL watchdog must not fire before procgroup's deadline does (it would end the process)
NCCL_TIMEOUT_MARGIN_S = 60.0
#: after torch reports an error, how long the probes may take to name a dead peer as its cause
DEAD_PEER_GRACE_S = 1.0


def cuda_device_id(device: Any) -> str:
    """A GPU's identity across processes: its UUID, else its PCI bus id (``CUDA_VISIBLE_DEVICES`` renumbers)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    return f"pci:{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"


class _GroupState:
    """What the engine keeps for one procgroup group (one generation of its id)."""

    __slots__ = ("gen", "backend", "store", "checked_all", "checked_peers", "broken", "device")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.backend: Any = None
        self.store: Any = None
        self.checked_all = False
        self.checked_peers: set = set()
        self.broken: Optional[str] = None
        self.device: Any = None


class TorchDeviceEngine(CollectiveEngine):
    """Device tensors of ``device_type`` through torch backend ``kind``, one per procgroup group (see module).

    ``world``: the cpu backend's world it serves; ``job_id``: unique per job and restart (names store keys);
    ``device_id``: a device's identity across processes (for the one-device-per-rank check).
    """

    def __init__(
        self,
        world: Any,
        job_id: str,
        device_type: str = "cuda",
        kind: str = "nccl",
        device_id: Optional[Callable[[Any], str]] = None,
    ) -> None:
        from .ops import DeviceOps

        self.world = world
        self.job_id = job_id
        self.name = kind
        self.kind = kind
        self.device_type = device_type
        self.device_types = (device_type,)
        self.device_id = device_id or cuda_device_id
        self.device_ops = DeviceOps(self)
        self._states: Dict[int, _GroupState] = {}
        self._probes: Dict[int, Request] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- errors -----------------------------------------------------------------------------------
    def torch_error(self, e: BaseException, what: str) -> ProcGroupError:
        """torch's error of an operation as procgroup's BrokenError (naming the op and the backend)."""
        if isinstance(e, ProcGroupError):
            return e
        return BrokenError(f"rank {self.world.rank}: {what} failed in torch's {self.kind}: {e}")

    # -- per-group torch backends -----------------------------------------------------------------
    def _state(self, g: Any) -> _GroupState:
        with self._lock:
            st = self._states.get(g.gid)
            if st is None or st.gen != g.gen:
                if st is not None:
                    self._release(st)
                st = self._states[g.gid] = _GroupState(g.gen)
            return st

    def _build(self, g: Any, st: _GroupState) -> Any:
        """torch's backend of group ``g`` over procgroup's store (local: the communicators form on first use)."""
        with self._lock:
            if st.backend is not None:
                return st.backend
            from ...torch._store import ProcgroupTorchStore

            # the Python store must outlive torch's use of it (a pybind11 trampoline): the state keeps it
            st.store = ProcgroupTorchStore(self.world.store)
            store = dist.PrefixStore(self._prefix(g) + "torch/", st.store)
            if self.kind == "gloo":
                b = dist.ProcessGroupGloo(store, g.rank(), g.size(), timedelta(seconds=g.timeout))
            elif self.kind == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timedelta(seconds=g.timeout + NCCL_TIMEOUT_MARGIN_S)
                b = dist.ProcessGroupNCCL(store, g.rank(), g.size(), opts)
            else:  # pragma: no cover - the constructor's callers pass one of the two
                raise ConfigError(f"procgroup's device engine cannot build torch backend {self.kind!r}")
            st.backend = b
            logger.debug("rank %d: torch %s group for procgroup group %s built", self.world.rank, self.kind, g.name)
            return b

    def backend(self, g: Any, comm: Any, device: Any, op: str) -> Any:
        """torch's backend of group ``g`` for a collective on ``device``, after the one-device-per-rank check.

        The check runs on the group's first device collective, over ``comm`` (procgroup's transport, under the
        call's deadline and tag: a member making another call never pairs with it, the watchdog names it)."""
        st = self._state(g)
        if st.broken is not None:
            raise BrokenError(st.broken)
        if not st.checked_all:
            mine = np.frombuffer(encode_record(self._device_key(device), str(device)), np.uint8)
            everyone = np.empty(RECORD_BYTES * g.size(), np.uint8)
            alg.all_gather(comm, mine, everyone)
            recs = [
                decode_record(everyone[i * RECORD_BYTES : (i + 1) * RECORD_BYTES].tobytes()) for i in range(g.size())
            ]
            self._check(g, g.ranks, recs, op)
            st.checked_all = True
            st.device = device
        return self._build(g, st)

    def pair_backend(self, g: Any, peers: Sequence[int], device: Any, op: str) -> Any:
        """torch's backend of group ``g`` for point-to-point ops with global ranks ``peers`` on ``device``.

        NCCL makes a communicator per pair on the pair's first operation (waiting inside NCCL for the peer),
        and two ranks on one GPU fail there too: before the first op with a peer, this rank publishes its device
        record for that peer in the store (under the group's key prefix) and waits for the peer's record for it
        (under the group's deadline, polling the probes), so NCCL starts only once both are there, and a peer
        that never comes is a DistTimeoutError naming it rather than a wait inside NCCL."""
        st = self._state(g)
        if st.broken is not None:
            raise BrokenError(st.broken)
        me = self.world.rank
        todo = [p for p in dict.fromkeys(peers) if p != me and p not in st.checked_peers]
        if todo:
            store = self.world.store
            mine = encode_record(self._device_key(device), str(device))
            pre = self._prefix(g)
            for p in todo:  # every record first, then the waits: ranks contacting each other in a cycle all publish
                store.set(f"{pre}dev/{me}>{p}", mine)
            keys = {p: f"{pre}dev/{p}>{me}" for p in todo}
            dl = Deadline.after(g.timeout)
            nap = NAP_MIN_S
            while not store.check(list(keys.values())):
                self.check_peers(todo)
                if dl.expired():
                    missing = [p for p in todo if not store.check([keys[p]])]
                    raise DistTimeoutError(
                        f"rank {me}: {op} with {self.device_type} tensors in group {g.name}: rank(s) {missing} made "
                        f"no {self.device_type} point-to-point call with this rank within {dl.elapsed():.2f}s. NCCL "
                        "forms a communicator per pair on its first operation, which waits for both ranks: post "
                        "sends and receives that wait for each other (a ring) together with batch_isend_irecv"
                    )
                time.sleep(nap)
                nap = min(2 * nap, 10e-3)
            for p in todo:
                recs = {me: decode_record(mine), p: decode_record(store.get(keys[p]))}
                order = sorted(recs)
                self._check(g, order, [recs[r] for r in order], op)
                st.checked_peers.add(p)
        return self._build(g, st)

    def _prefix(self, g: Any) -> str:
        """The store keys of group ``g`` (this generation of its id): a recreated group never meets old ones."""
        return f"procgroup_{self.kind}/{self.job_id}/{g.gid}.{g.gen}/"

    def _device_key(self, device: Any) -> str:
        return self.device_id(device)

    def _check(self, g: Any, ranks: Sequence[int], recs: Sequence[tuple], op: str) -> None:
        hosts = self.world.hosts or ["localhost"] * self.world.size
        names = self.world.hostnames or hosts
        check_one_device_per_rank(
            [(hosts[r], rec[0]) for r, rec in zip(ranks, recs)],
            list(ranks),
            names=[rec[1] for rec in recs],
            hostnames=[names[r] for r in ranks],
            op=f"{op} with {self.device_type} tensors in group {g.name}",
        )

    def fail(self, g: Any, why: str) -> None:
        """Group ``g``'s torch backend is out of step (an operation failed or timed out): abort it, and refuse
        later device operations of the group with BrokenError(``why``)."""
        st = self._state(g)
        if st.broken is None:
            st.broken = why
            self._abort(st.backend)

    # -- waiting ----------------------------------------------------------------------------------
    def _probe(self, peer: int) -> Request:
        req = self._probes.get(peer)
        if req is None:
            with self._lock:  # the async worker and the caller's thread may both wait on the same peer
                req = self._probes.get(peer)
                if req is None:
                    req = self._probes[peer] = self.world.transport.irecv(peer, PROBE_TAG, bytearray(1))
        return req

    def check_peers(self, peers: Sequence[int]) -> None:
        """Raise what failed the probe of any of ``peers`` (global ranks): the transport's abort, its close, or
        that peer's death (PeerFailureError naming it)."""
        me = self.world.rank
        for p in peers:
            if p != me:
                req = self._probe(p)
                if req.test():
                    req.wait(Deadline.after(0))  # raises the probe's error (it never completes otherwise)

    def wait(
        self,
        g: Any,
        work: Any,
        deadline: Optional[Deadline],
        what: Callable[[], str],
        *,
        peers: Optional[Sequence[int]] = None,
        abort: bool = True,
    ) -> None:
        """Poll torch's ``work`` until it completes (see the module docstring); then ``work.wait()``.

        Raises DistTimeoutError at ``deadline`` (with ``abort``, the group's torch backend is aborted first:
        its operation would never complete), the transport's error when a peer in ``peers`` (default: the
        group's members) died or the job was aborted, and BrokenError for torch's own errors.
        """
        members = g.ranks if peers is None else peers
        nap = NAP_MIN_S
        spin_end = time.monotonic() + SPIN_S
        next_probe = spin_end  # a short wait polls only the work; the peers are probed once it lasts
        at = float("inf") if deadline is None else deadline.at
        try:
            while not work.is_completed():
                now = time.monotonic()
                if now < spin_end:
                    _sched_yield()  # a small collective completes within microseconds: no sleep's timer slack
                    continue
                if now >= next_probe:
                    next_probe = now + PROBE_EVERY_S
                    self.check_peers(members)
                if now >= at:
                    assert deadline is not None
                    raise DistTimeoutError(
                        f"rank {self.world.rank}: {what()} did not complete on the device after "
                        f"{deadline.elapsed():.2f}s (torch's {self.kind} operation is still pending)"
                    )
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX_S)
        except ProcGroupError as e:
            if abort:
                self.fail(
                    g,
                    f"an earlier {what()} failed ({type(e).__name__}); the torch {self.kind} group of "
                    f"group {g.name} was aborted: destroy the group (or the process group) and create it again",
                )
            raise
        except Exception as e:  # noqa: BLE001 - torch's error, translated
            self._failed(g, e, what, members, abort)
        if abort:
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001 - torch's error, translated
                self._failed(g, e, what, members, abort)

    def _failed(self, g: Any, e: BaseException, what: Callable[[], str], members: Sequence[int], abort: bool) -> None:
        """Raise torch's error ``e`` of an operation as procgroup's: when a member died, torch's error ("connection
        closed by peer") names no rank, so the probes get up to DEAD_PEER_GRACE_S to name it first."""
        err: BaseException = self.torch_error(e, what())
        end = time.monotonic() + DEAD_PEER_GRACE_S
        try:
            while True:
                self.check_peers(members)
                if time.monotonic() >= end:
                    break
                time.sleep(0.01)
        except ProcGroupError as dead:
            err = dead
        if abort:
            self.fail(g, str(err))
        raise err from e

    def settle(self, g: Any, device: Any, deadline: Optional[Deadline], what: Callable[[], str]) -> None:
        """Wait (as :meth:`wait`) until the kernels issued so far on ``device``'s current stream have run: the
        copies back into the caller's tensors after the operation.  Nothing to do on the CPU."""
        if device.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self.wait(g, _EventWork(ev), deadline, what, abort=False)

    # -- lifetime ---------------------------------------------------------------------------------
    @staticmethod
    def _abort(b: Any) -> None:
        if b is None:
            return
        fn = getattr(b, "abort", None) or getattr(b, "_abort", None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort: the group is being given up
                pass

    def _release(self, st: _GroupState) -> None:
        b, st.backend = st.backend, None
        if b is None:
            return
        if st.broken is not None:
            self._abort(b)
            return
        fn = getattr(b, "shutdown", None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass

    def forget_group(self, gid: int) -> None:
        """Group ``gid`` was destroyed: release its torch backend (a later group with that id starts afresh)."""
        with self._lock:
            st = self._states.pop(gid, None)
        if st is not None:
            self._release(st)

    def close(self) -> None:
        """Release every torch backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            states = list(self._states.values())
            self._states.clear()
        for st in states:
            self._release(st)


class _EventWork:
    """A CUDA event seen as a torch Work (``is_completed``/``wait``)."""

    __slots__ = ("ev",)

    def __init__(self, ev: Any) -> None:
        self.ev = ev

    def is_completed(self) -> bool:
        return bool(self.ev.query())

    def wait(self) -> None:
        self.ev.synchronize()
