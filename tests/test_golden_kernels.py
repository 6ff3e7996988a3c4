"""Golden kernels: the Triton module each program below generates for one fixed
signature (shapes and dtypes as given, compiled for a GPU with an H100's 132
SMs), checked in under tests/golden/kernels/ and reviewed as text.  Nothing
runs: the inputs only fix the signature (large ones are broadcast views).

After an intended change of the generated code, regenerate and read the diff:

    python3 tests/test_golden_kernels.py --update
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import compiler

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "kernels"
H100_SMS = 132
H100_L2_BYTES = 50 * 2 ** 20
BF16, F32 = torch.bfloat16, torch.float32

ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
QKV = {"Q": ((2, 4, 1024, 64), BF16), "K": ((2, 4, 1024, 64), BF16), "V": ((2, 4, 1024, 64), BF16), "scale": 0.125}

# name: (source, outputs or None, {input: (shape, dtype) or a number})
GOLDEN = {
    "attention": (ATTENTION, None, QKV),
    "causal_attention": (CAUSAL, None, QKV),
    # packed documents: a predicate on data, tested per key tile within the live span a scan finds
    "document_attention": ("O[b,h,i,j] = softmax[m](where(D[b,i] == D[b,m] and m <= i, "
                           "Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]", None,
                           {**QKV, "D": ((2, 1024), BF16)}),
    # one query row over a long cache: split across programs, then merged
    "split_decode": (ATTENTION, None, {"Q": ((1, 8, 1, 128), BF16), "K": ((1, 8, 65536, 128), BF16),
                                       "V": ((1, 8, 65536, 128), BF16), "scale": 0.088}),
    "layernorm": ("mu[i] = mean[j](X[i,j]); v[i] = mean[j]((X[i,j] - mu[i])**2)\n"
                  "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(v[i] + 1e-5) * W[j] + B[j]", ["Y"],
                  {"X": ((4096, 4096), F32), "W": ((4096,), F32), "B": ((4096,), F32)}),
    "logsumexp": ("L[i] = logsumexp[j](X[i,j])", None, {"X": ((4096, 4096), F32)}),
    "matmul": ("C[i,j] = A[i,k] * B[k,j]", None, {"A": ((1024, 512), BF16), "B": ((512, 2048), BF16)}),
    # the position of each row's largest element: an ordered (non-commutative) fold
    "argmax": ("Y[i] = argmax[j](X[i,j], j)", None, {"X": ((1000, 4099), F32)}),
    # two differences of attentions: the two sums over k fused into one fold are two parts, each a
    # tl.dot (a product summary lowers part by part), and two rescaled structures share V's tile
    "differential_attention": ("O[h,i,j] = softmax[m](sum[k](Q1[h,i,k] * K1[h,m,k]) * scale) * V[h,m,j]"
                               " - lam * softmax[m](sum[k](Q2[h,i,k] * K2[h,m,k]) * scale) * V[h,m,j]", None,
                               {**{n: ((8, 1024, 64), BF16) for n in ("Q1", "K1", "Q2", "K2", "V")},
                                "scale": 0.125, "lam": 0.5}),
    # a row's sum, max and min in one fold: three parts, each accumulated in lanes
    "row_range": ("S[i] = sum[j](X[i,j])\nU[i] = max[j](X[i,j])\nL[i] = min[j](X[i,j])", ["S", "U", "L"],
                  {"X": ((4096, 4096), F32)}),
    # two outputs of different rank from one fold: the attention output and its row logsumexp
    # (8000 rows: enough programs that the fold is not split)
    "two_output_fold": ("S[i,m] = Q[i,k] * K[m,k] * scale\n"
                        "O[i,j] = softmax[m](S[i,m]) * V[m,j]\nL[i] = logsumexp[m](S[i,m])", ["O", "L"],
                        {"Q": ((8000, 64), F32), "K": ((777, 64), F32), "V": ((777, 64), F32), "scale": 0.125}),
    # on a Hopper GPU (sm_90): the warp-specialised Gluon form, its tl kernel as the fallback;
    # a window and the row logsumexp beside the output
    "hopper_window_attention": ("O[b,h,i,j] = softmax[m](where(m <= i and i - m < 256, "
                                "Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]\n"
                                "L[b,h,i] = logsumexp[m](where(m <= i and i - m < 256, "
                                "Q[b,h,i,k] * K[b,h,m,k] * scale, -inf))", ["O", "L"],
                                {n: ((2, 4, 1024, 128), BF16) for n in "QKV"} | {"scale": 0.088}),
    # a lookup through integer ids (a gathered subscript): the ids loaded, then the rows through them
    "embedding": ("Y[i,d] = E[T[i],d]", None, {"E": ((50257, 4096), BF16), "T": ((16384,), torch.int64)}),
    # its gradient, the scatter: each row of dE visits the ids equal to it, sorted per row of b
    "embedding_scatter": ("dE[s,d] = sum[b,t](where(T[b,t] == s, dX[b,t,d], 0.0))", None,
                          {"dX": ((8, 2048, 4096), BF16), "T": ((8, 2048), torch.int64), "s": 50257}),
    # a prefix result: t in order through each program, each tile scanned and the state carried on
    "logcumsumexp": ("L[b,t] = logsumexp[s](where(s <= t, X[b,s], -inf))", None,
                     {"X": ((4096, 4096), BF16), "t": 4096}),
    # few long rows: the chunks' totals first, then each chunk scanned from those before it
    "chunked_cumsum": ("C[b,t] = sum[s](where(s <= t, X[b,s], 0.0))", None, {"X": ((16, 262144), BF16), "t": 262144}),
}
ARCH = {"hopper_window_attention": 90}     # compute capability of the GPU a golden is generated for


def _input(spec):
    if not isinstance(spec, tuple):
        return spec
    shape, dtype = spec
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


def kernel_source(name: str) -> str:
    source, outputs, inputs = GOLDEN[name]
    program = compiler.compile(source, backend="triton", outputs=outputs)
    typed, binding = program._typed({k: _input(v) for k, v in inputs.items()})    # typed for integer inputs
    return typed.backend.source_for(binding, sm_count=H100_SMS, l2_bytes=H100_L2_BYTES, arch=ARCH.get(name))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_generated_kernels_match_the_golden_files(name):
    path = GOLDEN_DIR / f"{name}.py"
    assert kernel_source(name) == path.read_text(), \
        f"{path.name} differs: run `python3 tests/test_golden_kernels.py --update` and review the diff"


def test_every_golden_file_has_a_program():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.py")) == sorted(GOLDEN)


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in GOLDEN:
        (GOLDEN_DIR / f"{name}.py").write_text(kernel_source(name))
        print("wrote", GOLDEN_DIR / f"{name}.py")


# ---------------------------------------------------------------- naming: single-use temporaries
def test_a_temporary_read_once_is_written_into_its_use():
    from compiler.backend.triton.emit import inline_single_uses
    lines = ["t1 = tl.max(x0, 1)", "r_new = tl.maximum(r, t1)",
             "t2 = a + b", "y = t2 * c"]
    assert inline_single_uses(lines) == ["r_new = tl.maximum(r, tl.max(x0, 1))", "y = (a + b) * c"]


def test_a_temporary_is_not_moved_past_an_update_of_what_it_reads_nor_into_a_loop():
    from compiler.backend.triton.emit import inline_single_uses
    kept = [
        ["t1 = tl.abs(r)", "r = r_new", "y = t1"],                   # r changes in between
        ["t1 = tl.exp(x)", "for s in range(0, n, B):", "    y = t1"],  # a deeper block: once per iteration
        ["t1 = tl.exp(x)", "y = t1 + t1"],                             # read twice
    ]
    for lines in kept:
        assert inline_single_uses(lines) == lines
    # a name assigned by a tuple assignment in between blocks the move too
    assert inline_single_uses(["t1 = m + 1", "m, p = a, b", "y = t1"]) == ["t1 = m + 1", "m, p = a, b", "y = t1"]


# ---------------------------------------------------------------- dead definitions, shared address tiles
def test_a_definition_nothing_reads_is_dropped():
    from compiler.backend.triton.emit import drop_unread
    lines = ["offs_i = pid * B + tl.arange(0, B)", "mask_i = offs_i < n_i", "acc = tl.zeros([B], tl.float32)",
             "for start_k in range(0, n_k, B):",
             "    offs_k = start_k + tl.arange(0, B)",
             "    mask_k = offs_k < n_k",
             "    x = tl.load(X_tile + tl.cast(start_k, tl.int64) * s)",
             "    acc = acc + x",
             "tl.store(Y_ptr + offs_i, acc)"]
    assert drop_unread(lines) == [lines[0], *lines[2:4], *lines[6:]]


def test_a_definition_read_later_in_its_loop_carried_or_with_an_effect_stays():
    from compiler.backend.triton.emit import drop_unread
    kept = [
        # loop-carried: defined before the loop, updated in it, read by the next iteration
        ["r = tl.zeros([B], tl.float32)", "for s in range(0, n, B):", "    r_new = r + 1", "    r = r_new",
         "tl.store(Y_ptr, r)"],
        # defined inside an if, read after it in the same loop body
        ["for s in range(0, n, B):", "    if c:", "        t = x + 1", "    y = t", "    tl.store(Y_ptr, y)"],
        # an atomic's result unread: the atomic still happens
        ["count = tl.atomic_add(C_ptr, 1)", "tl.store(Y_ptr, 0)"],
    ]
    for lines in kept:
        assert drop_unread(lines) == lines
    # the interior loop's offsets are dead though the boundary loop after it defines and reads its own
    two_loops = ["acc = tl.zeros([B], tl.float32)",
                 "for s in range(0, m, B):", "    offs_m = s + tl.arange(0, B)", "    acc = acc + 1",
                 "for s in range(m, n, B):", "    offs_m = s + tl.arange(0, B)", "    acc = acc + offs_m",
                 "tl.store(Y_ptr, acc)"]
    assert drop_unread(two_loops) == [*two_loops[:2], *two_loops[3:]]
    # an update nothing reads afterwards (not carried out of its block) is dead too
    body = ["acc = tl.zeros([B], tl.float32)", "for s in range(0, n, B):", "    t = x + 1", "    t = t * 2",
            "    acc = acc + x", "tl.store(Y_ptr, acc)"]
    assert drop_unread(body) == [*body[:2], *body[4:]]


def test_the_copies_of_a_loop_share_one_tile_of_addresses():
    from compiler.backend.triton.emit import one_per_tile
    lines = ["K_tile = K_ptr + tl.arange(0, B)[None, :] * s",
             "K_tile_2 = K_ptr + tl.arange(0, B)[None, :] * s",
             "V_tile = V_ptr + tl.arange(0, B)[:, None] * s",
             "for start_m in range(0, mid, B):", "    k = tl.load(K_tile_2 + start_m * s)",
             "for start_m in range(mid, hi, B):", "    k = tl.load(K_tile + start_m * s)"]
    merged = one_per_tile(lines, {"K_tile", "K_tile_2", "V_tile"})
    assert merged == [lines[0], lines[2], lines[3], "    k = tl.load(K_tile + start_m * s)", *lines[5:]]
    # a twin in a deeper block is another scope's variable: kept
    nested = ["K_tile = K_ptr + o", "for s in range(0, n, B):", "    K_tile_2 = K_ptr + o", "    k = K_tile_2"]
    assert one_per_tile(nested, {"K_tile", "K_tile_2"}) == nested
