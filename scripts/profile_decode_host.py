"""Host time of a cached split-decode call (B1 H8 L8192 d128 bf16) and its cProfile, on the GPU:
    python3 scripts/profile_decode_host.py"""
import cProfile, pstats, time, torch, compiler, io
src = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
p = compiler.compile(src)
g = torch.Generator(device="cuda").manual_seed(0)
x = {"Q": torch.randn(1,8,1,128, device="cuda", dtype=torch.bfloat16), "K": torch.randn(1,8,8192,128, device="cuda", dtype=torch.bfloat16), "V": torch.randn(1,8,8192,128, device="cuda", dtype=torch.bfloat16), "scale": 0.088}
for _ in range(20): p(**x)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(2000): p(**x)
host = (time.perf_counter() - t) / 2000 * 1e6
torch.cuda.synchronize()
print(f"host us per cached decode call: {host:.1f}")
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): p(**x)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
