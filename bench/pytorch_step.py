#!/usr/bin/env python3
"""PyTorch's side of bench/vs_pytorch.sh: the GPT-mini training step of
bench/bench_step.cpp, in PyTorch (tests/interop/gpt_mini.py), with the same
sizes, AdamW (lr 3e-4) in fp32, one intra-op thread per rank (--threads), a
barrier before every step, each rank its own batch:

  pytorch_step.py step --mode MODE [--nproc N] [--steps 10] [--warmup 2]
                  [--blocks 8] [--d-model 512] [--heads 8] [--seq 128]
                  [--batch 8] [--vocab 256] [--device cpu|cuda]
                  [--precision fp32|bf16]

--device cuda (bench/gpu_step.sh): each rank on its GPU, NCCL, the device
synchronised around every timed phase, peak_device_bytes from
torch.cuda.max_memory_allocated; --precision bf16: FSDP's MixedPrecision
(bf16 parameters, fp32 reduction), autocast for local and ddp.

MODE: local (plain model; at --nproc 2 two independent processes side by side,
the floor), ddp (DistributedDataParallel), fsdp1_full_shard, fsdp1_no_shard
(FullyShardedDataParallel, each block a unit, PyTorch's defaults otherwise),
fsdp2 (fully_shard on each block, then the root). Ranks are spawned here
(torch.multiprocessing, gloo on the CPU); rank 0 prints one JSON line:
median_ms (the slowest rank's median step), slowest_rank_median_ms (median over
steps of each step's slowest rank), forward/backward/optimizer medians, and
peak RSS per rank (getrusage's ru_maxrss, KiB) at the end and before the model
was built (the runtime alone). "malloc" says whether glibc was told to keep
freed memory (MALLOC_MMAP_THRESHOLD_ set, as vs_pytorch.sh does to match
fsdp::keep_freed_cpu_memory()).

Two helpers for vs_pytorch.sh, which import no torch:

  pytorch_step.py rss -- CMD...         runs CMD (one rank under fsdprun) and
      prints {"bench":"rss","rank":R,"peak_rss_kib":K} (its ru_maxrss)
  pytorch_step.py combine FILE NAME ROUND   merges one run's JSON lines (a
      step line and its ranks' rss lines) into one line tagged NAME and ROUND
  pytorch_step.py summary FILE          the summary line over all runs
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = ["local", "ddp", "fsdp1_full_shard", "fsdp1_no_shard", "fsdp2"]


def median(values):
    # The upper median, as bench_util.h's median().
    return sorted(values)[len(values) // 2]


def peak_rss_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def malloc_mode():
    return "kept" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default"


def wrap(model, mode, gpt_mini, device, bf16, cpu_offload=False, checkpointing=False):
    """The model under `mode` on `device`; bf16: compute in bfloat16 with
    fp32 parameters and reduction (FSDP's mixed precision; plain and DDP
    models use autocast in the step instead). For fsdp2 only: cpu_offload,
    CPUOffloadPolicy (the model stays in host memory: fully_shard moves each
    block's shards there); checkpointing, each block under
    checkpoint_wrapper (activation checkpointing)."""
    import torch

    if (cpu_offload or checkpointing) and mode != "fsdp2":
        raise ValueError("--cpu-offload and --activation-checkpointing are for --mode fsdp2")
    if checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.blocks()):
            setattr(model, f"h{i}", checkpoint_wrapper(block))
    if not cpu_offload:
        model = model.to(device)
    if mode == "local":
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model)
    if mode.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        strategy = (ShardingStrategy.FULL_SHARD if mode == "fsdp1_full_shard"
                    else ShardingStrategy.NO_SHARD)
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({gpt_mini.Block}),
                    sharding_strategy=strategy, device_id=device, mixed_precision=mp)
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kw = {}
        if cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        for block in model.blocks():
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model
    raise ValueError(mode)


def worker(rank, args):
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "interop"))
    import gpt_mini

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    bf16 = args.precision == "bf16"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc,
                            timeout=datetime.timedelta(seconds=300))

    def sync():
        if cuda:
            torch.cuda.synchronize()
    world = args.nproc
    rss_base = peak_rss_kib()
    config = gpt_mini.GPTConfig(vocab_size=args.vocab, block_size=args.seq, d_model=args.d_model,
                                n_head=args.heads, n_layer=args.blocks)
    torch.manual_seed(0)
    model = gpt_mini.GPT(config)
    params = sum(p.numel() for p in model.parameters())
    try:
        model = wrap(model, args.mode, gpt_mini, device, bf16, args.cpu_offload,
                     args.activation_checkpointing)
    except Exception as e:  # FSDP2 may not run on the CPU: say so instead of failing
        if rank == 0:
            print(json.dumps({"bench": "pytorch_step", "mode": args.mode, "world": world,
                              "skipped": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        dist.destroy_process_group()
        return
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    torch.manual_seed(1000 + rank)
    data = torch.randint(args.vocab, (args.batch, args.seq + 1))
    inputs, targets = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
    autocast = bf16 and cuda and not args.mode.startswith("fsdp")

    step_ms, fwd_ms, bwd_ms, opt_ms = [], [], [], []
    loss0 = None
    for i in range(-args.warmup, args.steps):
        if i == 0 and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(inputs)
        loss = gpt_mini.lm_loss(logits.float(), targets)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        if loss0 is None:
            loss0 = loss.item()
        if i >= 0:
            step_ms.append((t3 - t0) * 1e3)
            fwd_ms.append((t1 - t0) * 1e3)
            bwd_ms.append((t2 - t1) * 1e3)
            opt_ms.append((t3 - t2) * 1e3)

    def gathered(value):
        out = [None] * world
        dist.all_gather_object(out, value)
        return out

    mine = {"step": step_ms, "fwd": median(fwd_ms), "bwd": median(bwd_ms), "opt": median(opt_ms),
            "rss": peak_rss_kib(), "rss_base": rss_base,
            "peak_device": torch.cuda.max_memory_allocated() if cuda else 0}
    every = gathered(mine)
    if rank == 0:
        slowest = [max(r["step"][s] for r in every) for s in range(args.steps)]
        print(json.dumps({
            "bench": "pytorch_step", "mode": args.mode, "world": world, "blocks": args.blocks,
            "d_model": args.d_model, "seq": args.seq, "batch": args.batch, "params": params,
            "steps": args.steps, "warmup": args.warmup,
            "median_ms": round(max(median(r["step"]) for r in every), 1),
            "slowest_rank_median_ms": round(median(slowest), 1),
            "forward_ms": round(max(r["fwd"] for r in every), 1),
            "backward_ms": round(max(r["bwd"] for r in every), 1),
            "optimizer_ms": round(max(r["opt"] for r in every), 1),
            "peak_rss_kib": [r["rss"] for r in every],
            "base_rss_kib": [r["rss_base"] for r in every],
            "device": str(device), "precision": args.precision, "vocab": args.vocab,
            "peak_device_bytes": max(r["peak_device"] for r in every),
            "loss0": round(loss0, 6), "malloc": malloc_mode(), "torch": torch.__version__,
            "cpu_offload": args.cpu_offload,
            "activation_checkpointing": args.activation_checkpointing,
            "threads": torch.get_num_threads()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_step(argv):
    p = argparse.ArgumentParser(prog="pytorch_step.py step")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: FSDP's mixed precision, autocast for local and ddp (cuda)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="fsdp2: CPUOffloadPolicy (pinned memory on a GPU)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="fsdp2: every block under checkpoint_wrapper")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per rank; 0 keeps torch's default (a host optimizer's "
                        "step under --cpu-offload uses them, as libfsdp's does)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.nproc < 1:
        p.error("--steps and --nproc must be at least 1")
    args.port = free_port()
    import torch.multiprocessing as mp
    # spawn, not fork: every rank a fresh process as under torchrun, so that
    # its peak RSS counts the runtime's pages as a real job's does (a forked
    # child does not count library pages its parent had touched).
    mp.spawn(worker, args=(args,), nprocs=args.nproc, join=True)


def cmd_rss(argv):
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("pytorch_step.py rss: expected a command after --")
    rc = subprocess.call(argv)
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"bench": "rss", "rank": int(os.environ.get("RANK", "0")),
                      "peak_rss_kib": kib}), flush=True)
    sys.exit(rc)


def cmd_combine(argv):
    path, name, rnd = argv
    lines = [json.loads(l) for l in open(path) if l.startswith("{")]
    rss = sorted((l for l in lines if l.get("bench") == "rss"), key=lambda l: l["rank"])
    main = [l for l in lines if l.get("bench") != "rss"]
    if len(main) != 1:
        sys.exit(f"pytorch_step.py combine: {name}: expected one result line, got {len(main)}")
    out = {"config": name, "round": int(rnd), **main[0]}
    if rss:
        out["peak_rss_kib"] = [l["peak_rss_kib"] for l in rss]
    print(json.dumps(out))


def cmd_summary(argv):
    path = argv[0]
    runs = [json.loads(l) for l in open(path)]
    by = {}
    for r in runs:
        if "skipped" not in r:
            by.setdefault(r["config"], {})[r["round"]] = r
    rounds = sorted({r["round"] for r in runs})
    out = {"bench": "vs_pytorch_summary", "rounds": len(rounds)}
    skipped = sorted({r["config"] for r in runs if "skipped" in r})
    if skipped:
        out["skipped"] = skipped

    def rss(r):
        return max(r["peak_rss_kib"])

    # PyTorch as it comes or with libfsdp's malloc settings: the faster, per round.
    def pytorch(mode, rnd):
        cands = [by.get(f"pytorch_{mode}{s}", {}).get(rnd) for s in ("", "_kept_malloc")]
        cands = [c for c in cands if c is not None]
        return min(cands, key=lambda c: c["median_ms"]) if cands else None

    def series(get):
        return [(rnd, get(rnd)) for rnd in rounds if get(rnd) is not None]

    floor = {rnd: r["slowest_rank_median_ms"] for rnd, r in series(
        lambda rnd: by.get("libfsdp_local_2proc", {}).get(rnd))}
    times = {}
    for name in ("libfsdp_local", "libfsdp_no_shard", "libfsdp_full_shard"):
        times[name] = {rnd: r["median_ms"] for rnd, r in series(lambda rnd: by.get(name, {}).get(rnd))}
    for mode in ("local_1proc", "local_2proc", "ddp", "fsdp1_full_shard", "fsdp1_no_shard",
                 "fsdp2"):
        picked = dict(series(lambda rnd: pytorch(mode, rnd)))
        if picked:
            key = f"pytorch_{mode}"
            times[key] = {rnd: r["median_ms"] for rnd, r in picked.items()}
            out[f"{key}_malloc"] = [picked[rnd]["malloc"] for rnd in sorted(picked)]
            if mode == "local_2proc":
                out["pytorch_floor_ms"] = statistics.median(
                    r["slowest_rank_median_ms"] for r in picked.values())
            out[f"{key}_peak_rss_kib"] = statistics.median(rss(r) for r in picked.values())
            out[f"{key}_peak_rss_above_base_kib"] = statistics.median(
                max(a - b for a, b in zip(r["peak_rss_kib"], r["base_rss_kib"]))
                for r in picked.values())
    for name, t in times.items():
        out[f"{name}_ms"] = statistics.median(t.values())
    if floor:
        out["floor_ms"] = statistics.median(floor.values())

    def ratio(key, a, b, target=None):
        per = [a[rnd] / b[rnd] for rnd in rounds if rnd in a and rnd in b]
        if not per:
            return
        out[key] = round(statistics.median(per), 3)
        out[key + "_rounds"] = [round(x, 3) for x in per]
        if target is not None:
            out[key + "_target"] = target
            out[key + "_ok"] = out[key] <= target

    ratio("libfsdp_full_shard_over_floor", times.get("libfsdp_full_shard", {}), floor, 1.05)
    ratio("libfsdp_no_shard_over_floor", times.get("libfsdp_no_shard", {}), floor, 1.05)
    ratio("libfsdp_full_shard_over_pytorch_fsdp1", times.get("libfsdp_full_shard", {}),
          times.get("pytorch_fsdp1_full_shard", {}), 0.75)
    ratio("libfsdp_no_shard_over_pytorch_ddp", times.get("libfsdp_no_shard", {}),
          times.get("pytorch_ddp", {}), 0.95)
    # The floor over PyTorch's steps: the ratios libfsdp would reach if its
    # data-parallel steps cost exactly the floor (no communication at all).
    # Where these exceed the targets above, the targets would need a step
    # faster than two processes that do not communicate.
    ratio("floor_over_pytorch_fsdp1", floor, times.get("pytorch_fsdp1_full_shard", {}))
    ratio("floor_over_pytorch_ddp", floor, times.get("pytorch_ddp", {}))
    ratio("pytorch_fsdp1_full_shard_over_floor", times.get("pytorch_fsdp1_full_shard", {}), floor)
    ratio("pytorch_ddp_over_floor", times.get("pytorch_ddp", {}), floor)
    ratio("pytorch_fsdp2_over_floor", times.get("pytorch_fsdp2", {}), floor)
    ratio("libfsdp_full_shard_over_pytorch_fsdp2", times.get("libfsdp_full_shard", {}),
          times.get("pytorch_fsdp2", {}))
    ratio("libfsdp_local_over_pytorch_local", times.get("libfsdp_local", {}),
          times.get("pytorch_local_1proc", {}))
    # Both sides draw the same initial weights and batches (the same generator
    # and draws in LibTorch and PyTorch), so every first loss must agree: the
    # same model and data on both sides, whatever BLAS rounds differently.
    for side, prefix in (("libfsdp", "libfsdp_"), ("pytorch", "pytorch_")):
        sides = [r for r in runs if r["config"].startswith(prefix)]
        out[f"{side}_torch"] = sorted({r.get("torch", "?") for r in sides})
    out["libfsdp_blas"] = sorted({r["blas"] for r in runs if "blas" in r})
    losses = [r["loss0"] for r in runs if "loss0" in r]
    out["loss0_agrees"] = bool(losses) and max(losses) - min(losses) <= 1e-3 * abs(losses[0])
    # Peak RSS: the larger rank, median over rounds, against FSDP1's faster
    # variant. PyTorch's includes Python and `import torch` (base_rss_kib,
    # about 540 MiB for the CUDA wheel), so its growth above that is given too.
    fs = [rss(r) for r in by.get("libfsdp_full_shard", {}).values()]
    if fs:
        out["libfsdp_full_shard_peak_rss_kib"] = statistics.median(fs)
        if "pytorch_fsdp1_full_shard_peak_rss_kib" in out:
            value = out["libfsdp_full_shard_peak_rss_kib"] / out[
                "pytorch_fsdp1_full_shard_peak_rss_kib"]
            out["libfsdp_full_shard_rss_over_pytorch_fsdp1"] = round(value, 3)
            out["libfsdp_full_shard_rss_over_pytorch_fsdp1_target"] = 1.0
            out["libfsdp_full_shard_rss_over_pytorch_fsdp1_ok"] = value <= 1.0
    print(json.dumps(out))


def main():
    commands = {"step": cmd_step, "rss": cmd_rss, "combine": cmd_combine,
                "summary": cmd_summary}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: pytorch_step.py {{{'|'.join(commands)}}} ... (see the docstring)")
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
