"""Programs on the GPU against torch eager and torch.compile, side by side in one process
per case (each case in its own subprocess with a time limit), with einfold's variants:
results reduced to a scalar (issue 41 item 3) under the automatic split and forced
splits; distances written directly and expanded into norms and a contraction (item 2).

    python3 scripts/program_probe.py [--limit S] [--case NAME ...]

Prints a table last; details (JSON) go to $OUT/program_probe.json when OUT is set."""
from __future__ import annotations

import argparse
import torch  # noqa: F401  (the cases' torch functions, evaluated here)
import json
import os
import subprocess
import sys

CASES = {
    # name: (source, sizes, dtype, torch function of the inputs)
    "lse_loss t8k v32k": ("L[] = mean[t](logsumexp[v](Z[t,v]))", {"t": 8192, "v": 32000}, "bfloat16",
                          "lambda x: torch.logsumexp(x['Z'].float(), -1).mean()"),
    "linear_lse_loss t8k d2k v32k": ("L[] = mean[t](logsumexp[v](sum[k](H[t,k] * W[v,k])))",
                                     {"t": 8192, "k": 2048, "v": 32000}, "bfloat16",
                                     "lambda x: torch.logsumexp((x['H'] @ x['W'].T).float(), -1).mean()"),
    "dot 8k x 8k fp32": ("L[] = sum[i,j](X[i,j] * Y[i,j])", {"i": 8192, "j": 8192}, "float32",
                         "lambda x: (x['X'] * x['Y']).sum()"),
    "mean square 16k x 16k": ("L[] = mean[i,j](X[i,j] ** 2)", {"i": 16384, "j": 16384}, "bfloat16",
                              "lambda x: x['X'].float().pow(2).mean()"),
    "chamfer mean d3 8k fp32": ("L[] = mean[i](min[m](sum[k]((X[i,k] - Y[m,k]) ** 2)))",
                                {"i": 8192, "m": 8192, "k": 3}, "float32",
                                "lambda x: ((x['X'][:, None, :] - x['Y'][None, :, :]) ** 2).sum(-1).min(1).values.mean()"),
    "chamfer d64 4 x 8k fp32": ("C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))",
                                {"b": 4, "i": 8192, "m": 8192, "k": 64}, "float32",
                                "lambda x: torch.cdist(x['X'], x['Y']).pow(2).min(-1).values"),
    "chamfer d64 expanded": ("C[b,i] = min[m](sum[k](Y[b,m,k] * Y[b,m,k]) - 2 * sum[k](X[b,i,k] * Y[b,m,k]))"
                             " + sum[k](X[b,i,k] * X[b,i,k])",
                             {"b": 4, "i": 8192, "m": 8192, "k": 64}, "float32",
                             "lambda x: torch.cdist(x['X'], x['Y']).pow(2).min(-1).values"),
    "k-means expanded 256k x 1024 x 64": ("A[i] = argmin[c](sum[k](M[c,k] * M[c,k]) - 2 * sum[k](X[i,k] * M[c,k]), c)",
                                          {"i": 262144, "c": 1024, "k": 64}, "float32",
                                          "lambda x: torch.cdist(x['X'], x['M']).argmin(-1).double()"),
    "chamfer d64 4 x 8k bf16": ("C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))",
                                {"b": 4, "i": 8192, "m": 8192, "k": 64}, "bfloat16",
                                "lambda x: (x['X'].float().square().sum(-1)[..., None] - 2 * (x['X'] @ x['Y'].mT).float()"
                                " + x['Y'].float().square().sum(-1)[..., None, :]).amin(-1)"),
    "k-means 256k x 1024 x 64 fp32": ("A[i] = argmin[c](sum[k]((X[i,k] - M[c,k]) ** 2), c)",
                                      {"i": 262144, "c": 1024, "k": 64}, "float32",
                                      "lambda x: torch.cdist(x['X'], x['M']).argmin(-1).double()"),
    "k-means 256k x 1024 x 64 bf16": ("A[i] = argmin[c](sum[k]((X[i,k] - M[c,k]) ** 2), c)",
                                      {"i": 262144, "c": 1024, "k": 64}, "bfloat16",
                                      "lambda x: (x['M'].float().square().sum(1) - 2 * (x['X'] @ x['M'].T).float())"
                                      ".argmin(1).double()"),
    # float32 contractions, shallow and deep, for the tl.dot input precision
    "matmul 4096^3 fp32": ("C[i,j] = sum[k](A[i,k] * B[k,j])", {"i": 4096, "j": 4096, "k": 4096}, "float32",
                           "lambda x: x['A'] @ x['B']"),
    "products 8k x 8k x 64 fp32": ("C[i,m] = sum[k](X[i,k] * Y[m,k])", {"i": 8192, "m": 8192, "k": 64}, "float32",
                                   "lambda x: x['X'] @ x['Y'].T"),
    "products 8k x 8k x 256 fp32": ("C[i,m] = sum[k](X[i,k] * Y[m,k])", {"i": 8192, "m": 8192, "k": 256}, "float32",
                                   "lambda x: x['X'] @ x['Y'].T"),
    "products 8k x 8k x 1024 fp32": ("C[i,m] = sum[k](X[i,k] * Y[m,k])", {"i": 8192, "m": 8192, "k": 1024}, "float32",
                                   "lambda x: x['X'] @ x['Y'].T"),
}
SPLITS = (None, 128, 256)


def one(name: str) -> dict:
    import torch
    import triton.testing

    import compiler
    from compiler.random_inputs import random_inputs
    src, sizes, dtype, fn_text = CASES[name]
    fn = eval(fn_text)
    ref = compiler.compile(src)
    x = random_inputs(ref.checked, sizes, dtype=getattr(torch, dtype), seed=0, device="cuda")
    want = fn({k: v.double() if isinstance(v, torch.Tensor) else v for k, v in x.items()}).double()
    out = {"case": name, "rows": []}
    splits = SPLITS if not ref.checked.statements[-1].indices else (None,)
    contenders = [(f"einfold split={s or 'auto'}", compiler.compile(src, backend="triton", split=s))
                  for s in splits]
    contenders += [("torch eager", fn), ("torch.compile", torch.compile(fn))]
    for label, f in contenders:
        try:
            call = (lambda f=f: f(**x)) if label.startswith("einfold") else (lambda f=f: f(x))
            got = call().double()
            ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
            row = {"contender": label, "ms": ms,
                   "rel_err": float((got - want).norm() / want.norm().clamp_min(1e-30))}
            if label.startswith("einfold"):
                plan = f.plan(**x)
                row["plan"] = "; ".join(k.why for k in plan.kernels)
            out["rows"].append(row)
        except Exception as e:
            out["rows"].append({"contender": label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--case", action="append")
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one)))
        return
    results = []
    for name in args.case or list(CASES):
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                  timeout=args.limit)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            results.append(json.loads(line[7:]) if line else
                           {"case": name, "rows": [], "error": done.stderr.strip().splitlines()[-1:]})
        except subprocess.TimeoutExpired:
            results.append({"case": name, "rows": [], "error": f"past {args.limit} s"})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "program_probe.json"), "w") as f:
            json.dump(results, f, indent=1)
    for r in results:
        print(f"\n{r['case']}" + (f"  ERROR {r['error']}" if r.get("error") else ""))
        compiled = next((row["ms"] for row in r["rows"] if row["contender"] == "torch.compile" and "ms" in row), None)
        for row in r["rows"]:
            if "ms" in row:
                ratio = f"{compiled / row['ms']:6.2f}x" if compiled else "   -  "
                print(f"  {row['contender']:22s} {row['ms']:9.3f} ms  compile/this {ratio}  err {row['rel_err']:.1e}")
            else:
                print(f"  {row['contender']:22s} {row['error']}")
        for row in r["rows"]:
            if row["contender"] == "einfold split=auto" and "plan" in row:
                print(f"  plan: {row['plan'][:300]}")


if __name__ == "__main__":
    main()
