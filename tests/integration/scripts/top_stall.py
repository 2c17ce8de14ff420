"""A job for `procgroup top`'s tests: a few all_reduces, then rank STALL_RANK sleeps STALL_SECS before the next."""

import os
import time

import numpy as np

import procgroup as dist

dist.init_process_group("cpu")
x = np.ones(1024, dtype=np.float32)
for _ in range(3):
    dist.all_reduce(x)
print(f"rank {dist.get_rank()} ready", flush=True)
if dist.get_rank() == int(os.environ["STALL_RANK"]):
    time.sleep(float(os.environ["STALL_SECS"]))
dist.all_reduce(x)
dist.destroy_process_group()
