"""A script written for torch.distributed.launch before ``--use-env``: it takes its local rank from argv.

torch.distributed.launch passed ``--local-rank=N`` (torch >= 2.0; ``--local_rank=N`` before) to every worker.
torchrun and ``procgroup run`` pass it in the environment (LOCAL_RANK) instead, so under them this script
would see its default (-1) and run silently wrong.  ``--local-rank-arg`` passes it the old way::

    procgroup run --nproc-per-node 4 --local-rank-arg examples/launch_style.py --steps 2
    procgroup run --nproc-per-node 4 --local-rank-arg=underscore examples/launch_style.py   # --local_rank=N
"""

import argparse

import numpy as np

import procgroup as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=1)
    args = p.parse_args()
    dist.init_process_group("gloo")  # env:// with the variables the launcher sets
    total = np.zeros(1, dtype=np.int64)
    for _ in range(args.steps):
        total = np.array([args.local_rank], dtype=np.int64)
        dist.all_reduce(total)
    print(f"rank {dist.get_rank()}: local rank {args.local_rank}, sum of local ranks {int(total[0])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
