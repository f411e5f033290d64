"""Interop between libfsdp and PyTorch on GPT-mini (issue 22), run by ctest:

  test_interop.py CASE --fsdprun FSDPRUN --exe INTEROP_GPT --work DIR

CASE is one of
  checkpoint_to_pytorch  libfsdp trains at 2 ranks (FULL_SHARD) and writes a
                         full checkpoint, an eval batch and its loss; the
                         checkpoint's model.safetensors loads (strict) into the
                         PyTorch mirror (gpt_mini.py) and gives the same loss;
                         its optim.safetensors loads into PyTorch's AdamW.
  pytorch_to_libfsdp     PyTorch's mirror, with every tensor drawn at random,
                         is saved with safetensors in the layout of libfsdp's
                         full checkpoint (write_full_checkpoint below); libfsdp
                         loads it at 2 ranks and gives PyTorch's loss.
  optim_state_names      PyTorch FSDP (FSDP1, CPU, gloo, 2 ranks, AdamW) gives
                         its optim_state_dict; its parameter names, state names,
                         shapes and dtypes equal those of libfsdp's optim.safetensors.
  optimizer_parity       for AdamW, RMSprop (momentum, centred) and Adagrad:
                         libfsdp trains at 2 ranks from its initial checkpoint;
                         PyTorch's optimizer trains the mirror from the same
                         weights on the two ranks' batches concatenated; the
                         weights and every optimizer state in libfsdp's full
                         checkpoint equal PyTorch's, under PyTorch's names.
Exits non-zero with a message naming what differs.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import warnings
import zlib

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_mini  # noqa: E402

# Small enough for seconds per run; the C++ side gets the same values.
CONFIG = gpt_mini.GPTConfig(vocab_size=64, block_size=16, d_model=32, n_head=4, n_layer=2)
STEPS = 3
LOSS_TOLERANCE = 1e-5


def config_args():
    c = CONFIG
    return ["--vocab", str(c.vocab_size), "--block-size", str(c.block_size), "--d-model",
            str(c.d_model), "--heads", str(c.n_head), "--layers", str(c.n_layer), "--steps",
            str(STEPS)]


def fail(message):
    print(f"test_interop: FAIL: {message}", file=sys.stderr)
    sys.exit(1)


# PyTorch's optimizers with the options interop_gpt's make_optimizer gives
# libfsdp's. The attention's key biases get gradients of rounding noise only
# (softmax ignores them), which AdamW and RMSprop with the default eps blow
# up to steps of about lr, of a sign no two orders of sums share: their eps
# is raised above that noise.
PYTORCH_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-6),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, eps=1e-4, momentum=0.9,
                                                  centered=True, weight_decay=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2, lr_decay=0.01,
                                                  weight_decay=0.01,
                                                  initial_accumulator_value=0.1),
}
# Two implementations' fp32 sums in other orders, over STEPS steps. Weights:
# the seeds' tolerance. A state (exp_avg, sum...): relative, plus an absolute
# part scaled by that state's largest value over the model, since a moment's
# values are as small as the squares of the gradients (an absolute tolerance
# of the weights' would pass any of them), and the moments of the key biases'
# noise (below) differ in every element.
WEIGHT_RTOL, WEIGHT_ATOL = 1.3e-6, 1e-5
STATE_RTOL, STATE_ATOL_OF_LARGEST = 1e-4, 1e-5


def run_libfsdp(args, *command):
    cmd = [args.fsdprun, "--nproc-per-node", "2", args.exe, *command, *config_args()]
    print("#", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, env=env, timeout=240)
    if result.returncode != 0:
        fail(f"{' '.join(cmd)} exited with status {result.returncode}")


def read_loss(path):
    with open(path) as f:
        return float(f.read())


def python_loss(model, batch):
    model.eval()
    with torch.no_grad():
        return gpt_mini.lm_loss(model(batch["inputs"]), batch["targets"]).item()


def compare_losses(ours, theirs, what):
    diff = abs(ours - theirs)
    print(f"test_interop: {what}: PyTorch {ours:.9g}, libfsdp {theirs:.9g}, |diff| {diff:.3g}")
    if not diff <= LOSS_TOLERANCE:
        fail(f"{what}: losses differ by {diff:.3g} > {LOSS_TOLERANCE}")


def write_full_checkpoint(directory, state_dict, step=0):
    """Writes `state_dict` as a libfsdp full checkpoint that fsdp::Checkpointer
    loads at any world size: model.safetensors (original names, whole tensors),
    the manifest rank0.json (each file's size and CRC-32, each tensor's key,
    dtype, shape and element range) and the completion marker COMPLETE (the
    manifest's size and CRC-32), as in Note [Checkpoint directory]. No
    optimizer state, RNG state or registered state."""
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    model_file = os.path.join(directory, "model.safetensors")
    save_file(tensors, model_file)
    dtypes = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL",
              torch.uint8: "U8"}

    def record(path):
        with open(path, "rb") as f:
            data = f.read()
        return {"name": os.path.basename(path), "size": len(data), "crc32": zlib.crc32(data)}

    header = {"format": "libfsdp-checkpoint", "version": 1, "world_size": 1, "kind": "full",
              "step": step}
    manifest = dict(header, rank=0, rng_state="", extra={}, scalars={},
                    files=[record(model_file)],
                    tensors=[{"key": "model/" + k, "file": "model.safetensors", "tensor": k,
                              "dtype": dtypes[t.dtype], "shape": list(t.shape), "begin": 0,
                              "end": t.numel()} for k, t in tensors.items()])
    manifest_file = os.path.join(directory, "rank0.json")
    with open(manifest_file, "w") as f:
        json.dump(manifest, f, indent=1)
    # The marker carries the CRC-32 of its own JSON without that field, as
    # libfsdp dumps it (sorted keys, indent 1): Note [Marker checksum].
    marker = dict(header, manifests=[record(manifest_file)])
    marker["crc32"] = zlib.crc32(json.dumps(marker, indent=1, sort_keys=True).encode())
    with open(os.path.join(directory, "COMPLETE"), "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)


def libfsdp_checkpoint(args):
    """Runs libfsdp's training and full save; returns the directory."""
    run_libfsdp(args, "save", args.work)
    return args.work


def case_checkpoint_to_pytorch(args):
    work = libfsdp_checkpoint(args)
    weights = load_file(os.path.join(work, "ckpt", "model.safetensors"))
    model = gpt_mini.GPT(CONFIG)
    expected = set(model.state_dict())
    if set(weights) != expected:
        fail(f"checkpoint keys differ from the mirror's state_dict: only in the checkpoint "
             f"{sorted(set(weights) - expected)}, only in PyTorch {sorted(expected - set(weights))}")
    # Strict: every name, shape and dtype (the bool causal masks too).
    for k, v in model.state_dict().items():
        if weights[k].dtype != v.dtype or weights[k].shape != v.shape:
            fail(f"{k}: checkpoint has {weights[k].dtype} {list(weights[k].shape)}, "
                 f"the mirror {v.dtype} {list(v.shape)}")
    model.load_state_dict(weights, strict=True)
    # The checkpoint must hold trained values, not the initial ones: AdamW moved
    # LayerNorm's weights away from 1.
    if torch.equal(weights["ln_f.weight"], torch.ones_like(weights["ln_f.weight"])):
        fail("ln_f.weight is still all ones: the checkpoint holds untrained weights")
    batch = load_file(os.path.join(work, "batch.safetensors"))
    compare_losses(python_loss(model, batch), read_loss(os.path.join(work, "loss.txt")),
                   f"libfsdp's checkpoint after {STEPS} steps in PyTorch")
    # The optimizer state loads into PyTorch's AdamW as it is (its step is a
    # 0-d float32 tensor, as PyTorch keeps it) and steps on from there.
    optim = load_file(os.path.join(work, "ckpt", "optim.safetensors"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = opt.state_dict()
    saved["state"] = {i: {s: optim[f"{name}/{s}"] for s in ("step", "exp_avg", "exp_avg_sq")}
                      for i, (name, _) in enumerate(model.named_parameters())}
    opt.load_state_dict(saved)
    for name, p in model.named_parameters():
        step = opt.state[p]["step"]
        if step.dtype != torch.float32 or step.dim() != 0 or step.item() != STEPS:
            fail(f"{name}/step: {step.dtype} {list(step.shape)} = {step.tolist()} in PyTorch's "
                 f"AdamW, expected a 0-d float32 {STEPS}")
    model.train()
    opt.zero_grad()
    gpt_mini.lm_loss(model(batch["inputs"]), batch["targets"]).backward()
    opt.step()
    if opt.state[next(model.parameters())]["step"].item() != STEPS + 1:
        fail("PyTorch's AdamW did not step on from libfsdp's optimizer state")


def case_pytorch_to_libfsdp(args):
    torch.manual_seed(3)
    model = gpt_mini.GPT(CONFIG)
    # Every parameter drawn at random (LayerNorm's ones and the zero biases
    # too), so that each one, loaded wrong, changes the loss.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    write_full_checkpoint(os.path.join(args.work, "ckpt"), model.state_dict(), step=5)
    gen = torch.Generator().manual_seed(11)
    data = torch.randint(CONFIG.vocab_size, (3, CONFIG.block_size + 1), generator=gen)
    batch = {"inputs": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}
    batch_file = os.path.join(args.work, "batch.safetensors")
    save_file(batch, batch_file)
    loss_file = os.path.join(args.work, "loss.txt")
    run_libfsdp(args, "load", os.path.join(args.work, "ckpt"), batch_file, loss_file)
    compare_losses(python_loss(model, batch), read_loss(loss_file),
                   "PyTorch's weights in libfsdp (2 ranks, FULL_SHARD)")


def case_optimizer_parity(args):
    for name, make_optimizer in PYTORCH_OPTIMIZERS.items():
        work = os.path.join(args.work, name)
        os.makedirs(work)
        run_libfsdp(args, "save", work, "--optim", name)
        model = gpt_mini.GPT(CONFIG)
        model.load_state_dict(load_file(os.path.join(work, "init", "model.safetensors")),
                              strict=True)
        opt = make_optimizer(model.parameters())
        ranks = [load_file(os.path.join(work, f"data_rank{r}.safetensors")) for r in range(2)]
        model.train()
        for step in range(STEPS):
            data = torch.cat([batches[f"step{step}"] for batches in ranks])
            opt.zero_grad()
            gpt_mini.lm_loss(model(data[:, :-1]), data[:, 1:]).backward()
            opt.step()
        weights = load_file(os.path.join(work, "ckpt", "model.safetensors"))
        ours = load_file(os.path.join(work, "ckpt", "optim.safetensors"))
        problems, theirs = [], {}
        for fqn, p in model.named_parameters():
            theirs[fqn] = p.detach()
            for state, value in opt.state[p].items():
                theirs[f"{fqn}/{state}"] = value if torch.is_tensor(value) else torch.tensor(value)
        if set(ours) != set(theirs) - {fqn for fqn, _ in model.named_parameters()}:
            problems.append(f"optimizer state names differ: only libfsdp "
                            f"{sorted(set(ours) - set(theirs))}, only PyTorch "
                            f"{sorted(set(theirs) - set(ours) - set(weights))}")
        largest = {}
        for key, expected in theirs.items():
            kind = key.rsplit("/", 1)[1] if key in ours else "weight"
            largest[kind] = max(largest.get(kind, 0.0), expected.float().abs().max().item())
        worst = {}
        for key, expected in theirs.items():
            got = ours.get(key, weights.get(key))
            if got is None:
                continue
            if got.dtype != expected.dtype or got.shape != expected.shape:
                problems.append(f"{key}: libfsdp {got.dtype} {list(got.shape)}, PyTorch "
                                f"{expected.dtype} {list(expected.shape)}")
                continue
            kind = key.rsplit("/", 1)[1] if key in ours else "weight"
            rtol, atol = ((WEIGHT_RTOL, WEIGHT_ATOL) if kind == "weight" else
                          (STATE_RTOL, STATE_ATOL_OF_LARGEST * largest[kind]))
            diff = (got.float() - expected.float()).abs()
            # How much of its tolerance each tensor uses (1: all of it).
            used = (diff / (atol + rtol * expected.float().abs())).max().item()
            worst[kind] = max(worst.get(kind, 0.0), used)
            if not used <= 1.0:
                problems.append(f"{key}: differs by up to {diff.max().item():.3g} "
                                f"(rtol {rtol:.3g}, atol {atol:.3g})")
        print(f"test_interop: {name}: {len(theirs)} tensors compared; of its tolerance each "
              f"kind used at most " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
        if problems:
            fail(f"{name}: libfsdp's checkpoint after {STEPS} steps is not PyTorch's "
                 f"{type(opt).__name__} on the concatenated batches:\n  " + "\n  ".join(problems))


def fsdp_worker(rank, world, port, out):
    """One rank of PyTorch FSDP1 on the CPU: AdamW steps, then optim_state_dict."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore", category=UserWarning)  # FSDP1's deprecation notices
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A stuck collective fails the rank (and the test) instead of hanging it.
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = FSDP(gpt_mini.GPT(CONFIG), auto_wrap_policy=ModuleWrapPolicy({gpt_mini.Block}),
                 device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    for _ in range(STEPS):
        data = torch.randint(CONFIG.vocab_size, (4, CONFIG.block_size + 1))
        opt.zero_grad()
        gpt_mini.lm_loss(model(data[:, :-1]), data[:, 1:]).backward()
        opt.step()
    osd = FSDP.optim_state_dict(model, opt)
    msd = model.state_dict()
    if rank == 0:
        def describe(v):
            if torch.is_tensor(v):
                return {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
            return {"python": type(v).__name__}

        summary = {
            "top_level": sorted(osd),
            "state": {fqn: {k: describe(v) for k, v in s.items()} for fqn, s in osd["state"].items()},
            "param_groups": [{k: (v if k == "params" else type(v).__name__) for k, v in g.items()}
                             for g in osd["param_groups"]],
            "model": {k: describe(v) for k, v in msd.items()},
        }
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_optim_state_names(args):
    work = libfsdp_checkpoint(args)
    out = os.path.join(work, "pytorch_fsdp.json")
    torch.multiprocessing.spawn(fsdp_worker, args=(2, free_port(), out), nprocs=2, join=True)
    with open(out) as f:
        theirs = json.load(f)
    ours_optim = load_file(os.path.join(work, "ckpt", "optim.safetensors"))
    ours_model = load_file(os.path.join(work, "ckpt", "model.safetensors"))

    def describe(t):
        return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}

    # libfsdp: "<fqn>/<state>" -> PyTorch's nesting state[fqn][state].
    ours = {}
    for key, t in ours_optim.items():
        fqn, name = key.rsplit("/", 1)
        ours.setdefault(fqn, {})[name] = describe(t)
    problems = []
    if set(ours) != set(theirs["state"]):
        problems.append(f"parameters with optimizer state differ: only libfsdp "
                        f"{sorted(set(ours) - set(theirs['state']))}, only PyTorch "
                        f"{sorted(set(theirs['state']) - set(ours))}")
    for fqn in sorted(set(ours) & set(theirs["state"])):
        a, b = ours[fqn], theirs["state"][fqn]
        if set(a) != set(b):
            problems.append(f"{fqn}: libfsdp states {sorted(a)}, PyTorch {sorted(b)}")
            continue
        for name in sorted(a):
            if a[name]["shape"] != b[name].get("shape"):
                problems.append(f"{fqn}/{name}: libfsdp shape {a[name]['shape']}, PyTorch "
                                f"{b[name].get('shape')}")
            elif a[name]["dtype"] != b[name].get("dtype"):
                problems.append(f"{fqn}/{name}: libfsdp dtype {a[name]['dtype']}, PyTorch "
                                f"{b[name].get('dtype')}")
    # The model's state dict names too (FSDP.state_dict gives the original names).
    if set(ours_model) != set(theirs["model"]):
        problems.append(f"model state dict names differ: only libfsdp "
                        f"{sorted(set(ours_model) - set(theirs['model']))}, only PyTorch "
                        f"{sorted(set(theirs['model']) - set(ours_model))}")
    print(f"test_interop: PyTorch optim_state_dict: top level {theirs['top_level']}, "
          f"{len(theirs['state'])} parameters with state, {len(theirs['param_groups'])} param "
          f"group(s) with {sorted(k for k in theirs['param_groups'][0] if k != 'params')}")
    print(f"test_interop: libfsdp optim.safetensors: {len(ours)} parameters, states "
          f"{sorted({n for s in ours.values() for n in s})}; no param_groups "
          f"(hyperparameters come from the program)")
    if problems:
        fail("libfsdp's optimizer state does not match PyTorch FSDP's optim_state_dict:\n  "
             + "\n  ".join(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["checkpoint_to_pytorch", "pytorch_to_libfsdp",
                                         "optim_state_names", "optimizer_parity"])
    parser.add_argument("--fsdprun", required=True)
    parser.add_argument("--exe", required=True, help="build/bin/interop_gpt")
    parser.add_argument("--work", required=True, help="scratch directory (emptied first)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    globals()["case_" + args.case](args)
    print(f"test_interop: {args.case}: OK")


if __name__ == "__main__":
    main()
