"""Build hook for the four optional C extensions (all metadata lives in pyproject.toml).

``procgroup.transport.shm._native`` is the compiled fast path of the shared-memory arena, and
``procgroup.transport.shm._p2pwait`` that of small blocking receives, and ``procgroup._groupcore`` a planned
collective's bookkeeping: plain C against the CPython API, so building
them needs nothing but a C compiler.  All three are optional: without a compiler (or when a compile fails) setuptools
warns and installs the package without them, and procgroup uses its pure-Python paths.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "procgroup.transport.shm._native",
            sources=[  # one module from several files (_native.h says which holds what)
                "src/procgroup/transport/shm/_native.c",
                "src/procgroup/transport/shm/_native_slots.c",
                "src/procgroup/transport/shm/_native_reduce.c",
                "src/procgroup/transport/shm/_native_queue.c",
                "src/procgroup/transport/shm/_native_big.c",
                "src/procgroup/transport/shm/_native_a2a.c",
                "src/procgroup/transport/shm/_native_read.c",
                "src/procgroup/transport/shm/_native_rr.c",
            ],
            depends=["src/procgroup/transport/shm/_native.h"],
            optional=True,
        ),
        Extension(  # the blocking p2p fast receive's poll (transport.shm.transport.recv_fast); optional too
            "procgroup.transport.shm._p2pwait",
            sources=[  # one module from several files (_p2pwait.h says which holds what)
                "src/procgroup/transport/shm/_p2pwait.c",
                "src/procgroup/transport/shm/_p2pwait_ring.c",
                "src/procgroup/transport/shm/_p2pwait_core.c",
                "src/procgroup/transport/shm/_p2pwait_front.c",
            ],
            depends=["src/procgroup/transport/shm/_p2pwait.h"],
            optional=True,
        ),
        Extension(  # the tcp transport's wait for several receives at once (transport._tcp_read.wait_many); optional
            "procgroup.transport._tcpwait",
            sources=["src/procgroup/transport/_tcpwait.c"],
            optional=True,
        ),
        Extension(  # a planned collective's bookkeeping (procgroup.groupcore.GroupCore.run_plan); optional too
            "procgroup._groupcore",
            sources=["src/procgroup/_groupcore.c"],
            optional=True,
        ),
    ]
)
