#!/usr/bin/env python
"""Multi-host all_reduce: procgroup vs Open MPI over TCP, 3 network-namespace hosts x 2 ranks.

    sudo python benchmarks/multihost.py                         # 64 MiB, 10 iterations, 3 rounds
    sudo python benchmarks/multihost.py --sizes 1M,16M,64M --repeat 5
    sudo python benchmarks/multihost.py --mpi-configs default   # stock Open MPI settings only

The target (from the performance issue): "across 3 network-namespace hosts x 2 ranks, 64 MiB
all_reduce at least as fast as Open MPI over TCP on the same hosts".

What it does, as root:

1. hosts: ``infra/netns_up.sh`` makes the hosts (default ``pgb1..pgb3``, 10.78.0.K, a private
   prefix so the test suite's h1..h3 are never touched; ``--prefix h`` uses the shared ones under
   the test fixtures' lock).  Hosts that are already up are reused and left up.  Each host is a
   network + UTS namespace whose own name resolves to 127.0.1.1; filesystem, /dev/shm and the pid
   namespace are shared with the machine.
2. rounds (``--repeat``): in each round every system runs once, in alternating order (round 0:
   procgroup first, round 1: MPI first, ...), so that both see the same background load;
   /proc/loadavg and the CPU share other users took are recorded with every run.

   * procgroup: one ``procgroup run --nnodes 3 --node-rank K --master-addr <host1>
     --nproc-per-node 2`` per host, each started in that host with ``infra/hostexec.sh`` (per-node
     mode, the configuration tests/infra/test_launcher_multinode.py runs).  Ranks on one host use
     procgroup's shm transport, ranks on different hosts its TCP transport (the host key includes
     the network namespace); the worker records each rank's per-peer transports and the
     all_reduce algorithm procgroup selects.
   * Open MPI: ``mpirun -H host1:2,host2:2,host3:2 --mca plm_rsh_agent infra/rsh_hostexec.sh``
     from host1, mpi4py's buffer ``Allreduce(IN_PLACE, SUM)``, with ``--mca pml ob1 --mca btl
     tcp,vader,self --mca btl_tcp_if_include eth0``: between hosts only the tcp btl can reach a
     peer; within a host Open MPI's default shared-memory btl (vader) is used.  ``--mpi-configs``
     picks one or more variants (see MPI_CONFIGS), each timed in every round.

   Both use the cases of procgroup's own benchmark (src/procgroup/bench/cases.py): float32,
   every rank's result compared with the closed form before timing, per-iteration time = the
   slowest rank's, median/p90 over iterations, algbw = bytes/time, busbw = algbw * 2(n-1)/n.
3. report: per round and size the medians and ratios procgroup/MPI, then the median over rounds;
   JSON + markdown under ``--out-dir`` (default benchmarks/results/multihost/).
4. teardown, also on failure, Ctrl-C, SIGTERM (and, through a watchdog process, if this process
   is killed): every process started in the hosts, the /dev/shm segments of the runs, and the
   hosts if this run made them.

Experiments (for whoever tunes procgroup): ``--pg-stage-times`` splits procgroup's all_reduce
time into its stages; ``--pg-variant NAME=all_reduce=ALG`` times procgroup with an algorithm pinned
(select.FORCE; an upper-case name sets an integer threshold of select) beside the default in every
round, and with ``--pg-ab`` inside the default run, alternating with it per iteration (the comparison
to trust on a shared machine: load drifts between runs); ``--op sendrecv --hosts 2 --per-host 1``
measures one TCP hop.  ``--render JSON`` re-renders a report.  Every run also records each system's
CPU time per call (all ranks, user + sys).

The same file is the worker (``--worker procgroup|mpi``, started by the launchers).
"""

from __future__ import annotations

import os
import sys

# run from a checkout without installing: this folder (the mhbench package) and the checkout's procgroup first
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, os.pardir, "src")]

from mhbench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
