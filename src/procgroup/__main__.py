"""``procgroup`` command: ``procgroup run ...`` (the launcher), ``procgroup top``, ``procgroup env``,
``procgroup bench``.

Also ``python -m procgroup ...``.  The launcher lives beside the library and
the library never imports it.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]

USAGE = """\
usage: procgroup <command> [options]

commands:
  run     start N workers of a Python program as one process group (the torchrun equivalent)
          e.g. procgroup run --nproc-per-node 4 train.py --epochs 3
  top     live view of a running job: one row per rank (state, collective, time in it, bytes/s, RSS, CPU)
          e.g. procgroup top RUN_ID, procgroup top --once
  env     list the environment variables procgroup's launcher sets and its library reads
  bench   benchmark collectives against torch gloo and Open MPI (see README)

`procgroup <command> --help` describes a command.
"""


def _run(argv: list[str]) -> int:
    from .errors import ConfigError, ProcGroupError
    from .launcher.agent import run
    from .launcher.cli import LaunchConfig, parse_args

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        sys.stderr.write(f"procgroup run: error: {e}\n")
        return 2
    try:
        if isinstance(cfg, LaunchConfig):
            return run(cfg)
        from .launcher.head import run_head

        return run_head(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the agent's handlers were installed: nothing was started
        return 130
    except ProcGroupError as e:  # bad configuration, busy port, failed rendezvous of the nodes' agents
        sys.stderr.write(f"procgroup run: error: {e}\n")
        return 1


def _env(argv: list[str]) -> int:
    import argparse

    from .config import ENV

    p = argparse.ArgumentParser(
        prog="procgroup env", description="List the launcher <-> library environment variables."
    )
    p.parse_args(argv)
    rows = [(v.name, v.written_by, v.meaning) for v in ENV.table()]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("written by"), max(len(r[1]) for r in rows))
    print(f"{'variable':<{w0}}  {'written by':<{w1}}  meaning")
    for name, by, meaning in rows:
        print(f"{name:<{w0}}  {by:<{w1}}  {meaning}")
    return 0


def _top(argv: list[str]) -> int:
    from .launcher.top import main as top_main

    return top_main(argv)


def _bench(argv: list[str]) -> int:
    from .bench.cli import main as bench_main

    try:
        return bench_main(argv)
    except KeyboardInterrupt:
        return 130


COMMANDS = {"run": _run, "top": _top, "env": _env, "bench": _bench}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        (sys.stdout if args else sys.stderr).write(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__

        print(f"procgroup {__version__}")
        return 0
    cmd = COMMANDS.get(args[0])
    if cmd is None:
        sys.stderr.write(f"procgroup: unknown command {args[0]!r}; commands: {', '.join(COMMANDS)}\n\n{USAGE}")
        return 2
    return cmd(args[1:])


if __name__ == "__main__":
    sys.exit(main())
