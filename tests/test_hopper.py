"""The Hopper form of streamed rescaled folds (compiler/backend/triton/hopper.py).

On this machine: which programs take the form on an sm_90 GPU, for every spelling of
the same program, and why the others do not (the module's notes), from the generated
source alone; and that the Gluon kernels build for sm_90a (Triton's compiler and ptxas,
in a subprocess with the interpreter off).  On the GPU: every variant against float64,
no less accurate than the `tl` kernel the launcher falls back to, ragged sizes, rows
no key reaches, large logits, operands TMA cannot read."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import compiler
from compiler.random_inputs import random_inputs, relative_error

HERE = os.path.dirname(os.path.abspath(__file__))

SCALED = "Q[b,h,i,k] * K[b,h,m,k] * scale"


def attention(logits: str = SCALED, keep: str | None = None) -> str:
    inner = f"where({keep}, {logits}, -inf)" if keep else logits
    return f"O[b,h,i,j] = softmax[m]({inner}) * V[b,h,m,j]"


# name -> (program, sizes): programs that mean a streamed rescaled fold with a contraction of
# depth 128 in its leader and a weighted value tensor, whatever their spelling
TAKEN = {
    "plain": (attention(), {}),
    "causal": (attention(keep="m <= i"), {}),
    "window": (attention(keep="m <= i and i - m < 100"), {}),
    "bottom-right causal": (attention(keep="m <= i + len(m) - len(i)"), {"m": 1000}),
    "rows no key reaches": (attention(keep="m <= i - 200"), {}),
    "grouped query": ("O[b,g,r,i,j] = softmax[m](Q[b,g,r,i,k] * K[b,g,m,k] * scale) * V[b,g,m,j]", {}),
    "alibi": (attention("Q[b,h,i,k] * K[b,h,m,k] * scale - A[h] * abs(i - m)", "m <= i"), {}),
    "renamed and reordered": ("Out[x,y,p,q] = softmax[n](K[x,y,n,d] * Q[x,y,p,d] / 8.0) * V[x,y,n,q]", {}),
    "three statements": ("S[b,h,i,m] = Q[b,h,i,k] * K[b,h,m,k] * scale\n"
                         "P[b,h,i,m] = softmax[m](S[b,h,i,m])\nO[b,h,i,j] = P[b,h,i,m] * V[b,h,m,j]", {}),
    "with its logsumexp": (attention() + "\nL[b,h,i] = logsumexp[m](" + SCALED + ")", {}),
    "values of width 64": (attention(), {"j": 64}),
    # tensors the generated functions load by rows, keys or both, beside the scores and the results
    "padding bias": (attention(SCALED + " + P[b,m]"), {}),
    "per-row temperature": (attention("Q[b,h,i,k] * K[b,h,m,k] * T[b,h,i]"), {}),
    "relative bias": (attention(SCALED + " + R[h,i,m]"), {}),
    "gated output": ("O[b,h,i,j] = G[b,h,i] * softmax[m](" + SCALED + ") * V[b,h,m,j]", {}),
    "transposed result": ("O[b,h,j,i] = softmax[m](" + SCALED + ") * V[b,h,m,j]", {}),
}

# name -> (program, sizes, why not): the tl kernel runs them
NOT_TAKEN = {
    "depth 64": (attention(), {"k": 64, "j": 64}, "contraction depth 64"),
    "a document mask": (attention(keep="D[b,i] == D[b,m] and m <= i"), {"m": 300}, "per-tile tests"),
    "a decode row": (attention(), {"i": 1}, "fewer than 128 rows"),
    "float32 operands": (attention(), {"dtype": torch.float32}, "16-bit"),
    "softcap": (attention("cap * tanh(Q[b,h,i,k] * K[b,h,m,k] * scale / cap)", "m <= i"), {}, "tanh"),
}

# The programs here are compiled with split=1: the Hopper form itself at these ragged sizes.
# Left to choose, a fold of this few programs (b * h of 6) splits, and a split kernel is tl.
SIZES = {"b": 2, "h": 3, "g": 2, "r": 2, "x": 2, "y": 3, "i": 300, "p": 300, "m": 333, "n": 333,
         "k": 128, "d": 128, "j": 128, "q": 128}


def inputs_of(program, sizes: dict, dtype=torch.bfloat16, device="cpu") -> dict:
    sizes = {**SIZES, **sizes}
    dtype = sizes.pop("dtype", dtype)
    x = random_inputs(program.checked, sizes, dtype=torch.float64)
    if "D" in x:
        x["D"] = (torch.arange(sizes["i"]) // 97).expand(sizes["b"], -1).to(torch.float64)
    if "A" in x:     # per-head slopes in float32 beside 16-bit operands
        x["A"] = torch.tensor([2 ** (-8 * (h + 1) / len(x["A"])) for h in range(len(x["A"]))], dtype=torch.float64)
    if "cap" in x:
        x["cap"] = 30.0
    if "P" in x:     # padding: the last keys of each batch masked out
        x["P"] = torch.where(torch.arange(sizes["m"]) < sizes["m"] - 17, 0.0, -float("inf")).expand(
            sizes["b"], -1).contiguous()
    return {k: v.to(device, torch.float32 if k == "A" else dtype if v.is_floating_point() else v.dtype)
            if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def hopper_source(src: str, sizes: dict) -> str:
    program = compiler.compile(src, backend="triton", split=1)
    return program.backend.source_for(program.binder(inputs_of(program, sizes)), sm_count=132, arch=90)


@pytest.mark.parametrize("name", list(TAKEN))
def test_every_spelling_takes_the_hopper_form_on_sm90(name):
    src, sizes = TAKEN[name]
    source = hopper_source(src, sizes)
    assert "@gluon.jit" in source and "_hopper[(triton.cdiv(" in source, source[-3000:]
    assert "not in the Hopper form" not in source


@pytest.mark.parametrize("name", list(NOT_TAKEN))
def test_the_others_keep_the_tl_kernel_and_say_why(name):
    src, sizes, why = NOT_TAKEN[name]
    source = hopper_source(src, sizes)
    assert "@gluon.jit" not in source
    notes = [line for line in source.splitlines() if "not in the Hopper form" in line]
    assert notes and why in notes[0], notes


def test_other_gpus_and_the_interpreter_never_see_gluon():
    from dataclasses import replace
    program = compiler.compile(attention(keep="m <= i"), backend="triton")
    binding = program.binder(inputs_of(program, {}))
    for arch in (None, 80, 100):
        source = program.backend.source_for(binding, sm_count=132, arch=arch)
        assert "gluon" not in source and "Hopper form" not in source
    # CPU tensors run under the interpreter, which cannot run Gluon, even for an sm_90 signature
    interpreted = program.backend.signature(binding, program.backend._extents(binding))
    assert interpreted.interpret
    source = program.backend.build(replace(interpreted, arch=90)).source
    assert "gluon" not in source and "Hopper form" not in source


def test_the_gluon_kernels_build_for_sm90(tmp_path):
    """Every Hopper-form kernel above, through Triton's compiler and ptxas for sm_90a
    (tests/gpu_compile.py), within an H100 block's shared memory (their tl fallbacks are
    the kernels test_gpu_compile builds)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "EINFOLD_CACHE_DIR": str(tmp_path / "einfold"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    names = list(TAKEN)
    script = ("import json, sys, torch; sys.path.insert(0, 'tests'); import gpu_compile, test_hopper, compiler\n"
              "for name in sys.argv[1:]:\n"
              "    src, sizes = test_hopper.TAKEN[name]\n"
              "    program = compiler.compile(src, backend='triton', split=1)\n"
              "    sizes = {**test_hopper.SIZES, **sizes}\n"
              "    for row in gpu_compile.check(name, program, torch.bfloat16, sizes, '_hopper'):\n"
              "        print(json.dumps(row), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script, *names], env=env, capture_output=True, text=True,
                          timeout=1200, cwd=os.path.dirname(HERE))
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["program"] for r in rows if r["kernel"].endswith("_hopper")} == set(names), rows
    assert [r for r in rows if "error" in r] == []
    assert max(r["shared"] for r in rows) <= 232448


# ---------------------------------------------------------------- on the GPU
def oracle(src: str, x: dict) -> dict:
    program = compiler.compile(src, backend="reference")
    wide = {k: v.double().cpu() if isinstance(v, torch.Tensor) and v.is_floating_point() else
            v.cpu() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    out = program(**wide)
    return dict(zip(program.outputs, out if isinstance(out, tuple) else (out,)))


def results(program, x: dict) -> dict:
    out = program(**x)
    return dict(zip(program.outputs, out if isinstance(out, tuple) else (out,)))


def untouchable(x: dict, name: str) -> dict:
    """The same inputs with `name` laid out so that TMA cannot read it (its last index strided)."""
    t = x[name]
    return {**x, name: t.transpose(-1, -2).contiguous().transpose(-1, -2)}


GPU_CASES = {
    "plain": {"i": 300, "m": 333},
    "causal": {"i": 1021, "m": 1021},
    "window": {"i": 700, "m": 700},
    "bottom-right causal": {"i": 300, "m": 1000},
    "rows no key reaches": {"i": 600, "m": 600},
    "grouped query": {"i": 257, "m": 513},
    "alibi": {"i": 1024, "m": 1024},
    "renamed and reordered": {"p": 129, "n": 1},
    "three statements": {"i": 1024, "m": 1024},
    "with its logsumexp": {"i": 384, "m": 700},
    "values of width 64": {"i": 300, "m": 333},
    "padding bias": {"i": 300, "m": 333},
    "per-row temperature": {"i": 257, "m": 513},
    "relative bias": {"i": 300, "m": 333},
    "gated output": {"i": 300, "m": 333},
    "transposed result": {"i": 300, "m": 333},
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_hopper_form_matches_float64_as_well_as_the_tl_kernel(name, dtype, private_cache):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper form runs on sm_90 only")
    src, sizes = TAKEN[name]
    program = compiler.compile(src, backend="triton", split=1)
    x = inputs_of(program, {**sizes, **GPU_CASES[name]}, dtype, "cuda")
    assert any(k.name.endswith("_hopper") for k in program.plan(**x).kernels)
    want = oracle(src, x)
    got = results(program, x)
    operand = next(n for n in ("K", "Q") if n in x)
    fallback = results(program, untouchable(x, operand))
    for out in program.outputs:
        err, tl_err = relative_error(got[out], want[out]), relative_error(fallback[out], want[out])
        assert err <= 2 * tl_err + 2e-3, (out, err, tl_err)
    if name == "rows no key reaches":
        assert torch.isnan(got["O"][:, :, :200]).all() and torch.isfinite(got["O"][:, :, 200:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("starts", [(0, 0), (256, 0), (0, 384), (640, 128)])
def test_a_ring_part_in_the_hopper_form_matches_float64(starts, private_cache):
    # the ring's local program: causal attention of rows at global positions i + i_start
    # against keys at m + m_start (0-d int64 tensors), its states (r, l, u) against float64
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper form runs on sm_90 only")
    src = TAKEN["causal"][0]
    ring = compiler.compile(src, backend="triton", split=1).shard("m", rows="i")
    oracle_ring = compiler.compile(src, backend="reference").shard("m", rows="i")
    sh = ring.sharded
    x = inputs_of(ring.program, {"i": 300, "m": 333}, torch.bfloat16, "cuda")
    x.update({name: torch.tensor(value, device="cuda") for name, value in
              zip((sh.start, sh.rows_start, sh.total, sh.rows_total), (*starts, 10 ** 4, 10 ** 4))})
    local = {k: v for k, v in x.items() if k in ring._local_inputs}
    assert any(k.name.endswith("_hopper") for k in ring.local.plan(**local).kernels)
    fields = [name.rsplit("_", 1)[1] for name in sh.states]
    got = dict(zip(fields, ring.local._run(local)))
    want = dict(zip(fields, oracle_ring.local._run({k: (v.double() if v.is_floating_point() else v).cpu()
                                                    if isinstance(v, torch.Tensor) else v
                                                    for k, v in local.items()})))
    seen = want["l"] > 0                   # rows some key reaches
    assert torch.equal(got["l"].cpu() > 0, seen) and torch.isneginf(got["r"].cpu()[~seen]).all()
    out, expected = (s["u"] / s["l"].unsqueeze(-1) for s in (got, want))
    assert relative_error(out.cpu()[seen], expected[seen]) <= 1e-2
    torch.testing.assert_close(got["r"].cpu()[seen].double(), want["r"][seen], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_large_logits_stay_finite_as_in_torch(private_cache):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper form runs on sm_90 only")
    src = attention(keep="m <= i")
    program = compiler.compile(src, backend="triton", split=1)
    x = inputs_of(program, {"i": 512, "m": 512}, torch.bfloat16, "cuda")
    x["Q"] = x["Q"] * 300
    got = results(program, x)["O"]
    assert torch.isfinite(got).all()
    assert relative_error(got, oracle(src, x)["O"]) < 2e-2


# ---------------------------------------------------------------- the generated host and bound code, on CPU
def hopper_module(src: str, x: dict):
    from compiler.backend.triton.cache import load
    program = compiler.compile(src, backend="triton", split=1)
    binding = program.binder(x)
    text = program.backend.source_for(binding, sm_count=132, arch=90)
    return load(text, "test_hopper", interpret=True), program.backend, binding


def launched(src: str, x: dict, layout=lambda name, t: t) -> list[str]:
    """The kernels the generated launcher launches for `x`, recorded, nothing run; `layout`
    lays out each output tensor."""
    from triton.runtime.autotuner import Autotuner

    from gpu_compile import recorded
    module, backend, binding = hopper_module(src, x)
    t = dict(x) | {name: layout(name, torch.empty(shape, dtype=dtype))
                   for name, shape, dtype in backend._output_specs(binding)}
    return [(k.fn if isinstance(k, Autotuner) else k).__name__
            for k, _, _ in recorded(module, t, backend._extents(binding))]


def test_the_launcher_falls_back_to_the_tl_kernel_where_tma_cannot_read():
    src, _ = TAKEN["causal"]
    x = inputs_of(compiler.compile(src), {})
    assert launched(src, x) == ["einfold_O_hopper"]
    # the heads-major view of a sequence-major tensor: its last stride is still 1
    q = x["Q"].transpose(1, 2).contiguous().transpose(1, 2)
    assert launched(src, {**x, "Q": q}) == ["einfold_O_hopper"]
    assert launched(src, untouchable(x, "K")) == ["einfold_O"]             # the depth strided
    shifted = torch.empty(x["V"].numel() + 1, dtype=x["V"].dtype)[1:].view(x["V"].shape)
    assert launched(src, {**x, "V": shifted.copy_(x["V"])}) == ["einfold_O"]   # 2 bytes off 16


def test_the_launcher_stores_aligned_tile_results_only():
    """The Hopper kernel's tile stores assume TMA's alignment of the results (they give it to
    the compiler): a result laid out otherwise takes the tl kernel."""
    src, _ = TAKEN["with its logsumexp"]
    x = inputs_of(compiler.compile(src), {})

    def shifted(name, t):       # 2 bytes off 16
        return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape) if name == "O" else t
    assert launched(src, x) == ["einfold_O_hopper"]
    assert launched(src, x, lambda name, t: t.transpose(1, 2).contiguous().transpose(1, 2)) == ["einfold_O_hopper"]
    assert launched(src, x, shifted) == ["einfold_O"]
    assert launched(src, x, lambda name, t: t.transpose(-1, -2).contiguous().transpose(-1, -2)
                    if name == "O" else t) == ["einfold_O"]        # the values strided
    # a result whose values are not its last index states no alignment and needs none
    transposed = TAKEN["transposed result"][0]
    assert launched(transposed, x) == launched(transposed, x, lambda name, t: t.transpose(-1, -2).contiguous()
                                               .transpose(-1, -2)) == ["einfold_O_hopper"]
    assert "gl.max_contiguous" not in hopper_source(transposed, {})
    # a per-row result is stored one value a row: any layout
    assert launched(src, x, lambda name, t: t.transpose(-1, -2).contiguous().transpose(-1, -2)
                    if name == "L" else t) == ["einfold_O_hopper"]


# name -> (program, its predicate on (i, m, n_i, n_m))
BOUNDED = {
    "causal": (TAKEN["causal"][0], lambda i, m, n_i, n_m: m <= i),
    "window": (TAKEN["window"][0], lambda i, m, n_i, n_m: (m <= i) & (i - m < 100)),
    "wide window": (attention(keep="m <= i and i - m < 300"), lambda i, m, n_i, n_m: (m <= i) & (i - m < 300)),
    "window alone": (attention(keep="i - m <= 400"), lambda i, m, n_i, n_m: i - m <= 400),
    "bottom-right causal": (TAKEN["bottom-right causal"][0], lambda i, m, n_i, n_m: m <= i + n_m - n_i),
    "rows no key reaches": (TAKEN["rows no key reaches"][0], lambda i, m, n_i, n_m: m <= i - 200),
    "plain": (attention(), lambda i, m, n_i, n_m: m >= 0),
}


@pytest.mark.parametrize("name", list(BOUNDED))
@pytest.mark.parametrize("n_i, n_m", [(128, 1), (300, 333), (1021, 1021), (256, 1000), (700, 129)])
def test_the_tile_range_covers_every_live_key_and_its_interior_needs_no_mask(name, n_i, n_m):
    """The kernel's prologue (lo, hi, inner_lo, inner_hi), run in Python for every row block,
    against every element of every tile: a tile with a live element lies in [lo, hi), a tile
    in [inner_lo, inner_hi) is live at every element of the block's rows,
    lo <= inner_lo <= inner_hi <= hi, hi > lo, and the fold's loops (run in Python too) visit
    every tile of [lo, hi) once, leaving out the masks only on tiles live at every element."""
    src, keep = BOUNDED[name]
    program = compiler.compile(src, backend="triton", split=1)
    x = inputs_of(program, {"i": n_i, "m": n_m})
    source = program.backend.source_for(program.binder(x), sm_count=132, arch=90)
    assert_tile_ranges(source, "einfold_O_hopper", lambda i, m: keep(i, m, n_i, n_m), n_i, n_m, {})


class _Position:
    """A 0-d integer tensor's pointer in a kernel prologue run in Python: gl.load(p).to(...)."""

    def __init__(self, value: int):
        self.value = value

    def to(self, _dtype):
        return self.value


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("starts", [(0, 0), (256, 0), (0, 384), (640, 128), (1000, 3000)])
def test_a_shards_starts_bound_the_hopper_forms_tile_range(layout, starts):
    """The ring's local program (rows and keys at global positions i + i_start and m +
    m_start, read from 0-d int64 tensors) takes the Hopper form, and its tile range, run
    in Python with the starts loaded, covers every live key of every row block."""
    m_start, i_start = starts
    n_i, n_m = 300, 333
    ring = compiler.compile(TAKEN["causal"][0], backend="triton", split=1).shard("m", layout=layout, rows="i")
    sh = ring.sharded
    x = inputs_of(ring.program, {"i": n_i, "m": n_m})
    x.update({sh.start: torch.tensor(m_start), sh.rows_start: torch.tensor(i_start),
              sh.total: torch.tensor(10 ** 4), sh.rows_total: torch.tensor(10 ** 4)})
    binding = ring.local.binder({k: v for k, v in x.items() if k in ring._local_inputs})
    source = ring.local.backend.source_for(binding, sm_count=132, arch=90)
    assert "form: Hopper" in str(ring.local.backend.specialised_for(binding, sm_count=132, arch=90))
    loads = {"m_start_ptr": _Position(m_start), "i_start_ptr": _Position(i_start)}
    assert_tile_ranges(source, "einfold_S0_u_hopper", lambda i, m: m + m_start <= i + i_start, n_i, n_m, loads)


def assert_tile_ranges(source: str, kernel_name: str, keep, n_i: int, n_m: int, pointers: dict) -> None:
    """The checks of test_the_tile_range_covers_every_live_key_and_its_interior_needs_no_mask on
    the Hopper kernel `kernel_name` of `source`, whose live elements are keep(i, m); `pointers`:
    the prologue's scalar pointers, as gl.load reads them."""
    import math
    import types
    kernel = source[source.index(f"def {kernel_name}(q_desc"):]
    prologue = kernel[kernel.index("    row0 = pid_m * BLOCK_M"):kernel.index("    q_smem = ")]
    fold = source[source.index(f"def {kernel_name}_fold("):source.index("    last = hi - 1 - lo")]
    # (range, the tile's MASKED argument) of each loop of the fold after its first tile
    loops = [(header, call.strip().removesuffix(")").rsplit(", ", 1)[1])
             for header, call in re.findall(r"for t in range\((.+)\):\n.+\n(.+)\n", fold)]
    assert loops
    gl = types.SimpleNamespace(maximum=max, minimum=min, to_tensor=int, load=lambda pointer: pointer, int32=int)
    i = torch.arange(n_i)[:, None]
    m = torch.arange(n_m)[None, :]
    live = keep(i, m) & (m < n_m)
    tiles = math.ceil(n_m / 128)
    for pid_m in range(math.ceil(n_i / 128)):
        env = {"gl": gl, "pid_m": pid_m, "BLOCK_M": 128, "BLOCK_N": 128, "n_i": n_i, "n_m": n_m, **pointers}
        exec(textwrap.dedent(prologue), env)
        lo, hi, inner_lo, inner_hi = (env[v] for v in ("lo", "hi", "inner_lo", "inner_hi"))
        assert lo <= inner_lo <= inner_hi <= hi and hi > lo
        masked = {lo: True}             # the first tile, before the loops
        for header, test in loops:
            for t in range(*eval(f"({header})", {**env, "gl": gl})):
                assert t not in masked, (pid_m, t, "visited twice")
                masked[t] = bool(eval(test, {**env, "t": t}))
        assert sorted(masked) == list(range(lo, hi)), (pid_m, sorted(masked), lo, hi)
        block = live[pid_m * 128:(pid_m + 1) * 128]
        for t in range(tiles):
            tile = block[:, t * 128:(t + 1) * 128]
            if bool(tile.any()):
                assert lo <= t < hi, (pid_m, t, lo, hi)
            if inner_lo <= t < inner_hi:
                assert bool(tile.all()) and tile.shape[1] == 128, (pid_m, t, inner_lo, inner_hi)
            if t in masked and not masked[t]:       # a tile the fold runs without its masks
                assert bool(tile.all()) and tile.shape[1] == 128, (pid_m, t, "unmasked")
