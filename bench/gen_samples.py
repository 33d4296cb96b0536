#!/usr/bin/env python3
"""Writes N Sample records (v1, docs/src/contributors/records.md#sample) as JSON lines: a fleet of GPUs
sampled every 5 s, seeded, with the optional fields filled as NVML would. Used by the ingest
benchmark.

    gen_samples.py N PATH [--shuffle]

Records come in time order, as a collector's stream would; --shuffle writes the same records in
a random order (seeded, so every run writes the same file), as a backfill export may be ordered
by anything but time."""
import json
import random
import sys

def records(n):
    rng = random.Random(42)
    gpus = 2000
    models = [("NVIDIA H100 80GB HBM3", 85520809984, 700.0), ("NVIDIA A100-SXM4-80GB", 85899345920, 400.0),
              ("NVIDIA L40S", 48305799168, 350.0), ("Tesla T4", 16106127360, 70.0)]
    t0 = 1767225600000
    for i in range(n):
        g = i % gpus
        model, total, limit = models[g % 4]
        util = rng.choice([0.0, 0.0, rng.uniform(0, 100), rng.uniform(80, 100)])
        rec = {
            "v": 1, "ts_ms": t0 + (i // gpus) * 5000, "interval_ms": 5000,
            "host": f"node-{g // 8:04d}", "gpu_uuid": f"GPU-{g:08x}-0000-4000-8000-{g:012x}",
            "gpu_model": model, "util_gpu_pct": round(util, 2),
            "mem_used_bytes": int(total * util / 120), "mem_total_bytes": total,
            "gpu_index": g % 8, "pci_bus_id": f"00000000:{0x17 + (g % 8) * 16:02X}:00.0",
            "util_mem_pct": round(util / 2, 2), "power_w": round(limit * (0.1 + 0.85 * util / 100), 3),
            "power_limit_w": limit, "energy_mj": 1000000 + i * 17, "temp_c": round(30 + util / 2, 1),
            "sm_clock_mhz": 1980 if util > 5 else 345, "process_count": 1 if util > 0 else 0,
            "lease_id": f"l-{g // 4:05d}" if util > 0 else None, "mig_profile": None, "labels": None,
        }
        yield json.dumps(rec, separators=(",", ":"))

def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shuffle = "--shuffle" in sys.argv[1:]
    n, path = int(args[0]), args[1]
    with open(path, "w") as out:
        if shuffle:
            lines = list(records(n))
            random.Random(7).shuffle(lines)
            for line in lines:
                out.write(line)
                out.write("\n")
        else:
            for line in records(n):
                out.write(line)
                out.write("\n")

if __name__ == "__main__":
    main()
