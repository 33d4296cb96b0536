#!/usr/bin/env python3
"""A simulated fleet's samples and lease events for the rollup benchmark, seeded.

    gen_fleet.py N_SAMPLES LEASES_JSONL > samples.jsonl

512 GPUs (64 hosts x 8, four models) sampled every 5 s until N samples are written, so 20M
samples cover about 54 hours. Pairs of GPUs are leased back to back to six teams for 30 min to
6 h, some resized down to one GPU half way, the last lease of a pair left running; half the
leases' samples name their lease_id. Leased GPUs are busy or idle, unleased ones mostly idle
with a few busy (unattributed use). 0.5 % of samples are sent twice.
"""
import random
import sys

GPUS = 512
INTERVAL = 5000
T0 = 1795996800000  # 2026-11-30T00:00:00Z
MODELS = [("NVIDIA H100 80GB HBM3", 85520809984, 700.0), ("NVIDIA A100-SXM4-80GB", 85899345920, 400.0),
          ("NVIDIA L40S", 48305799168, 350.0), ("Tesla T4", 16106127360, 70.0)]
TEAMS = ["research", "ml-platform", "search", "ads", "vision", "speech"]


def gpu_uuid(g):
    return f"GPU-{g:08x}-0000-4000-8000-{g:012x}"


def leases(rng, end_ms, out):
    """Writes lease events; returns per GPU a sorted list of (start, end, lease_id, named, busy)."""
    held = {g: [] for g in range(GPUS)}
    n = 0
    for pair in range(GPUS // 2):
        gpus = [pair * 2, pair * 2 + 1]
        model = MODELS[(pair * 2 // 8) % 4][0]
        t = T0 + rng.randrange(0, 3_600_000)
        while t < end_ms:
            n += 1
            lease = f"lease-{n:06d}"
            team = rng.choice(TEAMS)
            duration = rng.randrange(1_800_000, 6 * 3_600_000)
            release = t + duration
            running = release >= end_ms
            common = (f'"lease_id":"{lease}","team":"{team}","user":"user-{n % 40}","project":"proj-{n % 12}",'
                      f'"workload":"training","substrate":"sim","gpu_model":"{model}"')
            ids = ",".join(f'"{gpu_uuid(g)}"' for g in gpus)
            out.write(f'{{"v":1,"ts_ms":{t},"event":"granted",{common},"gpu_count":2,"gpu_uuids":[{ids}]}}\n')
            named, busy = rng.random() < 0.5, rng.random() < 0.7
            if rng.random() < 0.2 and not running:
                mid = t + duration // 2
                out.write(f'{{"v":1,"ts_ms":{mid},"event":"resized",{common},"gpu_count":1,'
                          f'"gpu_uuids":["{gpu_uuid(gpus[0])}"]}}\n')
                held[gpus[0]].append((t, release, lease, named, busy))
                held[gpus[1]].append((t, mid, lease, named, busy))
            else:
                for g in gpus:
                    held[g].append((t, release if not running else 1 << 62, lease, named, busy))
            if running:
                break
            out.write(f'{{"v":1,"ts_ms":{release},"event":"released",{common},"gpu_count":2,'
                      f'"gpu_uuids":[],"reason":"user"}}\n')
            t = release + rng.randrange(0, 3_600_000)
    return held


def main():
    n, leases_path = int(sys.argv[1]), sys.argv[2]
    rng = random.Random(7)
    steps = -(-n // GPUS)
    end_ms = T0 + steps * INTERVAL
    with open(leases_path, "w") as out:
        held = leases(rng, end_ms, out)
    cursor = {g: 0 for g in range(GPUS)}
    write = sys.stdout.write
    written = 0
    for step in range(1, steps + 1):
        ts = T0 + step * INTERVAL
        for g in range(GPUS):
            if written >= n:
                return
            spans = held[g]
            i = cursor[g]
            while i < len(spans) and spans[i][1] <= ts:
                i += 1
            cursor[g] = i
            lease = spans[i] if i < len(spans) and spans[i][0] <= ts else None
            if lease is not None:
                util = rng.uniform(40, 100) if lease[4] else rng.uniform(0, 3)
            else:
                util = rng.uniform(50, 100) if g % 37 == 0 else 0.0
            model, total, limit = MODELS[(g // 8) % 4]
            named = f'"{lease[2]}"' if lease is not None and lease[3] else "null"
            line = (f'{{"v":1,"ts_ms":{ts},"interval_ms":{INTERVAL},"host":"node-{g // 8:03d}",'
                    f'"gpu_uuid":"{gpu_uuid(g)}","gpu_model":"{model}","util_gpu_pct":{util:.2f},'
                    f'"mem_used_bytes":{int(total * util / 120)},"mem_total_bytes":{total},'
                    f'"power_w":{limit * (0.1 + 0.85 * util / 100):.3f},"lease_id":{named}}}\n')
            write(line)
            written += 1
            if rng.random() < 0.005:
                write(line)


if __name__ == "__main__":
    main()
