"""A job for `procgroup top`'s follow test: generation 0's rank 1 fails after a while, generation 1 idles."""

import os
import time

import numpy as np

import procgroup as dist

dist.init_process_group("cpu")
x = np.ones(4, dtype=np.float32)
dist.all_reduce(x)
if os.environ["PROCGROUP_RESTART_COUNT"] == "0":
    time.sleep(4.0)
    if dist.get_rank() == 1:
        raise SystemExit("generation 0 fails on purpose")
    time.sleep(60)
time.sleep(60)
dist.destroy_process_group()
