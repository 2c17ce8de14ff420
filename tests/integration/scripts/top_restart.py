"""A job for `procgroup top`'s follow test: generation 0's rank 1 fails after a while, generation 1 idles."""

import os
import time

import numpy as np

import procgroup as dist

dist.init_process_group("cpu")
x = np.ones(4, dtype=np.float32)
dist.all_reduce(x)
if os.environ["PROCGROUP_RESTART_COUNT"] == "0":
    # until the test has read generation 0 (it makes this file then; it slept 4 s before), at most 30 s
    go = os.path.join(os.environ["PROCGROUP_RUNTIME_DIR"], os.pardir, "top_restart.go")
    stop = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < stop:
        time.sleep(0.05)
    if dist.get_rank() == 1:
        raise SystemExit("generation 0 fails on purpose")
    time.sleep(60)
time.sleep(60)
dist.destroy_process_group()
