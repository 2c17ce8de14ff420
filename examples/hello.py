"""The smallest procgroup program: every rank says hello, then they meet at a barrier.

    procgroup run --nproc-per-node 4 examples/hello.py

(or ``python -m procgroup run ...``).  ``procgroup run`` sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and the job secret for each worker and hosts the
store; ``init_process_group()`` reads them.
"""

import os
import socket

import procgroup as dist


def main() -> None:
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    print(
        f"rank {rank}/{world} says hello from {socket.gethostname()} (pid {os.getpid()}, "
        f"local rank {dist.get_local_rank()})"
    )
    dist.barrier()
    if rank == 0:
        print(f"all {world} ranks reached the barrier")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
