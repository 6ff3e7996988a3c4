"""Probe (issue 13): row reductions at fixed tilings against the emitted choice and
torch.compile, on the GPU.  The generated kernel of each program (8192 x 8192, or
PROBE_N x PROBE_N) is launched at fixed (rows a program, row chunk, warps, stages)
instead of its autotuned configs, as emitted or with hand edits (PROBE_VARIANTS):
whether several rows a program, or the row streamed in chunks (so that Triton's
pipeliner loads the next chunk during this one's arithmetic), keeps more bytes in
flight than one whole row a program (bf16 logsumexp: 80% of copy bandwidth as
emitted before the eighteenth session), and what the loads' eviction hints do.

    python3 scripts/row_probe.py      # prints a table; rows to $OUT/row_probe.json
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile

import torch
import triton
import triton.testing

import compiler

PROGRAMS = {"logsumexp": ("L[i] = logsumexp[j](X[i,j])", lambda x: torch.logsumexp(x.float(), -1).to(x.dtype), 1),
            "softmax": ("Y[i,j] = softmax[j](X[i,j])", lambda x: torch.softmax(x.float(), -1).to(x.dtype), 2),
            "rms": ("Y[i] = sqrt(mean[j](X[i,j] * X[i,j]))",
                    lambda x: x.float().square().mean(-1).sqrt().to(x.dtype), 1),
            "layernorm": ("mu[i] = sum[j](X[i,j]) / len(j)\nvar[i] = sum[j]((X[i,j] - mu[i]) ** 2) / len(j)\n"
                          "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + eps)",
                          lambda x: torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=EPS).to(x.dtype), 2)}
EPS = 1e-5
# (rows a program, row chunk, warps, stages); None: the emitted autotuned kernel
TILINGS = [None, *((rows, 8192, warps, 2) for rows in (1, 2) for warps in (4, 8, 16)),
           *((1, chunk, warps, stages) for chunk in (4096, 2048) for warps in (4, 8, 16) for stages in (1, 3)),
           (1, 1024, 4, 4), (2, 4096, 8, 3), (4, 2048, 8, 3), (8, 1024, 8, 3)]
N = int(os.environ.get("PROBE_N", 8192))   # rows and columns
# (rows, columns) of X, PROBE_SHAPES=ROWSxCOLS,...: long rows stream several tiles a program
SHAPES = [tuple(map(int, shape.split("x"))) for shape in os.environ.get("PROBE_SHAPES", f"{N}x{N}").split(",")]
if os.environ.get("PROBE_LAUNCH"):           # the emitted row tile at the (warps, stages) the tuner tries
    from compiler.schedule.tiles import LAUNCH, STREAM_BLOCK
    TILINGS = [None, *((1, STREAM_BLOCK, warps, stages) for warps, stages in LAUNCH)]
if os.environ.get("PROBE_WHOLE_ROWS"):      # only tilings whose row is one tile (what whole_row needs)
    TILINGS = [None, *((1, N, warps, stages) for warps in (4, 8, 16) for stages in (1, 2))]
# hand edits of the emitted kernel (PROBE_VARIANTS=name,name): regex -> replacement, or a
# function of the kernel's text
def whole_row(text: str) -> str:
    """The fold's loop and the epilogue's loop as straight code over one tile (valid
    where the row is one tile: the 8192 tilings), the epilogue reading the row the
    fold loaded (registers) instead of loading it again (from L2)."""
    lines, out, dedent = text.split("\n"), [], None
    loaded = re.search(r"(x_X\d+) = tl\.load\(X_tile_2", text).group(1)
    for line in lines:
        head = re.fullmatch(r"( *)for (start_\w+) in range\(0, n_j, BLOCK_\w+\):", line)
        if head:
            out.append(f"{head.group(1)}{head.group(2)} = 0")
            dedent = len(head.group(1))
            continue
        if dedent is not None and line.strip() and len(line) - len(line.lstrip()) <= dedent:
            dedent = None
        if dedent is not None:
            line = line[4:]
        if re.match(r" *x_X\d+ = tl\.load\(X_tile \+", line):
            line = re.sub(r"= tl\.load\(.*\)$", f"= {loaded}", line)
        out.append(line)
    return "\n".join(out)


VARIANTS = {"emitted": {},
            # the eviction hints removed (as emitted before the eighteenth session)
            "no_hints": {r", eviction_policy=\"\w+\"": ""},
            # only the last read hinted (evict_first): an earlier read of the same row without evict_last
            "no_last": {r", eviction_policy=\"evict_last\"": ""},
            # 32-bit offsets (the tensor's 2^26 elements fit)
            "int32": {r"\.to\(tl\.int64\)": "", r"tl\.cast\((start_j2?), tl\.int64\)": r"\1"},
            "whole_row": whole_row}
VARIANT_NAMES = os.environ.get("PROBE_VARIANTS", "emitted").split(",")
PROGRAM_NAMES = os.environ.get("PROBE_PROGRAMS", ",".join(PROGRAMS)).split(",")
DTYPES = [getattr(torch, name) for name in os.environ.get("PROBE_DTYPES", "bfloat16,float32").split(",")]


def module_of(source: str, dtype: torch.dtype, shape: tuple[int, int], edits):
    program = compiler.compile(source, backend="triton")
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    text = program.backend.source_for(program.binder({"X": x, **({"eps": EPS} if "eps" in source else {})}),
                                      sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    # the kernel alone, without its autotuner: launched at each fixed tiling below
    fixed = re.sub(r"@triton\.autotune\(.*\)\n", "", text)
    if callable(edits):
        fixed = edits(fixed)
    for pattern, replacement in ({} if callable(edits) else edits).items():
        fixed, count = re.subn(pattern, replacement, fixed)
        assert count, f"no {pattern!r} in the kernel of {source}"
    path = os.path.join(tempfile.mkdtemp(), f"row_probe_{abs(hash((source, str(dtype), fixed)))}.py")
    with open(path, "w") as f:
        f.write(fixed)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return program, module, text


def fixed_tilings(module, text: str, x: torch.Tensor, out: torch.Tensor, want: torch.Tensor, variant: str) -> dict:
    """ms of the module's kernel at each fixed tiling of TILINGS, by a label."""
    n, cols = x.shape
    kernel_name = re.search(r"def (einfold_\w+)\(", text).group(1)
    kernel = getattr(module, kernel_name)
    names = [p.split(":")[0].strip() for p in re.search(rf"def {kernel_name}\((.*)\):", text).group(1).split(",")]
    timed = {}
    for rows_, chunk, warps, stages in TILINGS[1:]:
        y = torch.empty_like(out)
        if chunk > cols or n % rows_:
            continue
        args = {"n_i": n, "n_j": cols, "X_ptr": x, "X_s0": x.stride(0), "X_s1": 1, "eps_val": EPS}
        out_name = "L" if "L_ptr" in names else "Y"
        args[f"{out_name}_ptr"] = y
        for k, stride in enumerate(y.stride()):
            args[f"{out_name}_s{k}"] = stride
        call = [args[p] for p in names if not p.startswith("BLOCK")]
        blocks = {p: rows_ if p == "BLOCK_i" else chunk for p in names if p.startswith("BLOCK")}
        label = f"{variant}: {rows_} rows x {chunk}, {warps} warps, {stages} stages"

        def go():
            kernel[(n // rows_,)](*call, **blocks, num_warps=warps, num_stages=stages)
        try:
            go()
            wrong = (y.float() - want.float()).abs().max().item() > 5e-2
            timed[label + (" WRONG" if wrong else "")] = triton.testing.do_bench(go)
        except Exception as e:       # a tiling that does not compile or fit
            timed[f"{label}: {type(e).__name__}"] = float("nan")
    return timed


def main() -> None:
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / (triton.testing.do_bench(lambda: dst.copy_(src)) * 1e-3) / 1e9
    del src, dst
    rows = []
    for name, (n, cols), dtype in [(name, shape, dtype) for name in PROGRAM_NAMES for shape in SHAPES
                                   for dtype in DTYPES]:
        source, torch_fn, tensors = PROGRAMS[name]
        x = torch.randn(n, cols, device="cuda", dtype=dtype)
        want = torch_fn(x)
        nbytes = (n * cols * tensors + n * (tensors == 1)) * dtype.itemsize
        compiled = torch.compile(torch_fn)
        timed = {"torch.compile": triton.testing.do_bench(lambda: compiled(x))}
        for variant in VARIANT_NAMES:
            program, module, text = module_of(source, dtype, (n, cols), VARIANTS[variant])
            if variant == VARIANT_NAMES[0]:
                out = program(X=x, **({"eps": EPS} if "eps" in source else {}))
                assert torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2)
                timed["emitted (autotuned)"] = triton.testing.do_bench(lambda: program(X=x, **(
                    {"eps": EPS} if "eps" in source else {})))
            timed.update(fixed_tilings(module, text, x, out, want, variant))
        for contender, ms in timed.items():
            rows.append({"program": name, "shape": f"{n}x{cols}", "dtype": str(dtype).split(".")[-1],
                         "contender": contender,
                         "ms": ms, "GB/s": nbytes / (ms * 1e-3) / 1e9})
    with open(os.path.join(os.environ.get("OUT", "."), "row_probe.json"), "w") as f:
        json.dump({"copy_GBps": copy, "rows": rows}, f, indent=1)
    print(f"copy bandwidth {copy:.0f} GB/s")
    for r in rows:
        print(f"{r['program']:10s} {r['shape']:11s} {r['dtype']:9s} {r['contender']:60s} {r['ms'] * 1e3:8.1f} us "
              f"{r['GB/s']:6.0f} GB/s {r['GB/s'] / copy:6.1%}")


if __name__ == "__main__":
    main()
