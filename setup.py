"""Build hook for the one optional C extension (all metadata lives in pyproject.toml).

``procgroup.transport.shm._native`` is the compiled fast path of the shared-memory arena: plain C against the
CPython API, so building it needs nothing but a C compiler.  It is optional: without a compiler (or when the
compile fails) setuptools warns and installs the package without it, and procgroup uses its pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "procgroup.transport.shm._native",
            sources=["src/procgroup/transport/shm/_native.c"],
            optional=True,
        ),
        Extension(  # the blocking p2p fast receive's poll (transport.shm.transport.recv_fast); optional too
            "procgroup.transport.shm._p2pwait",
            sources=["src/procgroup/transport/shm/_p2pwait.c"],
            optional=True,
        ),
    ]
)
