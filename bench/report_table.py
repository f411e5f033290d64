#!/usr/bin/env python3
"""Turns bench_step's JSON lines into bench/report.sh's Markdown table and
the data file its gnuplot chart reads.

    report_table.py STEP_REPORT.jsonl OUT_DIR
"""
import datetime
import json
import os
import platform
import sys

MODES = ["local", "no_shard", "shard_grad_op", "full_shard"]
NAMES = {"local": "local (no FSDP)", "no_shard": "NO_SHARD", "shard_grad_op": "SHARD_GRAD_OP",
         "full_shard": "FULL_SHARD"}
MIB = 1024.0 * 1024.0


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(path, out_dir):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if r.get("bench") == "step"]
    if not rows:
        sys.exit("report_table.py: no bench_step results in " + path)
    worlds = sorted({r["world"] for r in rows})
    by = {(r["mode"], r["world"]): r for r in rows}
    first = rows[0]

    lines = []
    lines.append("GPT-mini training step: %d blocks, d_model %d, seq %d, batch %d per rank, "
                 "%.1f M parameters, AdamW, fp32, one thread per rank; median of %d steps "
                 "(slowest rank); peak memory is libfsdp's tracked CPU tensor bytes, the "
                 "largest rank's. %s, %d cores, %s; 15-minute load average %.1f when the "
                 "report was written (other processes share the cores, so compare rows of one "
                 "report only)." %
                 (first["blocks"], first["d_model"], first["seq"], first["batch"],
                  by.get(("local", worlds[0]), first)["params"] / 1e6, first["steps"],
                  cpu_model(), os.cpu_count() or 0,
                  datetime.date.today().isoformat(), os.getloadavg()[2]))
    lines.append("")
    lines.append("| mode | ranks | step (ms) | forward | backward | optimizer | vs local "
                 "| peak memory / rank (MiB) | params+grads+AdamW / rank (MiB) |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in worlds:
        local = by.get(("local", world))
        for mode in MODES:
            r = by.get((mode, world))
            if r is None:
                continue
            ratio = "%.2fx" % (r["median_ms"] / local["median_ms"]) if local else "-"
            lines.append("| %s | %d | %.1f | %.1f | %.1f | %.1f | %s | %.1f | %.1f |" %
                         (NAMES[mode], world, r["median_ms"], r["forward_ms"], r["backward_ms"],
                          r["optimizer_ms"], ratio, r["peak_bytes"] / MIB,
                          r["state_bytes"] / MIB))
    lines.append("")
    lines.append("`local` at N ranks is N independent unsharded runs side by side (no "
                 "communication): the cost of N busy processes on this machine by itself.")
    with open(os.path.join(out_dir, "step_report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    # gnuplot data: one row per mode; per world a step-time and a memory column.
    with open(os.path.join(out_dir, "step_report.dat"), "w") as f:
        f.write("# mode " + " ".join("ms_%d mib_%d" % (w, w) for w in worlds) + "\n")
        for mode in MODES:
            cells = []
            for w in worlds:
                r = by.get((mode, w))
                cells += ["%.2f" % r["median_ms"], "%.2f" % (r["peak_bytes"] / MIB)] if r else ["NaN", "NaN"]
            f.write('"%s" %s\n' % (NAMES[mode].replace(" (no FSDP)", ""), " ".join(cells)))
    with open(os.path.join(out_dir, "step_report.worlds"), "w") as f:
        f.write(" ".join(str(w) for w in worlds) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
