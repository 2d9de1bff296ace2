"""Numbers for issue 3's closing note (a script, not a test; timings vary by machine).

    .venv/bin/python -m tests.store.measure_store [--heads 1000] [--classes 100] [--dir DIR]

Prints: registration time per head (p50/p90 over --heads registrations of --classes-class heads
into one store, fsyncs included), resident bytes per head against its weight bytes (tracemalloc
over many resident heads), cold-load time of one head (first `get` in a fresh HeadStore, TF
already imported), hot `get` time, and bytes on disk per head.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from store import HeadStore
from tests.support.heads import random_head


def pct(values, q):
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--dir", default=None, help="where to create the store (default: tmp)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="measure-store-", dir=args.dir))
    try:
        heads = [random_head(args.classes, seed=i)[:2] for i in range(min(args.heads, 50))]
        labels = [f"label {i}" for i in range(args.classes)]
        with HeadStore(base / "warmup") as s:  # imports TensorFlow, opens SQLite once
            s.register("warmup", *heads[0], labels)

        root = base / "store"
        times = []
        with HeadStore(root) as s:
            for i in range(args.heads):
                w, b = heads[i % len(heads)]
                start = time.perf_counter()
                s.register(f"bot{i:05d}", w, b, labels)
                times.append(time.perf_counter() - start)
        print(f"registration of {args.heads} heads x {args.classes} classes: "
              f"p50 {pct(times, 50):.2f} ms, p90 {pct(times, 90):.2f} ms, "
              f"max {pct(times, 100):.2f} ms, total {sum(times):.1f} s")

        disk = sum(f.stat().st_size for f in (root / "heads" / "bot00000" / "v1").iterdir())
        weight_bytes = heads[0][0].nbytes + heads[0][1].nbytes
        print(f"on disk per head: {disk} bytes (weights+biases {weight_bytes})")

        n_cold = min(200, args.heads)
        with HeadStore(root) as s:
            s.exists("bot00000")  # open the registry connection outside the timings
            cold = []
            for i in range(n_cold):
                start = time.perf_counter()
                s.get(f"bot{i:05d}")
                cold.append(time.perf_counter() - start)
            hot = []
            for i in range(10000):
                start = time.perf_counter()
                s.get(f"bot{i % n_cold:05d}")
                hot.append(time.perf_counter() - start)
        print(f"cold load of one head (first get, sha256-verified, {n_cold} heads): "
              f"p50 {pct(cold, 50):.2f} ms, p90 {pct(cold, 90):.2f} ms")
        print(f"hot get (resident): p50 {pct(hot, 50) * 1e3:.1f} us, "
              f"p99 {pct(hot, 99) * 1e3:.1f} us")

        n_mem = min(300, args.heads)
        with HeadStore(root, heads_memory_mb=10_000) as s:
            s.exists("bot00000")
            s.get("bot00000")  # first-use allocations (TF reader, caches) outside the count
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            resident = [s.get(f"bot{i:05d}") for i in range(1, n_mem)]
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            per_head = (after - before) / len(resident)
            weight_bytes = resident[0].weights.nbytes + resident[0].biases.nbytes
            stats = s.cache_stats()
        print(f"resident bytes per head (tracemalloc over {len(resident)} heads): "
              f"{per_head:,.0f}; weight bytes {weight_bytes:,} "
              f"(ratio {per_head / weight_bytes:.3f}); cache accounting "
              f"{stats['resident_bytes'] / stats['resident_heads']:,.0f} per head")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
