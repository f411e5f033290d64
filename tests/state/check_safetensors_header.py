#!/usr/bin/env python3
"""Reads a full libfsdp checkpoint with the standard library only: the
safetensors headers of model.safetensors and optim.safetensors must parse as
JSON and list the test model's original names, shapes and dtypes, with data
offsets that tile the file."""
import json
import struct
import sys

EXPECTED_MODEL = {
    "fc1.weight": [16, 7], "fc1.bias": [16],
    "block.0.weight": [16, 16], "block.0.bias": [16],
    "block.2.weight": [16], "block.2.bias": [16],
    "block.3.weight": [16, 16], "block.3.bias": [16],
    "head.weight": [3, 16], "head.bias": [3], "scale": [1],
}
SIZES = {"F32": 4, "I64": 8}


def read_header(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, stop = t["data_offsets"]
        numel = 1
        for d in t["shape"]:
            numel *= d
        assert stop - begin == numel * SIZES[t["dtype"]], (path, name)
        end = max(end, stop)
    assert 8 + n + end == len(data), (path, "data does not tile the file")
    return header


def main(d):
    model = read_header(d + "/model.safetensors")
    got = {k: v["shape"] for k, v in model.items() if k != "__metadata__"}
    assert got == EXPECTED_MODEL, got
    assert all(v["dtype"] == "F32" for k, v in model.items() if k != "__metadata__")
    # What Hugging Face's loaders look for.
    assert model.get("__metadata__") == {"format": "pt"}, model.get("__metadata__")
    optim = read_header(d + "/optim.safetensors")
    for name, shape in EXPECTED_MODEL.items():
        for state in ("exp_avg", "exp_avg_sq"):
            t = optim[name + "/" + state]
            assert t["shape"] == shape and t["dtype"] == "F32", (name, state, t)
        step = optim[name + "/step"]
        assert step["shape"] == [] and step["dtype"] == "F32", (name, step)
    print("ok: %d model tensors, %d optimizer tensors" % (len(got), len(optim)))


if __name__ == "__main__":
    main(sys.argv[1])
