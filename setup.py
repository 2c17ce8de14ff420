"""Build hook for the two optional C extensions (all metadata lives in pyproject.toml).

``procgroup.transport.shm._native`` is the compiled fast path of the shared-memory arena, and
``procgroup.transport.shm._p2pwait`` that of small blocking receives: plain C against the CPython API, so building
them needs nothing but a C compiler.  Both are optional: without a compiler (or when a compile fails) setuptools
warns and installs the package without them, and procgroup uses its pure-Python paths.
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
