"""dist.breakpoint(rank=0) under `procgroup run`: rank 0 gets pdb on the launcher's terminal, rank 1 waits."""

import numpy as np

import procgroup as dist

dist.init_process_group(timeout=60)
secret_value = 41 + dist.get_rank()
dist.breakpoint(rank=0)
x = np.ones(2)
dist.all_reduce(x)
print(f"rank {dist.get_rank()} after breakpoint: {x.tolist()}")
dist.destroy_process_group()
