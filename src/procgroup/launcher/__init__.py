"""``procgroup run``: the launcher (beside the library; the library never imports it).

Four ways to start a job (the mode follows from the flags and the environment, :mod:`.cli`):

one node
    ``procgroup run --standalone --nproc-per-node 4 train.py``

one ``procgroup run`` per node (torchrun's static rendezvous)
    ``PROCGROUP_SECRET=... procgroup run --nnodes 3 --node-rank K --master-addr h1 --master-port 29500
    --nproc-per-node 2 train.py`` on every node.  The agents rendezvous through the store node 0's agent
    hosts at ``--master-addr:--master-port``; global ranks follow node ranks.  ``--node-rank`` omitted:
    the agent on the master host is node 0, the others follow by host name.  Every node needs the same
    secret: ``PROCGROUP_SECRET`` or ``--secret-file``.

head node over ssh
    ``procgroup run --hostfile hosts --nproc-per-node 2 train.py`` with lines ``HOST [slots=N]``: one
    agent per host, started with ``ssh -T -o BatchMode=yes`` (``--ssh-command``, ``--ssh-port``,
    ``--ssh-option``), in the head's working directory with the head's interpreter; the forwarded
    environment (``--env``, ``--env-prefix``, ``--env-all``) is printed once; the secret travels on
    each session's stdin.  Output of every host streams back; Ctrl-C stops every host.

srun
    ``srun -N3 --ntasks-per-node=1 procgroup run --nproc-per-node 2 train.py``: node rank, node count,
    master and port from Slurm's variables; the secret from ``PROCGROUP_SECRET`` if exported, else
    through a 0600 file node 0 writes in the (shared) working directory and removes once all joined.

On several nodes, a failure anywhere stops every worker everywhere (the failing node's agent writes a
failure record to the store; the others watch it), every agent prints the root cause and exits with the
same code, node 0 (or the head) prints the table of all ranks, and ``--max-restarts`` restarts the whole
gang on every node.  Modules: :mod:`.cli` (flags) -> :mod:`.config` (the frozen configuration),
:mod:`.agent` (one node) with :mod:`.attempt` (one generation's pieces) and :mod:`.jobsecret`,
:mod:`.gang` (the agents' protocol), :mod:`.hosts` + :mod:`.head` (ssh), :mod:`.control` (the head <-> agent
link; its messages are :mod:`procgroup.protocol.control`), :mod:`.slurm`, :mod:`.workers` (processes),
:mod:`.report` (results), :mod:`.bootstrap` (worker entry point).
"""
