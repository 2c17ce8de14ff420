"""procgroup: run one Python program as a group of cooperating processes.

``import procgroup as dist`` gives the process-group API of torch.distributed
without requiring torch.  This file only assembles the public API; the layers
below it are:

* ``protocol/``   sans-IO codecs (store messages, transport frames, object payloads, auth)
* ``transport/``  memory, shared-memory and TCP transports behind one interface
* ``algorithms/`` collectives written only against that interface
* ``store/``, ``rendezvous.py``, ``process_group.py``  the I/O shell and group state
* ``backends/``   the backend interface and registry (``cpu``/``gloo`` built in)
* ``state.py``, ``api.py``, ``subgroups.py``, ``collectives.py``, ``p2p.py``, ``objects.py``, ``debug.py``
  the public API
* ``launcher/``   ``procgroup run`` (beside the library, never imported by it)
"""

from typing import Any as _Any

# The API is imported on first use (PEP 562), so that `import procgroup.launcher` (the launcher) and
# `procgroup env` do not pay for numpy and the collective machinery.
_LAZY = {
    "Backend": "api",
    "CollectiveMismatchError": "errors",
    "ConcurrentUseError": "errors",
    "ConfigError": "errors",
    "DistTimeoutError": "errors",
    "ForkedProcessError": "errors",
    "GroupBrokenError": "errors",
    "GroupMember": "state",
    "P2POp": "p2p",
    "PeerFailureError": "errors",
    "ProcGroupError": "errors",
    "ProcessGroup": "process_group",
    "ReduceOp": "ops",
    "RendezvousError": "errors",
    "RendezvousTimeoutError": "errors",
    "Work": "process_group",
    "all_gather": "collectives",
    "all_gather_into_tensor": "collectives",
    "all_gather_object": "objects",
    "all_reduce": "collectives",
    "all_to_all": "collectives",
    "all_to_all_single": "collectives",
    "barrier": "collectives",
    "batch_isend_irecv": "p2p",
    "breakpoint": "debug",
    "broadcast": "collectives",
    "broadcast_object_list": "objects",
    "destroy_process_group": "api",
    "dump_state": "debug",
    "gather": "collectives",
    "gather_object": "objects",
    "get_backend": "api",
    "get_global_rank": "api",
    "get_group_rank": "api",
    "get_local_rank": "api",
    "get_local_world_size": "api",
    "get_node_rank": "api",
    "get_process_group_ranks": "api",
    "get_rank": "api",
    "get_world_size": "api",
    "group": "state",
    "init_process_group": "api",
    "irecv": "p2p",
    "is_available": "api",
    "is_gloo_available": "api",
    "is_initialized": "api",
    "is_mpi_available": "api",
    "is_nccl_available": "api",
    "is_torchelastic_launched": "api",
    "isend": "p2p",
    "monitored_barrier": "debug",
    "new_group": "subgroups",
    "new_subgroups": "subgroups",
    "recv": "p2p",
    "recv_object_list": "objects",
    "reduce": "collectives",
    "reduce_scatter": "collectives",
    "reduce_scatter_tensor": "collectives",
    "scatter": "collectives",
    "scatter_object_list": "objects",
    "send": "p2p",
    "send_object_list": "objects",
    "split_group": "subgroups",
}


def __getattr__(name: str) -> _Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'procgroup' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_LAZY.update(DistBackendError="errors", DistError="errors")  # torch.distributed spellings
_LAZY.update(reduce_op="ops", Future="futures")
_LAZY.update(ObjectPicklingError="errors", UnsafeObjectError="errors")  # issue 11 items 7, 17
_LAZY.update(dict.fromkeys(["TCPStore", "FileStore", "HashStore", "PrefixStore", "Store"], "stores"))
_LAZY.update(
    dict.fromkeys(
        [
            "default_pg_timeout",
            "get_default_backend_for_device",
            "get_node_local_rank",
            "get_pg_count",
            "is_backend_available",
            "is_ucc_available",
            "is_xccl_available",
            "supports_complex",
        ],
        "compat",
    )
)

__version__ = "0.1.0"

__all__ = sorted(_LAZY) + ["__version__"]
