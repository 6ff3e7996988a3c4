"""Where a sharded attention's time goes, on one GPU: the whole program, the local
program on one part (its start a 0-d int64 tensor on the device), the merge."""
import torch, triton.testing, compiler
from compiler.passes.shard import shard
from compiler.program import Program
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
FULL = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
dev = "cuda"
b, h, s, d = 1, 16, 16384, 128
q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
for name, src in (("full", FULL), ("causal", CAUSAL)):
    p = compiler.compile(src, backend="triton")
    sp = p.shard("m")
    loc, mer = sp.local, sp.merge
    print(name, "whole", round(bench(lambda: p(Q=q, K=k, V=v, scale=0.088)), 3), flush=True)
    for lo, hi in ((0, 8192), (8192, 16384), (0, 4096), (12288, 16384)):
        kk, vv = k[:, :, lo:hi], v[:, :, lo:hi]
        num = {"Q": q, "K": kk, "V": vv, "scale": 0.088, sp.sharded.start: torch.tensor(lo, device=dev),
               sp.sharded.total: torch.tensor(s, device=dev)}
        print(f"{name} local keys {lo}-{hi}: {bench(lambda: loc._run(dict(num))):.3f} ms", flush=True)
    states = loc._run(dict(num))
    gathered = {n: torch.stack([t, t]) for n, t in zip(sp.sharded.states, states)}
    print(name, "merge", round(bench(lambda: mer._run(dict(gathered))), 3), flush=True)
    print(loc.plan(**num))
    print(mer.plan(**gathered))
    print(p.plan(Q=q, K=k, V=v, scale=0.088))
