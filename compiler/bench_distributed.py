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


CROSS_ENTROPY = ("Z[t,v] = sum[d](H[t,d] * W[v,d])\n"
                 "L[t] = logsumexp[v](Z[t,v]) - sum[v](where(v == Y[t], Z[t,v], 0))")


def _cases(quick: bool):
    """(name, kind, shape, causal).  Kinds: "prefill" (b, h, queries, keys, d): the
    forward, with K/V sharded and Q replicated (up to 16k) and as a ring; "training":
    forward and backward through autograd, the ring; "backward": the gradient program
    with K/V sharded; "decode": one query over a sharded cache; "cross_entropy"
    (tokens, d, vocab): the classifier split over the vocabulary."""
    s = 8192 if quick else 16384
    long = 16384 if quick else 65536
    cache = 65536 if quick else 131072
    long_cache = 131072 if quick else 524288
    attention = (1, 16, s, s, 128)
    ring = (1, 16, long, long, 128)
    return [(f"prefill S={s}", "prefill", attention, False),
            (f"prefill causal S={s}", "prefill", attention, True),
            (f"causal backward S={s}", "backward", attention, True),
            (f"decode L={cache}", "decode", (4, 32, 1, cache, 128), False),
            (f"prefill S={long}", "prefill", ring, False),
            (f"prefill causal S={long}", "prefill", ring, True),
            (f"training causal S={long}", "training", ring, True),
            (f"decode L={long_cache}", "decode", (4, 32, 1, long_cache, 128), False),
            ("tensor-parallel cross-entropy", "cross_entropy", (4096 if quick else 8192, 4096, 131072), False)]


def _sequence_part(t: torch.Tensor, layout: str, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """This rank's part of dimension `dim` (the sequence) of `t` in `layout` (zigzag: parts
    rank and 2W - 1 - rank of 2W)."""
    n = t.shape[dim]
    if layout == "contiguous":
        part = n // world
        return t.narrow(dim, rank * part, (part if rank < world - 1 else n - rank * part))
    halves = n // (2 * world)
    late = 2 * world - 1 - rank
    return torch.cat([t.narrow(dim, rank * halves, halves), t.narrow(dim, late * halves, halves)], dim)


def _sdpa_backward(q, k, v, do, causal: bool):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def _training_step(forward, tensors: dict[str, torch.Tensor], upstream: torch.Tensor):
    """One forward and backward of `forward(**tensors)` (the tensors as leaves that
    require grad), and the leaves, whose .grad the last step left."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}

    def step():
        for t in leaves.values():
            t.grad = None
        forward(**leaves).backward(upstream)
    return step, leaves


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _context_parallel(q, k, v, causal: bool, world: int, training: bool):
    """PyTorch's context parallelism (ring SDPA over Q, K, V sharded on the sequence),
    forward or forward and backward, and the function that leaves its context; or
    the reason it cannot run this case."""
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

    def close():
        for t in (q, k, v):         # it restores the buffers' shapes, which a leaf with grad refuses
            t.requires_grad_(False)
        context.__exit__(None, None, None)
    try:
        def forward():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if not training:
            return forward, close
        for t in (q, k, v):
            t.requires_grad_()
        upstream = torch.randn_like(forward())

        def step():
            for t in (q, k, v):
                t.grad = None
            forward().backward(upstream)
        return step, close
    except Exception:
        close()
        raise


def _attention_contenders(kind, source, shape, causal, rank, world, device, progress):
    """The contenders of an attention case: {label: fn}, errors against the whole
    program, the FLOPs of one call and what a sharded call exchanges."""
    import compiler
    b, h, s, n, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    local = {layout: tuple(_sequence_part(t, layout, rank, world) for t in (k, v))
             for layout in ("contiguous", "zigzag")}
    layouts = ("contiguous", "zigzag") if causal and n % (2 * world) == 0 else ("contiguous",)
    program = compiler.compile(source, backend="triton")
    contenders, error, exchange = {}, {}, ""
    flops = 4 * b * h * s * n * d / (2 if causal else 1)
    if kind == "training":
        do = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
        progress("the whole program, forward and backward")
        step, whole = _training_step(lambda **t: program(**t, scale=scale), {"Q": q, "K": k, "V": v}, do)
        step()
        contenders["einfold, 1 GPU"] = step
        layout = layouts[-1]             # zigzag under a causal mask: every rank the same work
        ring = program.shard("m", layout=layout, rows="i")
        parts = {name: _sequence_part(t, layout, rank, world) for name, t in (("Q", q), ("K", k), ("V", v))}
        progress(f"ring, {layout}, forward and backward")
        ring_step, leaves = _training_step(lambda **t: ring(**t, scale=scale), parts,
                                           _sequence_part(do, layout, rank, world))
        ring_step()
        for name in ("Q", "K", "V"):
            error[f"ring {layout} d{name}"] = _relative(leaves[name].grad,
                                                        _sequence_part(whole[name].grad, layout, rank, world))
        contenders[f"einfold, Q, K/V {layout} ring over {world} GPUs"] = ring_step
        exchange = str(ring.plan(**parts, scale=scale).exchange)
        contenders["SDPA, 1 GPU"] = _training_step(
            lambda Q, K, V: torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal),
            {"Q": q, "K": k, "V": v}, do)[0]
        return contenders, error, flops * 3.5, exchange
    extra = {}                  # the backward's inputs besides Q, K, V, scale: dO, O and the row logsumexp
    if kind == "backward":
        do = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
        o, lse = program._saving(Q=q, K=k, V=v, scale=scale)
        extra = {"dO": do, "O": o, "lse_O": lse}
        program = compiler.compile(compiler.grad(source, saved=True).text, backend="triton")
        flops *= 2.5
    progress("the whole program")
    whole = program(Q=q, K=k, V=v, scale=scale, **extra)
    whole = whole if isinstance(whole, tuple) else (whole,)
    contenders["einfold, 1 GPU"] = lambda: program(Q=q, K=k, V=v, scale=scale, **extra)
    replicated = kind != "prefill" or s <= 16384      # longer prefill: Q replicated moves output-sized states
    for layout in layouts if replicated else ():
        sp = program.shard("m", layout=layout)
        progress(f"sharded, {layout}")
        kl, vl = local[layout]
        got = sp(Q=q, K=kl, V=vl, scale=scale, **extra)
        got = got if isinstance(got, tuple) else (got,)
        # replicated outputs only (dQ of the backward; dK and dV come out sharded)
        error[layout] = max(_relative(a, w) for a, w in zip(got, whole) if a.shape == w.shape)
        contenders[f"einfold, K/V {layout} over {world} GPUs"] = \
            lambda sp=sp, kl=kl, vl=vl: sp(Q=q, K=kl, V=vl, scale=scale, **extra)
        exchange = exchange or str(sp.plan(Q=q, K=kl, V=vl, scale=scale, **extra).exchange)
    if kind == "prefill":       # the queries sharded too, K/V around a ring
        for layout in layouts:
            ring = program.shard("m", layout=layout, rows="i")
            ql, (kl, vl) = _sequence_part(q, layout, rank, world), local[layout]
            progress(f"ring, {layout}")
            got = ring(Q=ql, K=kl, V=vl, scale=scale)
            error[f"ring {layout}"] = _relative(got, _sequence_part(whole[0], layout, rank, world))
            contenders[f"einfold, Q, K/V {layout} ring over {world} GPUs"] = \
                lambda ring=ring, ql=ql, kl=kl, vl=vl: ring(Q=ql, K=kl, V=vl, scale=scale)
            if not replicated:
                exchange = str(ring.plan(Q=ql, K=kl, V=vl, scale=scale).exchange)
    contenders["SDPA, 1 GPU"] = (_sdpa_backward(q, k, v, extra.get("dO"), causal) if kind == "backward" else
                                 lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    return contenders, error, flops, exchange


def _cross_entropy_contenders(shape, rank, world, device, progress):
    """A cross-entropy whose classifier is split over the vocabulary (tensor
    parallelism): each rank folds its classes, only per-row states are gathered."""
    import compiler
    tokens, d, vocab = shape
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, d, device=device, dtype=torch.bfloat16, generator=g) * d ** -0.5
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    program = compiler.compile(CROSS_ENTROPY, backend="triton")
    progress("the whole program")
    whole = program(H=h, W=w, Y=y)
    mine = _sequence_part(w, "contiguous", rank, world, dim=0)
    sharded = program.shard("v")
    progress("sharded over the vocabulary")
    error = {"contiguous": _relative(sharded(H=h, W=mine, Y=y), whole)}
    contenders = {"einfold, 1 GPU": lambda: program(H=h, W=w, Y=y),
                  f"einfold, vocabulary over {world} GPUs": lambda: sharded(H=h, W=mine, Y=y),
                  "torch (logits, cross_entropy), 1 GPU":
                      lambda: torch.nn.functional.cross_entropy((h @ w.T).float(), y, reduction="none")}
    return contenders, error, 2 * tokens * d * vocab, str(sharded.plan(H=h, W=mine, Y=y).exchange)


def _worker(rank: int, world: int, store: str, quick: bool, out: str, only: list[str] | None) -> None:
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1` shows where a slow rank is
    began = time.perf_counter()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=device)
    rows = []
    for name, kind, shape, causal in _cases(quick):
        if only and not any(text in name for text in only):
            continue

        def progress(step: str) -> None:
            if rank == 0:
                print(f"  [{time.perf_counter() - began:6.1f} s] {name}: {step}", flush=True)
        source = CAUSAL if causal else ATTENTION
        if kind == "cross_entropy":
            contenders, error, flops, exchange = _cross_entropy_contenders(shape, rank, world, device, progress)
        else:
            contenders, error, flops, exchange = _attention_contenders(kind, source, shape, causal, rank, world,
                                                                       device, progress)
        timings, notes, close = {}, {}, None
        for label, fn in contenders.items():
            progress(f"timing {label}")
            timings[label] = _timed(fn, device)
        cp = f"torch context_parallel SDPA, {world} GPUs"
        try:
            if kind not in ("prefill", "training", "decode"):
                raise ValueError("not an attention forward or training step")
            b, h, s, n, d = shape
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(b, h, x, d, device=device, dtype=torch.bfloat16, generator=g) for x in (s, n, n))
            fn, close = _context_parallel(q, k, v, causal, world, kind == "training")
            progress(f"timing {cp}")
            timings[cp] = _timed(fn, device)
        except Exception as e:                       # a torch without it, or a shape it refuses
            notes[cp] = f"unavailable: {type(e).__name__}: {e}"[:120]
        finally:
            if close is not None:
                close()
        rows.append({"case": name, "timings_ms": timings, "notes": notes, "rel_error_vs_whole": error,
                     "tflops": flops / 1e12, "exchange": exchange})
        del contenders
        torch.cuda.empty_cache()
        if rank == 0:       # after every case: a run cut short keeps what it measured
            meta = {"device": torch.cuda.get_device_name(), "gpus": world, "torch": torch.__version__,
                    "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                    "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
            Path(out).mkdir(parents=True, exist_ok=True)
            path = Path(out) / f"bench_distributed_{world}gpus.json"
            previous = json.loads(path.read_text())["rows"] if path.exists() else []
            path.write_text(json.dumps({"meta": meta, "rows": previous + rows[-1:]}, indent=1))
            print(format_table(rows[-1:], meta), flush=True)
    dist.destroy_process_group()


def format_table(rows: list[dict], meta: dict) -> str:
    """Time, rate and speed-up over einfold on one GPU; share of ideal scaling
    (speed-up / GPUs) for einfold's sharded contenders."""
    gpus = meta["gpus"]
    lines = [f"{gpus} x {meta['device']}, torch {meta['torch']}, {meta['date']}",
             f"{'case':<30} {'contender':<44} {'ms':>9} {'TFLOP/s':>8} {'1 GPU / this':>12} {'of ideal':>8}"]
    for r in rows:
        one = r["timings_ms"].get("einfold, 1 GPU")
        for label, ms in r["timings_ms"].items():
            share = f"{one / ms / gpus:8.0%}" if label.startswith("einfold") and "GPUs" in label else ""
            lines.append(f"{r['case']:<30} {label:<44} {ms:9.3f} {r['tflops'] / (ms * 1e-3):8.1f} "
                         f"{one / ms:12.2f} {share}")
        for label, note in r["notes"].items():
            lines.append(f"{r['case']:<30} {label:<44} {note}")
        errors = ", ".join(f"{layout} {e:.1e}" for layout, e in r["rel_error_vs_whole"].items())
        lines.append(f"{r['case']:<30} sharded vs whole: rel error {errors}")
        lines.append(f"{r['case']:<30} exchange: {r['exchange']}")
    return "\n".join(lines)


def main(out: Path, quick: bool = False, only: list[str] | None = None) -> None:
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    if world < 2:
        raise RuntimeError(f"the distributed benchmark needs two GPUs or more; this machine has {world}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # no NVLink multicast (KINDS.md)
    store = tempfile.mktemp(prefix="einfold-bench-store-")
    mp.spawn(_worker, args=(world, store, quick, str(out), only), nprocs=world, join=True)
