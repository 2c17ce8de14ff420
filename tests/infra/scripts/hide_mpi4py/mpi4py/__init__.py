"""Stand-in that makes ``import mpi4py`` fail, so a test runs procgroup's no-mpi4py path.

tests/infra/launch.py puts tests/infra/scripts/hide_mpi4py first on the ranks' PYTHONPATH when a
test asks for it (``clean_env(hide_mpi4py=True)``): the result then does not depend on whether
mpi4py happens to be installed, and matches CI, which does not install it.
"""

raise ImportError("mpi4py is hidden by tests/infra/scripts/hide_mpi4py (this test exercises the no-mpi4py path)")
