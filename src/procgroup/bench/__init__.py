"""``procgroup bench``: measure collectives, start-up and store scale on this machine.

* :mod:`.cli`          the command (``procgroup bench``, ``python -m procgroup.bench``)
* :mod:`.cases`        what is measured and how: sizes, iterations, data, closed-form checks, the timing loop
* :mod:`.worker`       procgroup's worker (under ``procgroup run``)
* :mod:`.torch_worker` torch.distributed gloo's worker (under ``procgroup run``)
* :mod:`.mpi_worker`   mpi4py's worker (under ``mpirun``)
* :mod:`.report`       tables, markdown, target verdicts, the optional plot
* :mod:`.store_scale`  many TCPStore clients against one StoreServer

The library never imports this package.
"""

from .cli import main

__all__ = ["main"]
