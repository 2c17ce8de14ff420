#!/usr/bin/env python
"""Store scale: N simulated clients rendezvous against one StoreServer.

    python benchmarks/store_scale.py --clients 4096          # target: <= 5 s on the 2-CPU dev machine
    procgroup bench --store-clients 4096                     # the same measurement

Each client is a real TCPStore connection (TCP + HMAC handshake) opened from
a few worker processes with a few threads each; each one sets its key, adds
to a counter, and waits for the ``done`` key that the last one sets after
checking every key is present.  The total is from releasing the already
started worker processes to the last client returning from its wait.  See
src/procgroup/bench/store_scale.py.
"""

import os
import sys

# run from a checkout without installing: prefer the checkout's package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))

from procgroup.bench.store_scale import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
