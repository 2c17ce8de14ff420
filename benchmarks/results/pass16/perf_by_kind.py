"""Split a ``perf record -a`` profile of some processes into kinds of work (pass 16).

    perf script -i perf.data -G -F pid,ip,sym,dso | python perf_by_kind.py PID,PID,...

Prints the share of those processes' samples in: Python's interpreter, numpy, procgroup's C extensions, libc (copies,
sched_yield, socket calls) and the kernel (network stack, scheduler and yields, system-call entry, the rest).  The
kinds are guessed from the symbol and the DSO names: a rough split, for where a call's CPU goes.
"""

import collections
import re
import sys

SCHED = re.compile(r"schedule|yield|switch|idle|halt|pick_next|enqueue|dequeue|update_curr|rq_|_task_|finish_task")
NET = re.compile(r"tcp|skb|ip_|br_|veth|sock|netif|nf_|dev_|inet|copy_to_iter|copy_from_iter|napi|net_rx|recv|send|fib")


def kind(sym: str, dso: str) -> str:
    """The kind of work a sample of ``sym`` in ``dso`` counts as."""
    if "kernel" in dso:
        if SCHED.search(sym):
            return "kernel: scheduler, yield"
        if NET.search(sym):
            return "kernel: network"
        return "kernel: syscall entry" if "syscall" in sym or "entry" in sym else "kernel: other"
    if "umath" in dso or "multiarray" in dso:
        return "numpy"
    if "procgroup" in dso:
        return "procgroup C: " + dso.rsplit("/", 1)[-1].split(".")[0]
    if "python" in dso:
        return "Python"
    if "libc" in dso:
        if "yield" in sym:
            return "libc: sched_yield"
        if "mem" in sym:
            return "libc: memmove"
        return "libc: recv/send" if re.search("recv|send", sym) else "libc: other"
    return "other: " + dso.rsplit("/", 1)[-1].rstrip(")")[:25]


def main() -> None:
    pids = set(sys.argv[1].split(","))
    count: collections.Counter = collections.Counter()
    for line in sys.stdin:
        f = line.split(None, 2)
        if len(f) < 3 or f[0] not in pids:
            continue
        sym, _, dso = f[2].strip().rpartition(" (")
        count[kind(sym, dso)] += 1
    total = sum(count.values()) or 1
    for k, c in count.most_common():
        print(f"{k:32s} {100 * c / total:5.1f}%")
    print("samples", total)


if __name__ == "__main__":
    main()
