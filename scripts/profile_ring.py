"""Where a rows-sharded (ring) attention call's time goes, on two or more GPUs:
the call's wall time, then a torch.profiler trace of a few calls per rank (GPU
time per kernel, and the host time of the call).  Run on the GPU machine:

    NCCL_NVLS_ENABLE=0 OUT=out [S=65536] [ONLY="causal zigzag,training causal zigzag"] [TRACE=1] \
        python3 scripts/profile_ring.py

Each rank writes OUT/profile_rank<R>.txt; rank 0 prints a short summary (and with TRACE
set writes the chrome trace of its calls, OUT/trace_<case>.json)."""
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import compiler
from compiler.bench_distributed import ATTENTION, CAUSAL, _sequence_part, _timed, _training_step

B, H, D = 1, 16, 128
S = int(os.environ.get("S", 16384))
ONLY = os.environ.get("ONLY")


def _worker(rank, world, store, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    report = []
    for name, src, layout in (("causal zigzag", CAUSAL, "zigzag"), ("causal contiguous", CAUSAL, "contiguous"),
                              ("full contiguous", ATTENTION, "contiguous"),
                              ("training causal zigzag", CAUSAL, "zigzag")):
        if ONLY and name not in ONLY.split(","):
            continue
        program = compiler.compile(src, backend="triton")
        ring = program.shard("m", layout=layout, rows="i")
        ql, kl, vl = (_sequence_part(t, layout, rank, world) for t in (q, k, v))
        if name.startswith("training"):         # forward and backward through autograd
            do = torch.randn_like(q)
            call, _ = _training_step(lambda **t: ring(**t, scale=0.088), {"Q": ql, "K": kl, "V": vl},
                                     _sequence_part(do, layout, rank, world))
            whole = _timed(_training_step(lambda **t: program(**t, scale=0.088), {"Q": q, "K": k, "V": v},
                                          do)[0], device)
        else:
            call = lambda: ring(Q=ql, K=kl, V=vl, scale=0.088)       # noqa: E731
            whole = _timed(lambda: program(Q=q, K=k, V=v, scale=0.088), device)    # the slower rank's
        ms = _timed(call, device)
        torch.cuda.synchronize()
        dist.barrier()
        host = time.perf_counter()
        for _ in range(5):
            call()
        host = (time.perf_counter() - host) / 5 * 1e3            # host time to issue (syncs included)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        if rank == 0 and os.environ.get("TRACE"):        # the timeline of rank 0's calls
            prof.export_chrome_trace(os.path.join(out, f"trace_{name.replace(' ', '_')}.json"))
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60)
        cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60)
        report.append(f"== {name}: whole program on 1 GPU {whole:.3f} ms, ring call {ms:.3f} ms, "
                      f"host issue time {host:.3f} ms per call\n{table}\n{cpu}")
        if rank == 0:
            print(f"{name}: whole {whole:.3f} ms, ring {ms:.3f} ms, host issue {host:.3f} ms", flush=True)
        dist.barrier()
    with open(os.path.join(out, f"profile_rank{rank}.txt"), "w") as f:
        f.write("\n".join(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, tempfile.mktemp(prefix="ring-store-"), out), nprocs=world, join=True)
