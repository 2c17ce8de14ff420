"""Where a torch process group served by procgroup sends what procgroup does not carry itself.

:class:`Delegation` is the part of :class:`~procgroup.torch.backend.ProcgroupBackend` that routes tensors:

* CPU tensors of :data:`NATIVE_DTYPES` (strided) stay with procgroup;
* tensors of a delegated device (``Options.device_backends``, ``{"cuda": "nccl"}`` by default) go to that
  device's torch backend, built on first use over the group's own store (no second port);
* anything else (sparse tensors, other dtypes, ``PREMUL_SUM``) falls through to ``Options.fallback`` (gloo),
  logged once per op and reason.

Before torch's NCCL is built, the members compare the GPUs they will use: two ranks on one GPU make NCCL fail
with "Duplicate GPU detected" deep inside its first collective; here they get a :class:`ConfigError` naming
both ranks, the GPU and the fix (``procgroup.backends.nccl.devices.check_one_device_per_rank``, as for
procgroup's own ``backend="nccl"``).
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _core

__all__ = ["NATIVE_DTYPES", "Delegation", "device_of"]

logger = logging.getLogger("procgroup.torch")

#: dtypes procgroup's collectives carry and reduce natively
NATIVE_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)

#: torch Backend method to call on gloo/nccl for a ProcessGroup method name they do not bind
_BACKEND_NAMES = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
}

#: (op, reason) pairs already logged as fallen through, per process
_LOGGED: set = set()


def device_of(args: Sequence[Any]) -> Optional[torch.device]:
    """The device of the first non-CPU tensor among ``args`` (nested lists included), or None."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                return a.device
        elif isinstance(a, (list, tuple)):
            d = device_of(a)
            if d is not None:
                return d
    return None


def _all_contiguous(args: Sequence[Any]) -> bool:
    """True when no tensor among ``args`` (one level of lists included; deeper: False) is non-contiguous."""
    for a in args:
        if type(a) is list:
            for t in a:
                if type(t) is list or (isinstance(t, torch.Tensor) and not t.is_contiguous()):
                    return False
        elif isinstance(a, torch.Tensor) and not a.is_contiguous():
            return False
    return True


def _contiguous_args(args: Sequence[Any]) -> Tuple[List[Any], List[Tuple[torch.Tensor, torch.Tensor]]]:
    """``args`` with each non-contiguous tensor (nested lists included) replaced by a contiguous copy, and the
    (original, copy) pairs to write back."""
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def sub(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if a.layout is torch.strided and not a.is_contiguous():
                c = a.contiguous()
                pairs.append((a, c))
                return c
            return a
        if isinstance(a, list):
            return [sub(x) for x in a]
        return a

    return [sub(a) for a in args], pairs


def _device_identity(device: torch.device) -> Tuple[str, str, str]:
    """(host, GPU UUID or "", "cuda:i") of ``device`` for :func:`shared_devices`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        props = torch.cuda.get_device_properties(index)
        uid = str(getattr(props, "uuid", "") or "")
        if not uid and hasattr(props, "pci_bus_id"):
            uid = f"pci {getattr(props, 'pci_domain_id', 0)}:{props.pci_bus_id}:{getattr(props, 'pci_device_id', 0)}"
    except Exception as e:  # noqa: BLE001 - no identity: the check is skipped, NCCL's own error remains
        logger.info("procgroup.torch: cannot identify %s for the one-GPU-per-rank check: %s", device, e)
        uid = ""
    return socket.gethostname(), uid, f"cuda:{index}"


class Delegation:
    """The routing half of ``ProcgroupBackend`` (see the module docstring); it uses the backend's ``_store``,
    ``_gen`` (the formation's generation over that store), ``_rank``, ``_size``, ``_timeout``, ``_options``,
    ``_cpu_native``, ``_others``, ``_exec`` and ``fallthrough_counts``."""

    _store: Any
    _gen: int
    _rank: int
    _size: int
    _timeout: float
    _options: Any
    _cpu_native: bool
    _others: Dict[str, Any]
    _exec: Any
    fallthrough_counts: Dict[str, int]

    def _torch_backend(self, kind: str, device: Optional[torch.device] = None, check: bool = False) -> Any:
        """The torch backend ``kind`` ("gloo", "nccl") on this group's store, built on first use.

        ``check``: the caller is a collective (every member builds it now), so NCCL is built only after the
        members have checked that no two of them share a GPU (``device``: the call's CUDA device).
        """
        b = self._others.get(kind)
        if b is None:
            # under the formation's generation: gloo built under an earlier group over the same store (destroy,
            # then init again) left its peers' addresses there, and connecting to those fails after a timeout
            pstore = dist.PrefixStore(f"{kind}_under_procgroup/{self._gen}/", self._store)
            tmo = timedelta(seconds=self._timeout)
            if kind == "gloo":
                b = dist.ProcessGroupGloo(pstore, self._rank, self._size, tmo)
            elif kind == "nccl":
                if not dist.is_nccl_available():
                    raise _core.ConfigError(
                        "CUDA tensors go through torch's nccl backend, which this torch build lacks; move the "
                        "tensors to the CPU, or map the device elsewhere with procgroup.torch.Options(device_backends=)"
                    )
                if check:
                    self._check_one_gpu_per_rank(pstore, device)
                nccl = dist.ProcessGroupNCCL  # only in CUDA builds
                nopts = nccl.Options()
                nopts._timeout = tmo
                b = nccl(pstore, self._rank, self._size, nopts)
            else:
                raise _core.ConfigError(f"procgroup.torch cannot build torch backend {kind!r}: use 'gloo' or 'nccl'")
            self._others[kind] = b
        return b

    def _check_one_gpu_per_rank(self, store: Any, device: Optional[torch.device]) -> None:
        """Collective: raise ConfigError on every rank when two members would put NCCL on one GPU."""
        if self._size < 2:
            return
        if device is None or device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = "\0".join(_device_identity(device))
        store.set(f"gpu/{self._rank}", mine)
        keys = [f"gpu/{r}" for r in range(self._size)]
        try:
            store.wait(keys, timedelta(seconds=self._timeout))
        except Exception as e:  # noqa: BLE001 - torch's store error: say which step waited
            raise _core.DistTimeoutError(
                f"building torch's NCCL under procgroup group {getattr(self, '_group_name', '')!r} (rank "
                f"{self._rank} of {self._size}): not every member ran its first CUDA collective within "
                f"{self._timeout:.0f} s ({e}); every member must call the same collectives, or raise the group's "
                "timeout"
            ) from e
        entries = [bytes(store.get(k)).decode().split("\0") for k in keys]
        _core.check_one_device_per_rank(
            [(host, uid or f"unknown device of rank {r}") for r, (host, uid, _) in enumerate(entries)],
            list(range(self._size)),
            names=[name for _, _, name in entries],
            hostnames=[host for host, _, _ in entries],
            op=f"CUDA collectives under procgroup (rank {self._rank})",
        )

    def _get_backend(self, device: Any) -> Any:
        """The torch Backend carrying tensors of ``device`` (built on first use), as torch's own accessor.

        Only delegated devices (``Options.device_backends``, CUDA by default) have one: procgroup serves CPU
        tensors itself, so for those this raises RuntimeError, as torch does for a device with no backend.
        """
        dev = torch.device(device)
        kind = self._options.device_backends.get(dev.type)
        if kind is None:
            raise RuntimeError(
                f"No backend type associated with device type {dev.type}: the procgroup process group "
                f"serves {dev.type} tensors itself, without a torch Backend"
            )
        return self._torch_backend(kind, dev if dev.type != "cpu" else None)

    def _route(self, tensors: Sequence[torch.Tensor]) -> Optional[str]:
        """None when procgroup serves these tensors; else why not (and so where they go)."""
        for t in tensors:
            if t.is_cpu and self._cpu_native and t.layout is torch.strided and t.dtype in NATIVE_DTYPES:
                continue
            dev = t.device.type
            if dev in self._options.device_backends:
                return "device:" + dev
            if dev != "cpu":
                raise _core.ConfigError(
                    f"procgroup.torch: tensors on device {dev!r} have no backend; pass "
                    f"pg_options=procgroup.torch.Options(device_backends={{{dev!r}: ...}})"
                )
            if t.layout != torch.strided:
                return f"{t.layout} tensors"
            if t.dtype not in NATIVE_DTYPES:
                return f"dtype {t.dtype}"
        return None

    def _other(self, op: str, why: str, *args: Any, collective: bool = True) -> Any:
        """Run ``op`` on the torch backend that ``why`` selects (``collective``: every member runs it now)."""
        if why.startswith("device:"):
            kind = self._options.device_backends[why[7:]]
        else:
            kind = self._options.fallback
            self.fallthrough_counts[op] = self.fallthrough_counts.get(op, 0) + 1
            if (op, why) not in _LOGGED:
                _LOGGED.add((op, why))
                logger.warning(
                    "procgroup.torch: %s on %s is not served by procgroup; it falls through to %s", op, why, kind
                )
        self._exec.drain()  # program order: procgroup's queued ops first
        b = self._others.get(kind) or self._torch_backend(kind, device_of(args), collective)
        if _all_contiguous(args):  # the usual case, without copying the argument lists
            return getattr(b, _BACKEND_NAMES.get(op, op))(*args)
        cargs, pairs = _contiguous_args(args)
        work = getattr(b, _BACKEND_NAMES.get(op, op))(*cargs)
        if pairs:  # torch's NCCL refuses non-contiguous tensors: it ran on copies, written back once done
            if work is not None:  # (torch's NCCL returns none for an op it completed, e.g. at world size 1)
                work.wait()  # NCCL: the current stream waits for the op (the copies below queue after it)
            with torch.no_grad():
                for t, c in pairs:
                    t.copy_(c)
        return work

    def _other_p2p(self, op: str, why: str, *args: Any) -> Any:
        """:meth:`_other` for point-to-point ops, which cannot build a backend underneath themselves.

        Building gloo (or nccl) is collective over the group, and only two ranks take part in a send: when the
        backend is not there yet, this raises ConfigError instead of hanging.
        """
        kind = self._options.device_backends[why[7:]] if why.startswith("device:") else self._options.fallback
        if kind not in self._others and not (kind == "nccl" and why.startswith("device:")):
            raise _core.ConfigError(
                f"procgroup.torch: {op} of {why} is not served by procgroup and would need the {kind} backend "
                f"underneath, which every rank of the group must build together; run a collective on such tensors "
                f"first (it builds it), or send contiguous CPU tensors of a dtype in {sorted(map(str, NATIVE_DTYPES))}"
            )
        return self._other(op, why, *args, collective=False)
