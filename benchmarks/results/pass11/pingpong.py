"""A 4-byte ping-pong between ranks 0 and 1 (2,000 round trips); rank 0 prints the one-way time, median of each
100.  Run across two netns hosts with ``HOSTS=2 PER=1 mh_loop.sh pingpong.py [PROCGROUP_TCP_SPIN_US=...]`` (as root)."""

import time

import numpy as np

import procgroup as dist


def main() -> None:
    dist.init_process_group()
    r = dist.get_rank()
    a = np.zeros(1, np.float32)
    ts = []
    for _ in range(2000):
        t0 = time.perf_counter()
        if r == 0:
            dist.send(a, 1)
            dist.recv(a, 1)
        else:
            dist.recv(a, 0)
            dist.send(a, 0)
        ts.append(time.perf_counter() - t0)
    if r == 0:
        b = np.array(ts).reshape(20, 100)
        print("per-100 median one-way us:", " ".join(f"{np.median(x) * 1e6 / 2:.0f}" for x in b), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
