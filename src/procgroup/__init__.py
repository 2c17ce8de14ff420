"""procgroup: run one Python program as a group of cooperating processes.

``import procgroup as dist`` gives the process-group API of torch.distributed
without requiring torch.  This file only assembles the public API; the layers
below it are:

* ``protocol/``   sans-IO codecs (store messages, transport frames, object payloads, auth)
* ``transport/``  memory, shared-memory and TCP transports behind one interface
* ``algorithms/`` collectives written only against that interface
* ``store.py``, ``rendezvous.py``, ``group.py``, ``backends/``  the I/O shell and group state
* ``launcher/``   ``procgroup run`` (beside the library, never imported by it)
"""

from .api import (
    Backend,
    GroupMember,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_local_rank,
    get_local_world_size,
    get_node_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    new_group,
    new_subgroups,
    split_group,
)
from .collectives import (
    P2POp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .debug import breakpoint, dump_state, monitored_barrier
from .errors import (
    CollectiveMismatchError,
    ConfigError,
    DistTimeoutError,
    PeerFailureError,
    ProcGroupError,
    RendezvousError,
    RendezvousTimeoutError,
)
from .group import ProcessGroup, Work
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .ops import ReduceOp

#: torch.distributed spelling of the error raised on a deadline
DistBackendError = ProcGroupError
DistError = ProcGroupError

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_")]
