"""`einfold bench --group distributed`: a reduction sharded over the GPUs of one
host (`Program.shard`; for prefill also with the queries sharded and K/V
passed around a ring, `rows="i"`) against one GPU running the whole problem,
and against PyTorch's context-parallel SDPA where this torch has it, in one run.

One process per GPU (NCCL).  Every contender runs the same number of times on
every rank (a collective inside would otherwise wait forever); its time is the
mean wall time per call after warm-up, the slowest rank's.  Ours is checked
against the whole program on one GPU before timing.  Results: a table per case
on stdout as each case ends, and OUT/bench_distributed.json.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import platform
import tempfile
import time
from pathlib import Path

import torch

ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
WARMUP, CALLS = 3, 10


def _timed(fn, device) -> float:
    """Mean ms per call on this rank, after warm-up; the slowest rank's."""
    import torch.distributed as dist
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - start) / CALLS * 1e3], device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _cases(quick: bool):
    """(name, source, shape (b, h, queries, keys, d), causal, backward)"""
    s = 8192 if quick else 16384
    long_kv = 65536 if quick else 131072
    return [(f"prefill S={s}", ATTENTION, (1, 16, s, s, 128), False, False),
            (f"prefill causal S={s}", CAUSAL, (1, 16, s, s, 128), True, False),
            (f"causal backward S={s}", CAUSAL, (1, 16, s, s, 128), True, True),
            (f"decode L={long_kv}", ATTENTION, (4, 32, 1, long_kv, 128), False, False)]


def _sequence_part(t: torch.Tensor, layout: str, rank: int, world: int) -> torch.Tensor:
    """This rank's part of dimension 2 (the sequence) of `t` in `layout` (zigzag: parts
    rank and 2W - 1 - rank of 2W)."""
    n = t.shape[2]
    if layout == "contiguous":
        part = n // world
        return t[:, :, rank * part:(rank + 1) * part if rank < world - 1 else n]
    halves = n // (2 * world)
    late = 2 * world - 1 - rank
    return torch.cat([t[:, :, rank * halves:(rank + 1) * halves], t[:, :, late * halves:(late + 1) * halves]], 2)


def _sdpa_backward(q, k, v, do, causal: bool):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def _context_parallel(q, k, v, causal: bool, world: int):
    """PyTorch's context parallelism (ring SDPA over Q, K, V sharded on the sequence),
    or the reason it cannot run this case."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    if q.shape[2] % (2 * world):
        raise ValueError(f"{q.shape[2]} queries do not shard over {world} ranks")
    from torch.distributed.tensor.experimental import _attention
    _attention._cp_options.enable_load_balance = causal     # its default (on) refuses a non-causal SDPA
    mesh = init_device_mesh("cuda", (world,))
    q, k, v = q.clone(), k.clone(), v.clone()
    context = context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])
    context.__enter__()
    return (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)), context


def _worker(rank: int, world: int, store: str, quick: bool, out: str, only: list[str] | None) -> None:
    import torch.distributed as dist

    import compiler
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1` shows where a slow rank is
    began = time.perf_counter()

    def progress(step: str) -> None:
        if rank == 0:
            print(f"  [{time.perf_counter() - began:6.1f} s] {step}", flush=True)

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=device)
    rows = []
    for name, source, (b, h, s, n, d), causal, backward in _cases(quick):
        if only and not any(text in name for text in only):
            continue
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=g)
        scale = d ** -0.5
        lo = rank * (n // world)
        local = {layout: tuple(_sequence_part(t, layout, rank, world) for t in (k, v))
                 for layout in ("contiguous", "zigzag")}
        progress(f"{name}: the whole program")
        program = compiler.compile(source, backend="triton")
        extra = {}                  # the backward's inputs besides Q, K, V, scale: dO, O and the row logsumexp
        if backward:
            do = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
            o, lse = program._saving(Q=q, K=k, V=v, scale=scale)
            extra = {"dO": do, "O": o, "lse_O": lse}
            program = compiler.compile(compiler.grad(source, saved=True).text, backend="triton")
        whole = program(Q=q, K=k, V=v, scale=scale, **extra)
        whole = whole if isinstance(whole, tuple) else (whole,)
        layouts = ("contiguous", "zigzag") if causal and n % (2 * world) == 0 else ("contiguous",)
        sharded = {layout: program.shard("m", layout=layout) for layout in layouts}
        contenders = {"einfold, 1 GPU": lambda: program(Q=q, K=k, V=v, scale=scale, **extra)}
        error = {}
        for layout, sp in sharded.items():
            progress(f"{name}: sharded, {layout}")
            kl, vl = local[layout]
            got = sp(Q=q, K=kl, V=vl, scale=scale, **extra)
            got = got if isinstance(got, tuple) else (got,)
            # replicated outputs only (dQ of the backward; dK and dV come out sharded)
            error[layout] = max(float((a.float() - w.float()).norm() / w.float().norm())
                                for a, w in zip(got, whole) if a.shape == w.shape)
            contenders[f"einfold, K/V {layout} over {world} GPUs"] = \
                lambda sp=sp, kl=kl, vl=vl: sp(Q=q, K=kl, V=vl, scale=scale, **extra)
        if not backward and s == n:       # prefill: the queries sharded too, K/V around a ring
            for layout in layouts:
                ring = program.shard("m", layout=layout, rows="i")
                ql, (kl, vl) = _sequence_part(q, layout, rank, world), local[layout]
                progress(f"{name}: ring, {layout}")
                got = ring(Q=ql, K=kl, V=vl, scale=scale)
                want = _sequence_part(whole[0], layout, rank, world).float()
                error[f"ring {layout}"] = float((got.float() - want).norm() / want.norm())
                contenders[f"einfold, Q, K/V {layout} ring over {world} GPUs"] = \
                    lambda ring=ring, ql=ql, kl=kl, vl=vl: ring(Q=ql, K=kl, V=vl, scale=scale)
        plan = sharded["contiguous"].plan(Q=q, K=local["contiguous"][0], V=local["contiguous"][1], scale=scale,
                                          **extra)
        contenders["SDPA, 1 GPU"] = (_sdpa_backward(q, k, v, extra.get("dO"), causal) if backward else
                                     lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                              is_causal=causal))
        timings, notes, context = {}, {}, None
        for label, fn in contenders.items():
            progress(f"{name}: timing {label}")
            timings[label] = _timed(fn, device)
        try:
            if backward:
                raise ValueError("its backward is not measured here")
            fn, context = _context_parallel(q, k, v, causal, world)
            timings[f"torch context_parallel SDPA, {world} GPUs"] = _timed(fn, device)
        except Exception as e:                       # a torch without it, or a shape it refuses
            notes[f"torch context_parallel SDPA, {world} GPUs"] = f"unavailable: {type(e).__name__}: {e}"[:120]
        finally:
            if context is not None:
                context.__exit__(None, None, None)
        flops = 4 * b * h * s * n * d / (2 if causal else 1) * (2.5 if backward else 1)
        contiguous = sharded["contiguous"]
        local_inputs = {"Q": q, "K": local["contiguous"][0], "V": local["contiguous"][1], "scale": scale, **extra,
                        contiguous.sharded.start: float(lo), contiguous.sharded.total: float(n)}
        found = contiguous.local._run({k_: v_ for k_, v_ in local_inputs.items() if k_ in contiguous._local_inputs})
        state_bytes = sum(t.numel() * 4 for t in (found if isinstance(found, tuple) else (found,)))
        rows.append({"case": name, "timings_ms": timings, "notes": notes, "rel_error_vs_whole": error,
                     "tflops": flops / 1e12, "state_bytes_per_rank": state_bytes,
                     "bytes_received_per_rank": state_bytes * (world - 1), "exchange": plan.exchange})
        torch.cuda.empty_cache()
        if rank == 0:       # after every case: a run cut short keeps what it measured
            meta = {"device": torch.cuda.get_device_name(), "gpus": world, "torch": torch.__version__,
                    "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                    "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "bench_distributed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            print(format_table(rows[-1:], meta), flush=True)
    dist.destroy_process_group()


def format_table(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['gpus']} x {meta['device']}, torch {meta['torch']}, {meta['date']}",
             f"{'case':<24} {'contender':<42} {'ms':>9} {'TFLOP/s':>8} {'1 GPU / this':>12}"]
    for r in rows:
        one = r["timings_ms"].get("einfold, 1 GPU")
        for label, ms in r["timings_ms"].items():
            lines.append(f"{r['case']:<24} {label:<42} {ms:9.3f} {r['tflops'] / (ms * 1e-3):8.1f} "
                         f"{one / ms:12.2f}")
        for label, note in r["notes"].items():
            lines.append(f"{r['case']:<24} {label:<42} {note}")
        errors = ", ".join(f"{layout} {e:.1e}" for layout, e in r["rel_error_vs_whole"].items())
        lines.append(f"{r['case']:<24} sharded vs whole: rel error {errors}; states (contiguous) "
                     f"{r['state_bytes_per_rank'] / 2**20:.1f} MiB per rank, "
                     f"{r['bytes_received_per_rank'] / 2**20:.1f} MiB received by each rank")
    return "\n".join(lines)


def main(out: Path, quick: bool = False, only: list[str] | None = None) -> None:
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    if world < 2:
        raise RuntimeError(f"the distributed benchmark needs two GPUs or more; this machine has {world}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # no NVLink multicast (KINDS.md)
    store = tempfile.mktemp(prefix="einfold-bench-store-")
    mp.spawn(_worker, args=(world, store, quick, str(out), only), nprocs=world, join=True)
