"""procgroup as a torch.distributed backend vs gloo, through torch's own API, in the same run.

    PYTHONPATH=$PWD/src python benchmarks/torch_backend.py --repeat 3 --out benchmarks/results/torch/bench.md

For N in --sizes (default 2 and 4) it launches N ranks with ``procgroup run``.  Every rank builds a gloo group
and a procgroup group over the same store, then runs interleaved rounds (gloo, procgroup, procgroup's own API,
gloo, ...) and reports medians over rounds:

* all_reduce of 4 B and of 64 MiB (float32 SUM): time per call, and procgroup / gloo;
* (N=1) the same per-call overhead as this thread's CPU time, which the load of other processes hardly moves;
* per-call overhead of procgroup through torch over procgroup's own API (``procgroup.all_reduce`` on the group
  under the torch group, the same 4 B float32, as a numpy array, and as the torch tensor itself);
* the same overhead for the other one-tensor collectives with a blocking hot path (broadcast, reduce, all_gather
  in the list form, all_gather_into_tensor, reduce_scatter_tensor; 4 B per rank): through torch, procgroup's own
  API on the same torch tensors, and on numpy arrays (at N=1 also as this thread's CPU time);
* 4 B: CPU time and context switches per call summed over the ranks (what one rank's CPU per call costs its
  peers when ranks outnumber cores);
* (N=2 only) a DDP training step of an MLP with 33.6 MB of fp32 gradients (``gradient_as_bucket_view`` per
  --grad-as-bucket-view, SGD, ``zero_grad()``): batch 1 (communication dominates as far as a 33.6 MB model
  can) and 32 (compute about half); the script is the same for both backends except the group, both DDP models
  start identical and train on the same data, their final parameters are checked bit for bit, and a third copy
  runs the same step under ``no_sync()`` (the step without communication).  A fourth copy registers a comm hook
  that returns each bucket untouched (DDP's whole step but the all_reduce); that step plus procgroup's all_reduce
  of the same buckets alone (blocking, same run) is the floor a backend can reach with DDP on this machine.

``--parts`` picks what runs (default: all of small, big, ops, ddp), to keep runs short.

Timings on a shared machine are only comparable within one run; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def _timeit_ranks(fn, iters: int, dist, torch, group) -> tuple:
    """(seconds per call, CPU seconds per call summed over the ranks, context switches per call summed over the
    ranks): the sums show what one rank's extra CPU per call costs its peers on an oversubscribed host."""
    import resource

    fn()
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time(), time.perf_counter()
    for _ in range(iters):
        fn()
    t1, c1, r1 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
    sw = (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw)
    tot = torch.tensor([c1 - c0, float(sw)], dtype=torch.float64)
    dist.all_reduce(tot, group=group)
    return (t1 - t0) / iters, float(tot[0]) / iters, float(tot[1]) / iters


def _timeit(fn, iters: int, clock=time.perf_counter) -> float:
    fn()
    t0 = clock()
    for _ in range(iters):
        fn()
    return (clock() - t0) / iters


#: the collectives whose per-call overhead the "ops" part measures, in table order
OPS = ("broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


def _op_calls(dist, procgroup, np, torch, world: int, pg_group, own) -> dict:
    """op -> (through torch, own API on the same torch tensors, own API on numpy arrays): 4 B per rank."""
    t, a = torch.ones(1), np.ones(1, dtype=np.float32)
    outs_t = [torch.zeros(1) for _ in range(world)]
    outs_a = [np.zeros(1, dtype=np.float32) for _ in range(world)]
    cat_t, cat_a = torch.ones(world), np.ones(world, dtype=np.float32)
    # torch 2.13's names (the older all_gather_into_tensor / reduce_scatter_tensor warn on every call)
    _agit = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _rst = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    mx, pmx = dist.ReduceOp.MAX, procgroup.ReduceOp.MAX  # MAX: repeated calls keep the values finite
    return {
        "broadcast": (
            lambda: dist.broadcast(t, 0, group=pg_group),
            lambda: procgroup.broadcast(t, 0, group=own),
            lambda: procgroup.broadcast(a, 0, group=own),
        ),
        "reduce": (
            lambda: dist.reduce(t, 0, op=mx, group=pg_group),
            lambda: procgroup.reduce(t, 0, op=pmx, group=own),
            lambda: procgroup.reduce(a, 0, op=pmx, group=own),
        ),
        "all_gather": (
            lambda: dist.all_gather(outs_t, t, group=pg_group),
            lambda: procgroup.all_gather(outs_t, t, group=own),
            lambda: procgroup.all_gather(outs_a, a, group=own),
        ),
        "all_gather_into_tensor": (
            lambda: _agit(cat_t, t, group=pg_group),
            lambda: procgroup.all_gather_into_tensor(cat_t, t, group=own),
            lambda: procgroup.all_gather_into_tensor(cat_a, a, group=own),
        ),
        "reduce_scatter_tensor": (
            lambda: _rst(t, cat_t, op=mx, group=pg_group),
            lambda: procgroup.reduce_scatter_tensor(t, cat_t, op=pmx, group=own),
            lambda: procgroup.reduce_scatter_tensor(a, cat_a, op=pmx, group=own),
        ),
    }


def _ddp_cases(args: argparse.Namespace) -> dict:
    """label -> (model builder, batch builder, batch size): the two DDP cases, one model.

    The MLP 2048 -> 2048 -> 2048 (33.6 MB of fp32 gradients).  Its compute is memory-bound at small batches: the
    forward reads every weight, the backward writes every gradient (and reads the second layer's weights), the
    optimizer reads the gradients and rewrites the weights.  On this 2-core machine that floor (about 20 ms of CPU
    per step) is about what gloo's all_reduce of the same 33.6 MB costs, so no 33.6 MB model has a step in which
    communication dominates by much; the smallest batch (--small-batch, 1) comes closest.  --big-batch (32) makes
    the step without communication somewhat longer than gloo's all_reduce: compute about half.
    """
    import torch
    from torch import nn

    width = 2048

    def mlp():
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def data(g, bs):
        return torch.randn(bs, width, generator=g)

    return {
        "communication dominates": (mlp, data, args.small_batch),
        "compute about half": (mlp, data, args.big_batch),
    }


def _ddp_case(case, dist, torch, nn, DDP, rank, gloo_group, pg_group, rec, label, args) -> dict:
    """One DDP case: the same script on gloo and on procgroup (and once more without communication, for the
    compute share), steps interleaved; returns the case's facts (params identical bit for bit?)."""
    build, batch, bs = case

    def make(group):
        torch.manual_seed(0)
        return DDP(build(), process_group=group, gradient_as_bucket_view=args.grad_as_bucket_view)

    models = {
        n: make(g)
        for n, g in (
            ("gloo", gloo_group),
            ("procgroup", pg_group),
            ("no comm", gloo_group),
            ("no all_reduce", pg_group),
        )
    }

    def skip_allreduce(state, bucket):  # DDP's whole step (bucket copies, hooks, futures) except the all_reduce
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    models["no all_reduce"].register_comm_hook(None, skip_allreduce)
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    compute, cpu = [], {n: [] for n in models}
    # the all_reduces DDP issues per step (one per bucket), alone: blocking calls on the procgroup group
    buckets = [torch.ones(p.numel()) for p in models["gloo"].parameters() if p.numel() * 4 > 1 << 20]
    for step in range(args.ddp_steps):
        x = batch(torch.Generator().manual_seed(step * 10 + rank), bs)
        for n, m in models.items():
            dist.barrier(group=gloo_group)
            t0, c0 = time.perf_counter(), time.process_time()
            if n == "no comm":  # the same step, without communication: the compute share
                with m.no_sync():
                    opts[n].zero_grad()
                    m(x).square().mean().backward()
                    opts[n].step()
                compute.append(time.perf_counter() - t0)
            else:  # gloo, procgroup, and the step without its all_reduce (its comm hook returns the bucket)
                opts[n].zero_grad()
                m(x).square().mean().backward()
                opts[n].step()
                rec(f"DDP {label} {n}", time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
        dist.barrier(group=gloo_group)
        t0 = time.perf_counter()
        for b in buckets:
            dist.all_reduce(b, group=pg_group)
        rec(f"DDP {label} buckets all_reduce alone", time.perf_counter() - t0)
    same = all(torch.equal(a, b) for a, b in zip(models["gloo"].parameters(), models["procgroup"].parameters()))
    grads = sum(p.numel() * p.element_size() for p in models["gloo"].parameters())
    return {
        "batch": bs,
        "grad_mb": grads / 1e6,
        "identical_params": same,
        "compute_s": statistics.median(compute),
        "process_cpu_s": {n: statistics.median(v) for n, v in cpu.items()},  # every thread of the rank
    }


def worker(args: argparse.Namespace) -> None:
    """One rank: every measurement, interleaved; rank 0 prints one JSON line ``RESULT {...}``."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import procgroup
    import procgroup.torch

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg_group = dist.new_group(backend="procgroup")
    gloo_group = dist.group.WORLD
    own = pg_group.procgroup  # procgroup's own group under the torch one (the torch group is the backend)
    small = torch.ones(1)
    big = torch.ones(64 * MiB // 4) if "big" in args.parts else None
    small_np = np.ones(1, dtype=np.float32)
    rows: dict[str, list[float]] = {}

    def rec(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    parts = set(args.parts)
    ops = _op_calls(dist, procgroup, np, torch, world, pg_group, own) if "ops" in parts else {}
    for _ in range(args.rounds):
        if "small" in parts:
            for key, fn in (
                ("4B gloo", lambda: dist.all_reduce(small, group=gloo_group)),
                ("4B procgroup", lambda: dist.all_reduce(small, group=pg_group)),
                ("4B procgroup own API", lambda: procgroup.all_reduce(small_np, group=own)),
                ("4B procgroup own API tensor", lambda: procgroup.all_reduce(small, group=own)),
            ):
                dist.barrier(group=gloo_group)
                wall, cpu, sw = _timeit_ranks(fn, args.small_iters, dist, torch, gloo_group)
                rec(key, wall)
                rec(f"ranks cpu {key}", cpu)
                rec(f"ranks switches {key}", sw)
            if world == 1:  # the per-call cost alone: this thread's CPU time, which other processes' load hardly moves
                for key, fn in (
                    ("cpu 4B procgroup", lambda: dist.all_reduce(small, group=pg_group)),
                    ("cpu 4B procgroup own API", lambda: procgroup.all_reduce(small_np, group=own)),
                    ("cpu 4B procgroup own API tensor", lambda: procgroup.all_reduce(small, group=own)),
                ):
                    rec(key, _timeit(fn, args.small_iters * 10, time.thread_time))
        for op, fns in ops.items():
            for how, fn in zip(("torch", "own tensor", "own numpy"), fns):
                dist.barrier(group=gloo_group)
                rec(f"op {op} {how}", _timeit(fn, args.small_iters))
                if world == 1:
                    rec(f"cpu op {op} {how}", _timeit(fn, args.small_iters * 10, time.thread_time))
        if "big" in parts:
            for name, grp in (("gloo", gloo_group), ("procgroup", pg_group)):
                dist.barrier(group=gloo_group)
                rec(f"64MiB {name}", _timeit(lambda g=grp: dist.all_reduce(big, group=g), args.big_iters))

    ddp: dict[str, object] = {}
    if world == 2 and "ddp" in args.parts and not args.no_ddp:
        for label, case in _ddp_cases(args).items():
            ddp[label] = _ddp_case(case, dist, torch, nn, DDP, rank, gloo_group, pg_group, rec, label, args)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in rows.items()}
        print("RESULT " + json.dumps({"world": world, "median_s": med, "ddp": ddp}), flush=True)
    dist.barrier(group=gloo_group)
    dist.destroy_process_group()


def launch(n: int, args: argparse.Namespace) -> dict:
    """Run one ``procgroup run`` job of n ranks; returns rank 0's RESULT."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        "-m",
        "procgroup",
        "run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        __file__,
        "--worker",
        "--rounds",
        str(args.rounds),
        "--small-iters",
        str(args.small_iters),
        "--big-iters",
        str(args.big_iters),
        "--ddp-steps",
        str(args.ddp_steps),
        "--small-batch",
        str(args.small_batch),
        "--big-batch",
        str(args.big_batch),
    ]
    if args.no_ddp:
        cmd.append("--no-ddp")
    cmd += ["--grad-as-bucket-view", str(args.grad_as_bucket_view)]
    cmd += ["--parts", *args.parts]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout, check=False)
    for line in r.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"benchmark job at N={n} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def table(results: list[dict], load: str) -> str:
    """Markdown table from the per-N results (each a median over rounds, then over --repeat runs)."""
    us = 1e6
    out = [
        f"machine: {os.cpu_count()} CPUs; load average before/after: {load}",
        "",
        "| N | measure | gloo | procgroup | procgroup / gloo |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        m, n = res["median_s"], res["world"]
        for size, unit, f in (("4B", "µs", us), ("64MiB", "ms", 1e3)):
            if f"{size} gloo" in m:
                g, p = m[f"{size} gloo"], m[f"{size} procgroup"]
                out.append(f"| {n} | all_reduce {size} ({unit}/call) | {g * f:.1f} | {p * f:.1f} | {p / g:.3f} |")
        if "4B procgroup own API" in m:
            own = m["4B procgroup own API"]
            ownt = m["4B procgroup own API tensor"]
            out.append(
                f"| {n} | 4B: through torch minus own API on the tensor (µs/call) | | "
                f"{(m['4B procgroup'] - ownt) * us:.1f} (own API on the tensor {ownt * us:.1f}, on numpy "
                f"{own * us:.1f}) | |"
            )
        if "ranks cpu 4B procgroup" in m:
            cells = "; ".join(
                f"{lab} {m['ranks cpu ' + k] * us:.1f} µs, {m['ranks switches ' + k]:.2f} sw"
                for lab, k in (
                    ("gloo", "4B gloo"),
                    ("through torch", "4B procgroup"),
                    ("own API tensor", "4B procgroup own API tensor"),
                    ("own API numpy", "4B procgroup own API"),
                )
            )
            out.append(f"| {n} | 4B: CPU time and context switches per call, summed over ranks | | {cells} | |")
        if "cpu 4B procgroup" in m:
            c, o, ot = m["cpu 4B procgroup"], m["cpu 4B procgroup own API"], m["cpu 4B procgroup own API tensor"]
            out.append(
                f"| {n} | 4B: CPU time per call, through torch minus own API on the tensor (µs) | | "
                f"{(c - ot) * us:.1f} ({c * us:.1f} - {ot * us:.1f}; own API on numpy {o * us:.1f}) | |"
            )
        for op in OPS:
            for pre, what in (("", "µs/call"), ("cpu ", "CPU µs per call")):
                k = f"{pre}op {op}"
                if f"{k} torch" in m:
                    tt, ot, on = (m[f"{k} {h}"] * us for h in ("torch", "own tensor", "own numpy"))
                    out.append(
                        f"| {n} | {op} 4B: through torch minus own API on the tensor ({what}) | | {tt - ot:.1f} "
                        f"({tt:.1f} - {ot:.1f}; own API on numpy {on:.1f}) | |"
                    )
        for label, d in res.get("ddp", {}).items():
            g, p = m[f"DDP {label} gloo"], m[f"DDP {label} procgroup"]
            if f"DDP {label} no all_reduce" in m:
                na, ar = m[f"DDP {label} no all_reduce"], m[f"DDP {label} buckets all_reduce alone"]
                out.append(
                    f"| {n} | DDP floor, {label}: the step without its all_reduce (a comm hook that returns the "
                    f"bucket) {na * 1e3:.1f} ms + procgroup's all_reduce of the "
                    f"gradients over 1 MiB alone "
                    f"{ar * 1e3:.1f} ms (ms) | {g * 1e3:.1f} | {(na + ar) * 1e3:.1f} | {(na + ar) / g:.3f} |"
                )
            cpus = " / ".join(f"{v * 1e3:.1f}" for v in d.get("process_cpu_s", {}).values())
            out.append(
                f"| {n} | DDP step, {label}: {d.get('grad_mb', 0):.1f} MB grads, batch {d['batch']} (ms; the "
                f"step without communication {d['compute_s'] * 1e3:.1f}; rank CPU per step gloo / procgroup / "
                f"without / without all_reduce: {cpus}; "
                f"params identical: {d['identical_params']}) "
                f"| {g * 1e3:.1f} | {p * 1e3:.1f} | {p / g:.3f} |"
            )
    return "\n".join(out) + "\n"


def main() -> int:
    """Command line: --worker runs one rank; otherwise launch every N, --repeat times, and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=1, help="whole runs; the table shows medians over them")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small-iters", type=int, default=300)
    ap.add_argument("--big-iters", type=int, default=3)
    ap.add_argument("--ddp-steps", type=int, default=5)
    ap.add_argument("--small-batch", type=int, default=1)
    ap.add_argument("--big-batch", type=int, default=32)
    ap.add_argument("--no-ddp", action="store_true")
    ap.add_argument(
        "--grad-as-bucket-view",
        type=int,
        default=1,
        help="DDP(gradient_as_bucket_view=...) for both backends (1: gradients live in the buckets, no copies)",
    )
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=("small", "big", "ops", "ddp"),
        default=["small", "big", "ops", "ddp"],
        help="what to measure: 4 B all_reduce, 64 MiB all_reduce, other ops' overhead, DDP steps (N=2)",
    )
    ap.add_argument("--job-timeout", type=float, default=580)
    ap.add_argument("--out", help="also write the table (and .json) here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    runs = [[launch(n, args) for n in args.sizes] for _ in range(args.repeat)]
    merged = []
    for i, n in enumerate(args.sizes):
        per = [r[i] for r in runs]
        med = {k: statistics.median(p["median_s"][k] for p in per) for k in per[0]["median_s"]}
        merged.append(
            {
                "world": n,
                "median_s": med,
                "ddp": per[-1]["ddp"],
                "all_identical": all(d["identical_params"] for p in per for d in p["ddp"].values()),
            }
        )
    load = f"{load0} / " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = table(merged, load)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"load": load, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
