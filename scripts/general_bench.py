"""`einfold bench --group general`, one case per subprocess with a time limit, for the
device machine's per-call limit: a case that compiles or tunes past --limit becomes a
row that says so, and no case starts after --deadline seconds (run the rest in a
second call with --skip).  Rows go to $OUT/general.jsonl as each case ends; the table
of every row in that file is printed last.

    python3 scripts/general_bench.py [--quick] [--limit S] [--deadline S] [--case TEXT ...] [--skip TEXT ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path


def compile_(src, **options):
    import compiler
    return compiler.compile(src, backend="triton", **options)


def one(name: str, quick: bool) -> None:
    from compiler import bench, bench_general
    case = next(c for c in bench_general.general_cases(compile_, quick) if c.name == name)
    for row in bench.run_case(case):
        print("ROW " + json.dumps(asdict(row)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--deadline", type=int, default=480)
    ap.add_argument("--case", action="append", default=[])
    ap.add_argument("--skip", action="append", default=[])
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        one(args.one, args.quick)
        return
    import torch
    import triton

    from compiler import bench, bench_general
    out = Path(os.environ.get("OUT", "gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "general.jsonl"
    names = [c.name for c in bench_general.general_cases(compile_, args.quick)]
    names = [n for n in names if (not args.case or any(t in n for t in args.case))
             and not any(t in n for t in args.skip)]
    start = time.time()
    for name in names:
        if time.time() - start > args.deadline:
            print(f"  not started (deadline): {name}", flush=True)
            continue
        began = time.time()
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name] + (["--quick"] if args.quick else []),
                                  capture_output=True, text=True, timeout=args.limit)
            rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if not rows:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
                rows = [asdict(bench.Row("general", name, "einfold", float("nan"), float("nan"), "",
                                         note=f"CASE FAILED: {tail}"))]
        except subprocess.TimeoutExpired:
            rows = [asdict(bench.Row("general", name, "einfold", float("nan"), float("nan"), "",
                                     note=f"CASE PAST {args.limit} s (compile, tuning or a baseline)"))]
        with open(log, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"  done {name} in {time.time() - began:.0f} s", flush=True)
    rows = [bench.Row(**json.loads(line)) for line in log.read_text().splitlines()]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_GBps": bench.copy_bandwidth()}
    print(bench.format_table(rows, meta))


if __name__ == "__main__":
    main()
