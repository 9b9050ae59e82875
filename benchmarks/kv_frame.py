"""The cost of sending a TP engine's KV shards as one stream (hetmesh.engines.vllm_engine.frame).

At TP 1 the one shard file is mapped and sent as it lies; at TP > 1 the shards are joined (one copy) into
the frame. This times frame() on spool files in /dev/shm of the KV sizes the vLLM KV benchmark moves and
compares the join's rate with this machine's raw loopback TCP rate (the transfer it precedes), same run.

    python benchmarks/kv_frame.py [--mb 8 32 128] [--tp 1 2 4 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from loadgen import raw_tcp_mb_per_s
from rich.console import Console
from rich.table import Table

from hetmesh.engines.vllm_engine import frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/kv_frame.json")
    args = ap.parse_args()
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    rows = []
    with tempfile.TemporaryDirectory(dir=root) as d:
        for mb in args.mb:
            for tp in args.tp:
                shards = []
                for r in range(tp):
                    p = Path(d) / f"kv.rank{r}"
                    p.write_bytes(os.urandom(mb * (1 << 20) // tp))
                    shards.append(str(p))
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    data = frame(shards)
                    bytes(memoryview(data)[-1:])  # touch: a mapped shard is read when sent, not here
                    times.append(time.perf_counter() - t0)
                    del data
                rows.append({"mb": mb, "tp": tp, "frame_ms_p50": statistics.median(times) * 1e3,
                             "frame_mb_per_s": mb * (1 << 20) / 1e6 / statistics.median(times)})
    tcp = raw_tcp_mb_per_s(sorted({r["mb"] * (1 << 20) for r in rows}), args.repeats, keep=True)
    t = Table(title="Framing a TP engine's KV shards into one stream vs raw loopback TCP (same run)")
    for c in ("KV MB", "TP", "frame ms p50", "frame MB/s", "raw TCP MB/s", "frame time / TCP time"):
        t.add_column(c, justify="right")
    for r in rows:
        r["tcp_mb_per_s"] = tcp[r["mb"] * (1 << 20)]
        r["frame_share_of_tcp_time"] = r["tcp_mb_per_s"] / r["frame_mb_per_s"]
        t.add_row(str(r["mb"]), str(r["tp"]), f"{r['frame_ms_p50']:.2f}", f"{r['frame_mb_per_s']:.0f}",
                  f"{r['tcp_mb_per_s']:.0f}", f"{r['frame_share_of_tcp_time'] * 100:.1f}%")
    Console(width=140).print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                         "python": platform.python_version(),
                                                         "device": "CPU (no GPU)"},
                               "config": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
