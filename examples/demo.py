"""The main demo: run with `procgroup run --standalone --nproc-per-node 4 examples/demo.py`.

Every rank reports who it is, passes a barrier, then the group exchanges
real data: a ring of send/recv, an all_reduce in a subgroup of the first
two ranks, and an all_gather of every rank's id.  Each result is checked
against its closed form and printed by rank 0.
"""

import os

import numpy as np

import procgroup as dist


def main() -> None:
    dist.init_process_group()  # identity from `procgroup run` (or torchrun, srun, mpirun...)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(
        f"rank {rank}/{world} (local rank {dist.get_local_rank()}, node {dist.get_node_rank()}, "
        f"pid {os.getpid()}) is up"
    )
    dist.barrier()

    # 1. ring of point-to-point messages: each rank sends its rank to the next one
    if world > 1:
        token = np.array([rank], dtype=np.int64)
        got = np.empty(1, dtype=np.int64)
        right, left = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            dist.send(token, right)
            dist.recv(got, left)
        else:
            dist.recv(got, left)
            dist.send(token, right)
        assert got[0] == left, (got, left)

    # 2. all_reduce in a subgroup of ranks 0 and 1 (every rank must create the group)
    sub = dist.new_group([0, 1]) if world > 1 else None
    if sub is not None and rank in (0, 1):
        x = np.full(4, rank + 1, dtype=np.float32)
        dist.all_reduce(x, group=sub)
        assert np.all(x == 3.0), x

    # 3. all_reduce and all_gather over everyone
    v = np.arange(8, dtype=np.float64) * (rank + 1)
    dist.all_reduce(v)
    expect = np.arange(8) * world * (world + 1) / 2
    assert np.allclose(v, expect), (v, expect)
    ids = [np.empty(1, np.int32) for _ in range(world)]
    dist.all_gather(ids, np.array([rank * 10], np.int32))
    assert [int(i[0]) for i in ids] == [r * 10 for r in range(world)]

    if rank == 0:
        print(
            f"all checks passed on {world} ranks: ring send/recv, subgroup all_reduce, all_reduce sum={v[1]:.0f}, "
            f"all_gather={[int(i[0]) for i in ids]}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
