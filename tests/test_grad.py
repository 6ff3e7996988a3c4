"""Gradients: reverse mode in index notation against float64 torch autograd.

Every case runs a compiled program under torch autograd (Program.__call__ goes
through compiler/autograd.py when an input requires grad) and compares the
.grad of each input with torch autograd of the same function written by hand
in torch, in float64.  The reference backend runs in float64; the Triton
backend runs its kernels under the interpreter on CPU (conftest), in float32,
on tiny ragged sizes."""
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest

import torch

import compiler
from compiler.algebra import BUILTINS
from compiler.check import check
from compiler.cli import main
from compiler.errors import CheckError
from compiler.ir import Access, Call, Composite, Const, Reduce, format_expr, format_program, walk
from compiler.ops import BOOL, OPS
from compiler.parse import parse
from compiler.passes import run_pipeline
from compiler.passes.differentiate import REDUCTIONS, differentiate

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")

BACKENDS = ["reference", "triton"]
DTYPE = {"reference": torch.float64, "triton": torch.float32}
TOL = {"reference": {"rtol": 1e-9, "atol": 1e-9}, "triton": {"rtol": 2e-4, "atol": 2e-4}}
# the Triton backend runs compiled kernels on the GPU machine, the interpreter on CPU
DEVICE = {"reference": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}


@pytest.fixture(autouse=True)
def _cache(private_cache):
    """Generated modules go to a temporary folder."""


def randn(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed * 1009 + sum(shape) + len(shape))
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def check_gradients(source, reference, inputs, wrt, backend, outputs=None, seed=1):
    """Run `source` under autograd with the inputs in `wrt` requiring grad, and
    compare outputs and .grad with `reference` (a torch function of the same
    keyword inputs, float64, returning one tensor or a tuple in statement order)."""
    program = compiler.compile(source, backend=backend, outputs=outputs)
    dtype, device = DTYPE[backend], DEVICE[backend]
    ours = {n: (v.to(device, dtype if v.is_floating_point() else v.dtype, copy=True).requires_grad_(n in wrt)
                if isinstance(v, torch.Tensor) else v) for n, v in inputs.items()}
    theirs = {n: (v.clone().requires_grad_(n in wrt) if isinstance(v, torch.Tensor) else v)
              for n, v in inputs.items()}
    got = program(**ours)
    got = got if isinstance(got, tuple) else (got,)
    want = reference(**theirs)
    want = want if isinstance(want, tuple) else (want,)
    tol = TOL[backend]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.detach().double().cpu(), w.detach(), **tol)
    flowing = [k for k, w in enumerate(want) if w.requires_grad]      # outputs that depend on a wrt input
    upstream = [randn(*want[k].shape, seed=seed + k) for k in flowing]
    torch.autograd.backward([got[k] for k in flowing], [u.to(device, dtype) for u in upstream])
    torch.autograd.backward([want[k] for k in flowing], upstream)
    for name in inputs:
        if name in wrt:
            assert ours[name].grad is not None, name
            assert ours[name].grad.dtype == ours[name].dtype and ours[name].grad.shape == ours[name].shape
            expected = theirs[name].grad                 # None: torch's graph does not reach it
            expected = torch.zeros_like(theirs[name]) if expected is None else expected
            torch.testing.assert_close(ours[name].grad.double().cpu(), expected, **tol, msg=name)
        elif isinstance(ours[name], torch.Tensor):
            assert ours[name].grad is None, name
    return program


# ---------------------------------------------------------------- the corpus
def _attention(Q, K, V, scale, mask=None, bias=0.0):
    s = Q @ K.transpose(-1, -2) * scale + bias
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, dim=-1) @ V


def _causal(n, m):
    return torch.arange(m)[None, :] <= torch.arange(n)[:, None]


def _layernorm(X, G, B):
    mu = X.mean(-1, keepdim=True)
    var = ((X - mu) ** 2).mean(-1, keepdim=True)
    return (X - mu) * torch.rsqrt(var + 1e-5) * G + B


CORPUS = {
    "matmul": ("C[i,j] = A[i,k] * B[k,j]",
               lambda A, B: A @ B,
               lambda: {"A": randn(5, 3), "B": randn(3, 7)}, ("A", "B")),
    "attention": ("O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]",
                  lambda Q, K, V, scale: _attention(Q, K, V, scale),
                  lambda: {"Q": randn(5, 3), "K": randn(7, 3), "V": randn(7, 2), "scale": 0.6},
                  ("Q", "K", "V")),
    "causal": ("O[i,j] = softmax[m](where(m <= i, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]",
               lambda Q, K, V, scale: _attention(Q, K, V, scale, _causal(5, 5)),
               lambda: {"Q": randn(5, 3), "K": randn(5, 3), "V": randn(5, 2), "scale": 0.6},
               ("Q", "K", "V")),
    "softcap": ("O[i,j] = softmax[m](c * tanh(Q[i,k] * K[m,k] / c)) * V[m,j]",
                lambda Q, K, V, c: torch.softmax(c * torch.tanh(Q @ K.T / c), -1) @ V,
                lambda: {"Q": randn(5, 3), "K": randn(7, 3), "V": randn(7, 2), "c": 1.5},
                ("Q", "K", "V")),
    "bias": ("O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale + Bias[i,m]) * V[m,j]",
             lambda Q, K, V, Bias, scale: _attention(Q, K, V, scale, bias=Bias),
             lambda: {"Q": randn(5, 3), "K": randn(7, 3), "V": randn(7, 2), "Bias": randn(5, 7), "scale": 0.6},
             ("Q", "K", "V", "Bias")),
    "alibi": ("O[h,i,j] = softmax[m](Q[h,i,k] * K[h,m,k] * scale - A[h] * abs(i - m)) * V[h,m,j]",
              lambda Q, K, V, A, scale: _attention(
                  Q, K, V, scale, bias=-A[:, None, None] * (torch.arange(5)[:, None] - torch.arange(7)[None]).abs()),
              lambda: {"Q": randn(2, 5, 3), "K": randn(2, 7, 3), "V": randn(2, 7, 2), "A": randn(2).abs(),
                       "scale": 0.6},
              ("Q", "K", "V", "A")),
    "gqa": ("O[g,r,i,j] = softmax[m](Q[g,r,i,k] * K[g,m,k] * scale) * V[g,m,j]",
            lambda Q, K, V, scale: _attention(Q, K[:, None], V[:, None], scale),
            lambda: {"Q": randn(2, 3, 5, 3), "K": randn(2, 7, 3), "V": randn(2, 7, 2), "scale": 0.6},
            ("Q", "K", "V")),
    "sink": ("O[h,i,j] = sum[m](exp(sum[k](Q[h,i,k] * K[h,m,k]) * scale) * V[h,m,j]) / "
             "(sum[m](exp(sum[k](Q[h,i,k] * K[h,m,k]) * scale)) + exp(S[h]))",
             lambda Q, K, V, S, scale: (torch.exp(Q @ K.transpose(-1, -2) * scale) @ V) / (
                 torch.exp(Q @ K.transpose(-1, -2) * scale).sum(-1, keepdim=True) + torch.exp(S)[:, None, None]),
             lambda: {"Q": randn(2, 5, 3), "K": randn(2, 7, 3), "V": randn(2, 7, 2), "S": randn(2), "scale": 0.6},
             ("Q", "K", "V", "S")),
    "output_and_lse": ("S[i,m] = Q[i,k] * K[m,k] * scale\n"
                       "O[i,j] = softmax[m](S[i,m]) * V[m,j]\n"
                       "L[i] = logsumexp[m](S[i,m])",
                       lambda Q, K, V, scale: (_attention(Q, K, V, scale), torch.logsumexp(Q @ K.T * scale, -1)),
                       lambda: {"Q": randn(5, 3), "K": randn(7, 3), "V": randn(7, 2), "scale": 0.6},
                       ("Q", "K", "V")),
    "softmax": ("P[i,j] = softmax[j](X[i,j])",
                lambda X: torch.softmax(X, -1),
                lambda: {"X": randn(3, 7)}, ("X",)),
    "logsumexp": ("L[i] = logsumexp[j](X[i,j])",
                  lambda X: torch.logsumexp(X, -1),
                  lambda: {"X": randn(3, 7)}, ("X",)),
    "layernorm": ("mu[i] = mean[k](X[i,k])\n"
                  "var[i] = mean[k]((X[i,k] - mu[i]) ** 2)\n"
                  "Y[i,k] = (X[i,k] - mu[i]) * rsqrt(var[i] + 1e-5) * G[k] + B[k]",
                  _layernorm,
                  lambda: {"X": randn(3, 7), "G": randn(7), "B": randn(7)}, ("X", "G", "B")),
    "rmsnorm": ("Y[i,k] = X[i,k] * rsqrt(mean[n](X[i,n] ** 2) + eps) * G[k]",
                lambda X, G, eps: X * torch.rsqrt((X ** 2).mean(-1, keepdim=True) + eps) * G,
                lambda: {"X": randn(3, 7), "G": randn(7), "eps": 1e-6}, ("X", "G")),
    "cross_entropy": ("L[i] = logsumexp[v](sum[k](H[i,k] * W[v,k])) - sum[v, k](Y[i,v] * H[i,k] * W[v,k])",
                      lambda H, W, Y: torch.nn.functional.cross_entropy(H @ W.T, Y, reduction="none"),
                      lambda: {"H": randn(5, 3), "W": randn(11, 3),
                               "Y": torch.nn.functional.one_hot(torch.tensor([0, 3, 10, 3, 1]), 11).double()},
                      ("H", "W")),
    "elementwise_chain": ("Y[i,j] = silu(X[i,j]) * sigmoid(G[j]) + tanh(X[i,j] / 2) ** 2 - log(1 + exp(G[j]))",
                          lambda X, G: (torch.nn.functional.silu(X) * torch.sigmoid(G) + torch.tanh(X / 2) ** 2
                                        - torch.log(1 + torch.exp(G))),
                          lambda: {"X": randn(3, 7), "G": randn(7)}, ("X", "G")),
    # affine subscripts: the transposed convolution, a stride's scatter, pooling windows (sizes)
    "convolution": ("Y[b,o,t] = sum[c,r](W[o,c,r] * X[b,c,t+r])",
                    lambda X, W: torch.nn.functional.conv1d(X, W),
                    lambda: {"X": randn(2, 3, 9), "W": randn(4, 3, 3)}, ("X", "W")),
    "strided_convolution": ("Y[b,o,t] = sum[c,r](W[o,c,r] * X[b,c,2*t+r-1])",
                            lambda X, W: torch.nn.functional.conv1d(X, W, stride=2, padding=1)[..., :4],
                            lambda: {"X": randn(2, 3, 9), "W": randn(4, 3, 3)}, ("X", "W")),
    "max_pool": ("P[b,c,t] = max[r](X[b,c,2*t+r])",
                 lambda X, r: torch.nn.functional.max_pool1d(X, r, 2),
                 lambda: {"X": randn(2, 3, 9), "r": 2}, ("X",)),
    "average_pool": ("P[b,c,t] = mean[r](X[b,c,3*t+r])",
                     lambda X, r: torch.nn.functional.avg_pool1d(X, r, 3),
                     lambda: {"X": randn(2, 3, 11), "r": 3}, ("X",)),
    "pooled_convolution": ("Y[b,o,t] = sum[c,r](W[o,c,r] * X[b,c,t+r])\nP[b,o,u] = max[q](Y[b,o,2*u+q])",
                           lambda X, W, q: torch.nn.functional.max_pool1d(torch.nn.functional.conv1d(X, W), q),
                           lambda: {"X": randn(2, 3, 10), "W": randn(4, 3, 3), "q": 2}, ("X", "W")),
    # gathered subscripts: the scatter of an embedding lookup, a label's logit (integer targets, ignore_index)
    "embedding": ("Y[i,d] = E[T[i],d]", lambda E, T: torch.nn.functional.embedding(T, E),
                  lambda: {"E": randn(11, 4), "T": torch.tensor([0, 10, 3, 3, 7])}, ("E",)),
    "labelled_cross_entropy": ("L[i] = where(Y[i] == -100, 0, logsumexp[c](X[i,c]) - X[i,Y[i]])",
                               lambda X, Y: torch.nn.functional.cross_entropy(X, Y, reduction="none"),
                               lambda: {"X": randn(5, 7), "Y": torch.tensor([0, 6, -100, 3, 3])}, ("X",)),
    # prefix results (scans): their gradients are suffixes
    "cumsum": ("C[b,t] = sum[s](where(s <= t, X[b,s], 0.0))", lambda X, t: X.cumsum(1),
               lambda: {"X": randn(3, 9), "t": 9}, ("X",)),
    "weighted_exclusive_cumsum": ("C[b,t] = sum[s](where(s < t, X[b,s], 0.0)) * W[b,t]",
                                  lambda X, W: (X.cumsum(1) - X) * W,
                                  lambda: {"X": randn(3, 9), "W": randn(3, 9)}, ("X", "W")),
    "logcumsumexp": ("L[b,t] = logsumexp[s](where(s <= t, X[b,s], -inf))", lambda X, t: X.logcumsumexp(1),
                     lambda: {"X": randn(3, 9), "t": 9}, ("X",)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CORPUS))
def test_corpus_gradients_match_torch(case, backend):
    source, reference, make, wrt = CORPUS[case]
    check_gradients(source, reference, make(), wrt, backend)


RECOMPUTED = ["attention", "softcap", "bias", "alibi", "gqa", "sink", "output_and_lse", "cross_entropy"]


@pytest.mark.parametrize("case", RECOMPUTED)
def test_the_recomputing_backward_on_triton_matches_float64(case):
    # compiler.grad's default recomputes the forward's statistics; its kernels read the row
    # states dQ stores and contract split values with tl.dot (twenty-third session)
    source, _, make, wrt = CORPUS[case]
    inputs = make()
    forward = compiler.compile(source, backend="reference")
    out = forward(**inputs)
    out = out if isinstance(out, tuple) else (out,)
    upstream = {f"d{name}": randn(*o.shape, seed=7 + k)
                for k, (name, o) in enumerate(zip(forward.outputs, out))}
    ours = compiler.grad(source, wrt=wrt, backend="triton")
    oracle = compiler.grad(source, wrt=wrt, backend="reference")
    given = {**inputs, **upstream}
    want = oracle(**{n: v for n, v in given.items() if n in oracle.inputs})
    got = ours(**{n: (v.to(DEVICE["triton"], torch.float32) if isinstance(v, torch.Tensor) else v)
                  for n, v in given.items() if n in ours.inputs})
    got, want = (r if isinstance(r, tuple) else (r,) for r in (got, want))
    for name, g, w in zip(wrt, got, want, strict=True):
        torch.testing.assert_close(g.double().cpu(), w, **TOL["triton"], msg=name)


@pytest.mark.parametrize("mask", ["m <= i", "m <= i and i - m < 70"])
def test_a_masked_backward_over_several_tiles_matches_float64(mask):
    """Rows and keys over three tiles of 64, so that dQ's loop over m has interior
    tiles (the mask holds everywhere: run without it) beside boundary ones.  Inside
    that loop, the row's softmax statistics are a fold over m of their own, mask and
    all: assuming the outer loop's relation must not unmask them (it did: dQ was
    off by 0.3 at n = 200, every tile past the first)."""
    source = f"O[i,j] = softmax[m](where({mask}, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]"
    n = 150
    given = {"Q": randn(n, 8, seed=1), "K": randn(n, 8, seed=2), "V": randn(n, 4, seed=3), "scale": 0.5,
             "dO": randn(n, 4, seed=4)}
    want = compiler.grad(source, backend="reference")(**given)
    got = compiler.grad(source, backend="triton")(**{k: v.to(DEVICE["triton"], torch.float32)
                                                    if isinstance(v, torch.Tensor) else v for k, v in given.items()})
    for name, g, w in zip(("dQ", "dK", "dV"), got, want, strict=True):
        torch.testing.assert_close(g.double().cpu(), w, **TOL["triton"], msg=name)


@pytest.mark.parametrize("mask", [None, "m <= i"])
def test_the_saved_backward_over_ragged_whole_head_dimensions_matches_float64(mask):
    """Head dimensions 24 and 40, held whole in tiles of 32 and 64 (masked past the
    extent) by dK's grid and by the sums over k and j nested in its loop over the
    queries, which share those tiles: Q and dO are loaded once a step and read both
    ways; dQ's epilogue over k is the tile the scores' sum reduces.  Rows and keys over
    three tiles of 64, with a causal mask's interior and boundary tiles."""
    logits = "Q[i,k] * K[m,k] * scale"
    source = f"O[i,j] = softmax[m]({logits if mask is None else f'where({mask}, {logits}, -inf)'}) * V[m,j]"
    n = 150
    inputs = {"Q": randn(n, 24, seed=1), "K": randn(n, 24, seed=2), "V": randn(n, 40, seed=3), "scale": 0.3}
    forward = compiler.compile(source, backend="reference")
    saved = dict(zip(forward._saving.outputs, forward._saving(**inputs)))       # float64 statistics
    given = {**inputs, **saved, "dO": randn(n, 40, seed=4)}
    backward = compiler.grad(source, saved=True, backend="triton")
    oracle = compiler.grad(source, saved=True, backend="reference")
    want = oracle(**{k: v for k, v in given.items() if k in oracle.inputs})
    got = backward(**{k: v.to(DEVICE["triton"], torch.float32) if isinstance(v, torch.Tensor) else v
                      for k, v in given.items() if k in backward.inputs})
    for name, g, w in zip(("dQ", "dK", "dV"), got, want, strict=True):
        torch.testing.assert_close(g.double().cpu(), w, **TOL["triton"], msg=name)
    # one axis each: no second tile of k (nor of j in dK's kernel), the other layout read as tl.trans
    dk = backward.source.split("def einfold_dK(")[1].split("\ndef launch(")[0]
    assert "BLOCK_k2" not in backward.source and "BLOCK_j2" not in dk
    assert "tl.trans(x_Q" in dk and "tl.trans(x_dO" in dk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_on_triton(dtype):
    # storage in half precision, folds in float32: errors of the order of the inputs' rounding
    source, reference, make, wrt = CORPUS["causal"]
    program = compiler.compile(source, backend="triton")
    inputs = {k: (v.to(dtype).double() if isinstance(v, torch.Tensor) else v) for k, v in make().items()}
    device = DEVICE["triton"]
    ours = {k: (v.to(device, dtype).requires_grad_() if isinstance(v, torch.Tensor) else v)
            for k, v in inputs.items()}
    theirs = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    upstream = randn(5, 2, seed=9).to(dtype)
    program(**ours).backward(upstream.to(device))
    reference(**theirs).backward(upstream.double())
    for name in wrt:
        assert ours[name].grad.dtype == dtype
        torch.testing.assert_close(ours[name].grad.double().cpu(), theirs[name].grad, rtol=2e-2, atol=2e-2)


def test_gradient_programs_of_the_corpus_print_parse_back_and_compile():
    for case, (source, _, _, wrt) in CORPUS.items():
        backward = differentiate(check(parse(source)), wrt)
        text = format_program(backward)
        again = check(parse(text), outputs=backward.outputs)
        assert format_program(again) == text, case
        assert again.outputs == tuple(f"d{x}" for x in wrt), case
        run_pipeline(again)


def test_attention_backward_is_the_flash_attention_algebra():
    # dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = dS K, dK = dS^T Q, dV = P^T dO
    backward = differentiate(check(parse(CORPUS["attention"][0])), ("Q", "K", "V"))
    p = "softmax[m](sum[k](Q[i, k] * K[m, k]) * scale)"
    assert format_program(backward) == (
        "dO_1[i, m] = sum[j](dO[i, j] * V[m, j])\n"
        f"dO_2[i, m] = {p} * (dO_1[i, m] - sum[m]({p} * dO_1[i, m])) * scale\n"
        "dQ[i, k] = sum[m](dO_2[i, m] * K[m, k])\n"
        "dK[m, k] = sum[i](dO_2[i, m] * Q[i, k])\n"
        f"dV[m, j] = sum[i](dO[i, j] * {p})\n")


# ---------------------------------------------------------------- the ops table's adjoint column
def _positive(n, seed):
    return randn(n, seed=seed).abs() + 0.3


def _elementwise_case(op, seed=0, prefix=""):
    """(term of the language, its torch meaning over the inputs, the inputs, the inputs with a gradient)
    for one differentiable row of the ops table."""
    n = 7
    x, w = f"{prefix}X", f"{prefix}W"
    if op == "where":
        term = f"where({prefix}C[i] > 0, {x}[i], {w}[i])"
        inputs = {f"{prefix}C": randn(n, seed=seed + 2), x: randn(n, seed=seed), w: randn(n, seed=seed + 1)}
        return term, lambda v: torch.where(v[f"{prefix}C"] > 0, v[x], v[w]), inputs, (x, w)
    arity = OPS[op].arity
    term = format_expr(Call(op, tuple(Access(name, ("i",)) for name in (x, w)[:arity])))
    if op in ("log", "log2", "sqrt", "rsqrt", "pow"):
        first = _positive(n, seed)                       # inside the domain
    else:
        first = randn(n, seed=seed)
        first[0] = 0.0                                   # abs and relu at 0: subgradient 0
    inputs = {x: first}
    if arity == 2:
        inputs[w] = randn(n, seed=seed + 1)
        inputs[w][1:3] = first[1:3]                      # ties of max and min share the gradient
    names = tuple(inputs)
    return term, lambda v: OPS[op].torch(*(v[k] for k in names)), inputs, names


DIFFERENTIABLE = sorted(op for op, row in OPS.items() if row.adjoint is not None)


def test_every_row_without_an_adjoint_is_a_predicate():
    for op, row in OPS.items():
        if row.adjoint is None:
            assert row.result(("bool",) * row.arity) == BOOL or row.result(("float",) * row.arity) == BOOL, op


@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_adjoint_column_matches_torch(op):
    term, meaning, inputs, wrt = _elementwise_case(op)
    check_gradients(f"Y[i] = {term}", lambda **v: meaning(v), inputs, wrt, "reference")


def test_adjoint_column_on_triton():
    # every differentiable row in one program: each input's gradient comes from its own row
    terms, meanings, inputs, wrt = [], [], {}, []
    for k, op in enumerate(DIFFERENTIABLE):
        term, meaning, ins, names = _elementwise_case(op, seed=k, prefix=f"{op}_")
        terms.append(term)
        meanings.append(meaning)
        inputs.update(ins)
        wrt.extend(names)
    check_gradients("Y[i] = " + " + ".join(terms), lambda **v: sum(m(v) for m in meanings), inputs, tuple(wrt),
                    "triton")


def test_predicates_and_index_values_carry_no_gradient():
    source = "Y[i] = where(X[i] > W[i], 1.0, 0.0) * Z[i] + X[i] * i"
    program = check_gradients(source, lambda X, W, Z: (X > W).double() * Z + X * torch.arange(5),
                              {"X": randn(5), "W": randn(5, seed=1), "Z": randn(5, seed=2)}, ("X", "W", "Z"),
                              "reference")
    backward = program._gradient(("X", "W", "Z")).text
    assert "dW[i] = 0.0 * W[i] ** 0\n" in backward


# ---------------------------------------------------------------- reductions
def test_every_builtin_reduction_has_an_adjoint():
    assert set(REDUCTIONS) == set(BUILTINS)


def _ties():
    x = randn(4, 6)
    x[0, 1] = x[0, 4] = x[0].max() + 1.0          # a tied maximum
    x[1, 0] = x[1, 2] = x[1, 5] = x[1].min() - 1  # a three-way tied minimum
    x[2] = 0.5                                    # a constant row: everything ties
    return x


def _points():
    x, y = randn(5, 3), randn(4, 3, seed=1)
    y[3] = y[1]                                   # a duplicated point: its distances tie
    x[0] = y[1] + 0.01                            # nearest to both copies
    return {"X": x, "Y": y}


def _at_first_min(d):
    """d's row minimum, with the gradient at its first minimum (as torch.min(dim))."""
    return d.gather(1, d.argmin(1, keepdim=True))[:, 0]


def _zeros():
    x = randn(4, 5) + 0.1
    x[1, 2] = 0.0                                 # one zero: only it gets a gradient
    x[2, 0] = x[2, 3] = 0.0                       # two zeros: none does
    return x


REDUCTION_CASES = {
    "max_min_ties": ("Y[i] = max[k](X[i,k]) + 2 * min[k](X[i,k])",
                     lambda X: X.amax(-1) + 2 * X.amin(-1), lambda: {"X": _ties()}, ("X",)),
    # the minimum of a value that folds (a distance) gives its gradient to the first
    # minimum: the comparison of a recomputed fold with the forward's minimum is not exact
    # on the GPU (test_gpu_a_minimum_of_distances_has_its_gradient_in_every_row)
    "min_of_a_fold": ("C[i] = min[m](sum[k]((X[i,k] - Y[m,k]) ** 2))",
                      lambda X, Y: _at_first_min(((X[:, None] - Y[None]) ** 2).sum(-1)), _points, ("X", "Y")),
    "max_of_a_product": ("C[i] = max[m](sum[k](X[i,k] * Y[m,k]))",
                         lambda X, Y: -_at_first_min(-(X @ Y.T)), _points, ("X", "Y")),
    "prod_zeros": ("Y[i] = prod[k](X[i,k])", lambda X: X.prod(-1), lambda: {"X": _zeros()}, ("X",)),
    "sum_broadcast": ("Y[i] = sum[k](X[i,k]) * s + mean[k](X[i,k])",
                      lambda X, s: X.sum(-1) * s + X.mean(-1), lambda: {"X": randn(3, 5), "s": 1.5}, ("X",)),
    # argmax and argmin apart: together they cost factorise seconds
    "argmax": ("Y[i] = argmax[k](X[i,k], P[i,k]) * 2",
               lambda X, P: P.gather(1, X.argmax(1, keepdim=True))[:, 0] * 2,
               lambda: {"X": _ties(), "P": randn(4, 6, seed=3)}, ("P",)),
    "argmin": ("Y[i] = argmin[k](X[i,k], P[i,k])",
               lambda X, P: P.gather(1, X.argmin(1, keepdim=True))[:, 0],
               lambda: {"X": _ties(), "P": randn(4, 6, seed=3)}, ("P",)),
    "diagonal": ("d[i] = S[i,i] * W[i]\nt = S[i,i]",
                 lambda S, W: (torch.diagonal(S) * W, torch.diagonal(S).sum()),
                 lambda: {"S": randn(5, 5), "W": randn(5, seed=1)}, ("S", "W")),
    "scalar_tensor": ("Y[i] = X[i] * s + t", lambda X, s, t: X * s + t,
                      lambda: {"X": randn(5), "s": torch.tensor(0.7, dtype=torch.float64),
                               "t": torch.tensor(-0.2, dtype=torch.float64)}, ("X", "s")),
    "shadowed": ("Y[i] = sum[k](A[i,k] * sum[k](B[k]))", lambda A, B: (A * B.sum()).sum(-1),
                 lambda: {"A": randn(3, 4), "B": randn(4, seed=1)}, ("A", "B")),
    "self_product": ("S[i,m] = X[i,k] * X[m,k]\nY[i] = logsumexp[m](S[i,m])",
                     lambda X: torch.logsumexp(X @ X.T, -1), lambda: {"X": randn(5, 3)}, ("X",)),
    "transpose": ("Y[i,j] = X[j,i] * X[i,j]", lambda X: X.T * X, lambda: {"X": randn(4, 4)}, ("X",)),
    # m has its extent from W only, which dX does not read: dX reads it as prod[n_1](W[m, n_1] ** 0)
    "extent_elsewhere": ("Y[i] = sum[m](where(m <= i, 1.0, 0.0)) * X[i]\nZ[m, n] = W[m, n] * 2",
                         lambda X, W: ((torch.arange(6)[None] <= torch.arange(6)[:, None]).sum(1) * X, W * 2),
                         lambda: {"X": randn(6), "W": randn(6, 2, seed=1)}, ("X",)),
    "several_indices": ("P[i,m,n] = softmax[m,n](X[i,m,n])\nL[i] = logsumexp[m,n](X[i,m,n]) + mean[m,n](X[i,m,n] ** 2)",
                        lambda X: (torch.softmax(X.flatten(1), -1).view(X.shape),
                                   torch.logsumexp(X.flatten(1), -1) + (X ** 2).mean((1, 2))),
                        lambda: {"X": randn(2, 3, 5)}, ("X",)),
    "one": ("O[i,j] = softmax[m](Q[i,k] * K[m,k]) * V[m,j]", lambda Q, K, V: _attention(Q, K, V, 1.0),
            lambda: {"Q": randn(1, 1), "K": randn(1, 1), "V": randn(1, 1)}, ("Q", "K", "V")),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_reductions_and_reads(case, backend):
    source, reference, make, wrt = REDUCTION_CASES[case]
    check_gradients(source, reference, make(), wrt, backend)


def _rounds(e) -> bool:
    """Whether `e` holds a fold that rounds (a sum, a mean, a composite): a max, min or
    arg-fold of exact values picks one of them."""
    return any(isinstance(n, Composite) or isinstance(n, Reduce) and n.summary.name not in EXACT_FOLDS
               for n in walk(e))


EXACT_FOLDS = ("max", "min", "argmax", "argmin")


@pytest.mark.parametrize("case", sorted({**CORPUS, **REDUCTION_CASES}))
def test_no_derived_gradient_tests_a_recomputed_fold_for_equality_with_another_value(case):
    # a fold recomputed by the gradient program rounds as that kernel's tiles and reduction
    # tree make it, not as the forward's did: an equality between it and another computed
    # value (the forward's output, another evaluation) holds on the interpreter and fails on
    # the GPU (a Chamfer distance's minimum matched none of its recomputed distances).  An
    # arg-fold's position is an exact integer; a comparison with a constant is left to the
    # rule that makes it (prod's zeros)
    source, _, _, wrt = {**CORPUS, **REDUCTION_CASES}[case]
    derived = differentiate(check(parse(source)), wrt)
    for statement in derived.statements:
        for n in walk(statement.expr):
            if isinstance(n, Call) and n.op == "eq" and not any(isinstance(a, Const) for a in n.args):
                positions = [isinstance(a, Reduce) and a.summary.name.startswith("arg") for a in n.args]
                assert not any(_rounds(a) and not exact for a, exact in zip(n.args, positions)), \
                    f"{case}: {format_expr(n)}"


@pytest.mark.parametrize("case", ["min_of_a_fold", "max_of_a_product"])
def test_spellings_of_an_extremum_over_a_fold_derive_gradients_that_schedule_alike(case):
    # renamed bound indices, swapped operands and re-associated products of the programs
    # whose gradient rule changed give one gradient program and one schedule
    import random

    from compiler.schedule import schedule
    from test_discovery import _commute, _rename_bound
    source, _, _, wrt = REDUCTION_CASES[case]
    checked = check(parse(source))
    derived = differentiate(checked, wrt)
    a = run_pipeline(derived)
    assert "argm" in format_program(a)
    for seed in range(5):
        rng = random.Random(seed)
        # a gradient is indexed as its input was written: dX takes the names of X's subscript,
        # which renaming the forward's bound indices renames; named back, statement by statement
        b = run_pipeline(_indexed_as(differentiate(_commute(_rename_bound(checked, rng), rng), wrt), derived))
        assert format_program(a) == format_program(b), seed
        assert str(schedule(a, a.outputs)) == str(schedule(b, b.outputs)), seed


def _indexed_as(program, like):
    """`program` with each statement's own indices renamed to those of `like`'s statement of
    that name (an alpha-renaming: the same statements)."""
    from compiler.passes.fuse import rename_indices
    extents = dict(program.extents)
    names = iter(f"renamed{k}" for k in range(1000))

    def fresh(name: str) -> str:
        new = next(names)
        extents[new] = extents[name]
        return new
    theirs = {st.name: st for st in like.statements}
    statements = []
    for st in program.statements:
        target = theirs[st.name].indices
        mapping = {mine: name for mine, name in zip(st.indices, target) if mine != name}
        extents.update({name: extents[mine] for mine, name in mapping.items()})
        statements.append(replace(st, indices=target, expr=rename_indices(st.expr, mapping, fresh)))
    return replace(program, statements=tuple(statements), extents=tuple(sorted(extents.items())))


def test_intermediate_outputs_take_both_gradients():
    source = "P[i,m] = softmax[m](X[i,m])\nO[i,j] = P[i,m] * V[m,j]"
    reference = lambda X, V: (torch.softmax(X, -1), torch.softmax(X, -1) @ V)
    check_gradients(source, reference, {"X": randn(4, 6), "V": randn(6, 3)}, ("X", "V"), "reference",
                    outputs=["O", "P"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_output_backward_does_not_reach_gets_zeros(backend):
    source, _, make, _ = CORPUS["output_and_lse"]
    program = compiler.compile(source, backend=backend)
    inputs = {k: (v.to(DEVICE[backend], DTYPE[backend]).requires_grad_() if isinstance(v, torch.Tensor) else v)
              for k, v in make().items()}
    out, _ = program(**inputs)
    out.sum().backward()
    ref = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in make().items()}
    _attention(ref["Q"], ref["K"], ref["V"], ref["scale"]).sum().backward()
    for name in ("Q", "K", "V"):
        torch.testing.assert_close(inputs[name].grad.double().cpu(), ref[name].grad, **TOL[backend])


# ---------------------------------------------------------------- autograd
def test_only_inputs_that_require_grad_get_one_and_the_program_is_compiled_per_set():
    source, reference, make, _ = CORPUS["attention"]
    source += "  # a text no other test compiles: its op and gradient programs are this test's"
    program = check_gradients(source, reference, make(), ("K",), "reference")
    assert list(program._gradients) == [(("K",), True)]        # reading the saved statistics
    # an equal program compiled again shares the first one's op, and so its gradient programs
    check_gradients(source, reference, make(), ("V", "Q"), "reference")
    assert list(program._gradients) == [(("K",), True), (("Q", "V"), True)]
    inputs = {k: (v.requires_grad_() if k == "K" else v) for k, v in make().items()}
    program(**inputs).sum().backward()
    assert list(program._gradients) == [(("K",), True), (("Q", "V"), True)]        # compiled once, reused


def test_second_derivatives():
    program = compiler.compile("Y[i] = tanh(X[i]) * W[i]", backend="reference")
    x, w = randn(4).requires_grad_(), randn(4, seed=1).requires_grad_()
    dx, = torch.autograd.grad(program(X=x, W=w).sum(), x, create_graph=True)
    (dx * dx).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dx2, = torch.autograd.grad((torch.tanh(x2) * w2).sum(), x2, create_graph=True)
    (dx2 * dx2).sum().backward()
    torch.testing.assert_close(dx, dx2)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_no_grad_and_no_input_requiring_grad_save_nothing():
    program = compiler.compile(CORPUS["attention"][0], backend="reference")
    inputs = CORPUS["attention"][2]()
    out = program(**inputs)
    assert out.grad_fn is None and not out.requires_grad
    with torch.no_grad():
        needing = {k: (v.requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        out = program(**needing)
    assert out.grad_fn is None and not out.requires_grad
    assert program._gradients == {} and program._ops == {}        # no custom op, no gradient program


def test_a_python_number_gets_no_gradient_a_zero_d_tensor_does():
    program = compiler.compile("Y[i] = X[i] * s * t", backend="reference")
    x, s = randn(4).requires_grad_(), torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    program(X=x, s=s, t=3.0).sum().backward()
    torch.testing.assert_close(s.grad, (x * 3.0).sum().detach())
    torch.testing.assert_close(x.grad, torch.full((4,), 6.0, dtype=torch.float64))


def test_int_and_predicate_outputs_are_not_differentiable():
    source = "M[i] = X[i] > 0\nN[i] = sum[k](where(X[k] > X[i], 1, 0))\nY[i] = where(M[i], X[i], 0.0)"
    program = compiler.compile(source, backend="reference", outputs=["M", "N", "Y"])
    x = randn(5).requires_grad_()
    m, n, y = program(X=x)
    assert not m.requires_grad and not n.requires_grad and y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad, (x > 0).double())


# ---------------------------------------------------------------- compiler.grad
def test_grad_api_matmul():
    backward = compiler.grad("C[i,j] = A[i,k] * B[k,j]", backend="reference")
    assert (backward.inputs, backward.wrt, backward.outputs) == (("A", "B", "dC"), ("A", "B"), ("dA", "dB"))
    a, b, dc = randn(3, 4), randn(4, 5, seed=1), randn(3, 5, seed=2)
    da, db = backward(A=a, B=b, dC=dc)
    torch.testing.assert_close(da, dc @ b.T)
    torch.testing.assert_close(db, a.T @ dc)
    assert "writes dA" in str(backward.plan(A=a, B=b, dC=dc))


def test_grad_api_order_defaults_and_unread_inputs():
    source = CORPUS["attention"][0]
    assert compiler.grad(source, backend="reference").wrt == ("Q", "K", "V")      # 0-d scale only when named
    backward = compiler.grad(source, wrt=["scale", "V"], backend="reference")
    assert backward.outputs == ("dscale", "dV")
    inputs = CORPUS["attention"][2]()
    dscale, dv = backward(**inputs, dO=randn(5, 2))
    assert dscale.shape == () and dv.shape == (7, 2)
    only_v = compiler.grad(source, wrt="V", backend="reference")
    assert {i.name for i in only_v.checked.inputs} == {"Q", "K", "scale", "dO"}
    only_v(**inputs, dO=randn(5, 2))                    # V is accepted although dV does not read it


def test_a_taken_name_takes_a_suffix():
    backward = compiler.grad("C[i] = A[i] * dC[i]\ndA[i] = C[i] * 2", backend="reference")
    assert backward.upstream == {"dA": "ddA"} and backward.outputs == ("dA_1", "ddC")
    backward = compiler.grad("C[i] = A[i] * dC[i]", wrt=["A"], backend="reference")
    assert backward.upstream == {"C": "dC_1"} and backward.text == "dA[i] = dC_1[i] * dC[i]\n"
    a, dc, up = randn(3), randn(3, seed=1), randn(3, seed=2)
    torch.testing.assert_close(backward(A=a, dC=dc, dC_1=up), up * dc)


def test_grad_errors():
    with pytest.raises(CheckError, match="not an input of the program; did you mean 'Q'"):
        compiler.grad(CORPUS["attention"][0], wrt=["q"])
    with pytest.raises(CheckError, match="'S' is a statement, not an input"):
        compiler.grad(CORPUS["output_and_lse"][0], wrt=["S"])
    with pytest.raises(CheckError, match="no tensor input"):
        compiler.grad("y = a * b")


def test_a_user_summary_on_the_path_has_no_derivative_off_it_is_fine():
    squares = compiler.summary("squares", fields=("s",), identity=(0.0,), lift=lambda x: x * x,
                               combine=lambda a, b: a.s + b.s, finalize=None, commutative=True)
    source = "Y[i] = squares[k](X[i,k]) * W[i]"
    with pytest.raises(CheckError) as caught:
        compiler.grad(source, wrt=["X"], summaries=[squares])
    assert "'squares[...]' has no derivative" in str(caught.value)
    assert "1 | Y[i] = squares[k](X[i,k]) * W[i]\n  |        ^^^^^^^^^^^^^^^^^^" in str(caught.value)
    backward = compiler.grad(source, wrt=["W"], summaries=[squares], backend="reference")
    x, w, dy = randn(3, 4), randn(3, seed=1), randn(3, seed=2)
    torch.testing.assert_close(backward(X=x, W=w, dY=dy), dy * (x ** 2).sum(-1))


# ---------------------------------------------------------------- the command line
def test_cli_grad_prints_a_program_that_parses_back(capsys):
    source = CORPUS["layernorm"][0]
    assert main(["grad", "-e", source, "--wrt", "X", "--wrt", "G"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out == format_program(differentiate(check(parse(source)), ("X", "G")))
    again = check(parse(out))
    assert format_program(again) == out and again.outputs == ("dX", "dG")


def test_cli_grad_errors_exit_2_in_one_line(capsys):
    assert main(["grad", "-e", "C[i,j] = A[i,k] * B[k,j]", "--wrt", "X"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "cannot differentiate with respect to 'X'" in err


# ---------------------------------------------------------------- torch custom ops and torch.compile
def test_an_eager_call_under_autograd_runs_the_ops_function_without_torchs_dispatch():
    # the same forward and backward as the op's, called directly (op.eager): equal outputs
    # and gradients, and a grad_fn of that function; torch.jit.trace still records the op
    source, _, make, _ = CORPUS["output_and_lse"]
    program = compiler.compile(source, backend="triton")
    inputs = {k: (v.requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in make().items()}
    out, lse = program(**inputs)
    assert type(out.grad_fn).__name__.endswith("_eagerBackward")
    (out.sum() + lse.sum()).backward()
    eager = {k: v.grad.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    op = program._ops[("Tensor", "Tensor", "float", "Tensor")]
    args = tuple(inputs[i.name] for i in program.checked.inputs)
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            v.grad = None
    through_op = op(*args)
    assert not type(through_op[0].grad_fn).__name__.endswith("_eagerBackward")
    torch.testing.assert_close(through_op[0], out)
    (through_op[0].sum() + through_op[1].sum()).backward()
    for k, g in eager.items():
        torch.testing.assert_close(inputs[k].grad, g)
    traced = torch.jit.trace(lambda *a: program(**dict(zip((i.name for i in program.checked.inputs), a)))[0],
                             tuple(a.detach() if isinstance(a, torch.Tensor) else torch.tensor(a) for a in args))
    assert "einfold::" in str(traced.graph)


def test_eager_calls_of_one_runner_key_share_their_runners_and_keep_a_gradient_runner_per_needs():
    # what an eager call under autograd would find again every call (the op, the argument
    # order, the saving forward's runner, the gradient program's runner and its inputs'
    # places) is found once per runner key, and once per needs_input_grad
    program = compiler.compile("Y[i,j] = X[i,j] * rsqrt(mean[n](X[i,n] ** 2) + eps) * G[j]", backend="triton")

    def run(x, g, eps):
        x, g = x.detach().clone().requires_grad_(x.requires_grad), g.detach().clone().requires_grad_(g.requires_grad)
        y = program(X=x, G=g, eps=eps)
        (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        return y, x.grad, g.grad

    def oracle(x, g, eps):
        x, g = x.detach().double().requires_grad_(x.requires_grad), g.detach().double().requires_grad_(g.requires_grad)
        y = x * torch.rsqrt((x ** 2).mean(1, keepdim=True) + eps) * g
        (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        return y, x.grad, g.grad

    torch.manual_seed(0)
    cases = [(torch.randn(5, 7, requires_grad=True), torch.randn(7, requires_grad=True), 1e-5),
             (torch.randn(5, 7, requires_grad=True), torch.randn(7, requires_grad=True), 1e-3),   # other values
             (torch.randn(5, 7, requires_grad=True), torch.randn(7), 1e-5),                       # X only
             (torch.randn(5, 7), torch.randn(7, requires_grad=True), 1e-5),                       # G only
             (torch.randn(3, 7, requires_grad=True), torch.randn(7, requires_grad=True), 1e-5)]   # another shape
    for x, g, eps in cases:
        for got, want in zip(run(x, g, eps), oracle(x, g, eps)):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    calls = list(program._eager.values())
    assert len(calls) == 2            # one per runner key: the shapes 5 x 7 and 3 x 7
    five, three = calls
    needs = {name: k for k, name in enumerate(five.names)}           # X, G and eps, in the program's order
    assert set(five.gradients) == {tuple(n in wrt for n in sorted(needs, key=needs.get))
                                   for wrt in ({"X", "G"}, {"X"}, {"G"})}
    assert len(three.gradients) == 1
    assert type(run(*cases[0])[0].grad_fn).__name__.endswith("_eagerBackward")
    assert list(program._eager.values()) == calls and len(five.gradients) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_program_is_a_custom_op_that_opcheck_accepts(backend):
    source, _, make, _ = CORPUS["output_and_lse"]
    program = compiler.compile(source, backend=backend)
    inputs = {k: (v.to(DEVICE[backend], DTYPE[backend]).requires_grad_() if isinstance(v, torch.Tensor) else v)
              for k, v in make().items()}
    program(**inputs)
    op = program._ops[("Tensor", "Tensor", "float", "Tensor")]
    args = tuple(inputs[i.name] for i in program.checked.inputs)
    assert set(torch.library.opcheck(op, args).values()) == {"SUCCESS"}
    # its backward op, made with it, on the program's outputs (O, L), the saved
    # statistic (the row logsumexp) and the upstream gradients (dO, dL)
    # (it runs only where no graph is built: create_graph takes the gradient program's own op)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse, statistic = op(*args)
    backward = getattr(torch.ops.einfold, op._qualname.split("::")[1] + "_backward")
    needs = [isinstance(a, torch.Tensor) for a in args]
    upstream = [torch.ones_like(out), torch.ones_like(lse)]
    assert set(torch.library.opcheck(backward, (*args, [statistic], [out, lse], upstream, needs)).values()) \
        == {"SUCCESS"}


def test_a_compiled_graph_loaded_from_torch_compiles_cache_in_a_new_process_runs(tmp_path):
    # inductor's caches key a compiled forward and backward on the names of the ops
    # they call: a name must mean the same program in every process, and the
    # backward op must exist once the forward is traced, or the cached backward
    # calls an op this process never made
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = [json.loads(subprocess.run([sys.executable, str(script), run], env=env, capture_output=True, text=True,
                                      check=True, timeout=600).stdout.splitlines()[-1])
            for run in ("first", "second")]
    assert [r["hits"] for r in runs] == [0, 1]
    assert runs[0]["grads"] == runs[1]["grads"]
    for got, want in zip(runs[0]["grads"], runs[0]["want"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))


TRAIN_SCRIPT = """
import json, sys
import torch
import compiler
from torch._dynamo.utils import counters

if sys.argv[1] == "second":     # another program first: an op named by a counter would mean it now
    compiler.compile("Y[i] = exp(X[i])", backend="reference")(X=torch.ones(2, dtype=torch.float64,
                                                                              requires_grad=True)).sum().backward()
program = compiler.compile("O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]", backend="reference")
torch.manual_seed(0)
q, k, v = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
torch.compile(lambda q, k, v: (program(Q=q, K=k, V=v, scale=0.5) ** 2).sum(), fullgraph=True)(q, k, v).backward()
got = [t.grad.tolist() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
(((torch.softmax(q @ k.T * 0.5, -1) @ v) ** 2).sum()).backward()
print(json.dumps({"grads": got, "want": [t.grad.tolist() for t in (q, k, v)],
                  "hits": counters["aot_autograd"]["autograd_cache_hit"]}))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_traces_a_program_in_one_graph(backend):
    source, reference, make, _ = CORPUS["causal"]
    program = compiler.compile(source, backend=backend)
    dtype = DTYPE[backend]

    def loss(q, k, v, scale):
        return (program(Q=q, K=k, V=v, scale=scale) ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")   # fullgraph: a break is an error
    inputs = make()
    ours = [inputs[n].to(DEVICE[backend], dtype, copy=True).requires_grad_() for n in ("Q", "K", "V")]
    theirs = [inputs[n].clone().requires_grad_() for n in ("Q", "K", "V")]
    compiled(*ours, inputs["scale"]).backward()
    (reference(*theirs, inputs["scale"]) ** 2).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, **TOL[backend])


@pytest.mark.gpu
@pytest.mark.parametrize("k, dtype", [(64, torch.float32), (3, torch.float32), (64, torch.bfloat16)])
def test_gpu_a_minimum_of_distances_has_its_gradient_in_every_row(k, dtype):
    # the forward's kernel and the gradient's tile the distance differently: a gradient
    # that compared its recomputed distances with the forward's minimum matched none in
    # most rows (zero gradients) and NaN where its count and its comparison disagreed
    program = compiler.compile("C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 300, k, device="cuda", generator=g).to(dtype).requires_grad_()
    y = torch.randn(2, 500, k, device="cuda", generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(2, 300, device="cuda", generator=g).to(dtype)
    program(X=x, Y=y).backward(upstream)
    x64, y64 = (t.detach().double().requires_grad_() for t in (x, y))
    ((x64[:, :, None] - y64[:, None]) ** 2).sum(-1).amin(-1).backward(upstream.double())
    assert bool((x.grad.abs().sum(-1) > 0).all())
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for ours, want in ((x.grad, x64.grad), (y.grad, y64.grad)):
        assert float((ours.double() - want).norm() / want.norm()) < tolerance


@pytest.mark.gpu
def test_torch_compile_with_inductor_compiles_a_programs_triton_kernels_on_the_gpu():
    # the program's op is a triton_op: inductor's code holds the program's own Triton
    # kernels, forward and backward (the backward's op too), not an opaque call
    from torch._inductor.utils import run_and_get_code
    source, reference, make, _ = CORPUS["causal"]
    program = compiler.compile(source, backend="triton")

    def loss(q, k, v, scale):
        return (program(Q=q, K=k, V=v, scale=scale).float() ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True)
    inputs = make()
    ours = [inputs[n].to("cuda", torch.float32, copy=True).requires_grad_() for n in ("Q", "K", "V")]
    theirs = [inputs[n].clone().requires_grad_() for n in ("Q", "K", "V")]
    _, code = run_and_get_code(lambda: compiled(*ours, inputs["scale"]).backward())
    (reference(*theirs, inputs["scale"]) ** 2).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=1e-3, atol=1e-4)
    code = "\n".join(code)
    forward = program.plan(Q=ours[0], K=ours[1], V=ours[2], scale=inputs["scale"]).kernels
    gradient = program._gradient(("Q", "K", "V"), saved=True)
    assert forward and all(f"def {kernel.name}(" in code for kernel in forward), code[:2000]
    assert gradient.backend._last is not None and all(f"def {kernel.name}(" in code
                                                      for kernel in gradient.backend._last.plan.kernels)
    assert "_kernels.default(" not in code          # no opaque op (compiler/autograd.py) left in the graph


# ---------------------------------------------------------------- saved statistics
# Rows 0 and 1 see no key (m <= i - 2): every logit -inf, the softmax NaN, its gradient NaN.
MASKED = ("O[i,j] = softmax[m](where(m <= i - 2, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]",
          lambda Q, K, V, scale: _attention(Q, K, V, scale, torch.arange(5)[None, :] <= torch.arange(5)[:, None] - 2),
          lambda: {"Q": randn(5, 3), "K": randn(5, 3), "V": randn(5, 2), "scale": 0.6}, ("Q", "K", "V"))
SAVED = {"attention": CORPUS["attention"], "masked": MASKED, "softcap": CORPUS["softcap"],
         "output_and_lse": CORPUS["output_and_lse"]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SAVED))
def test_backward_with_saved_statistics_matches_torch(case, backend):
    source, reference, make, wrt = SAVED[case]
    backward = compiler.grad(source, wrt=wrt, backend=backend, saved=True)
    assert [s.name for s in backward.saved] == ["lse_O"] and "softmax" not in backward.text
    inputs = make()
    forward = compiler.compile(source, backend="reference")
    values = dict(zip(forward._saving.outputs, forward._saving(**inputs)))    # float64 statistics
    theirs = {n: (v.clone().requires_grad_(n in wrt) if isinstance(v, torch.Tensor) else v) for n, v in inputs.items()}
    want = reference(**theirs)
    want = want if isinstance(want, tuple) else (want,)
    upstream = {backward.upstream[o]: randn(*w.shape, seed=3 + k) for k, (o, w) in enumerate(zip(forward.outputs, want))}
    torch.autograd.backward(want, tuple(upstream.values()))
    dtype, device = DTYPE[backend], DEVICE[backend]
    # the saved statistic, and the forward output whose rowsum(dO * O) the softmax's adjoint reads
    assert sorted(n for n in backward.inputs if n in values) == ["O", "lse_O"] or case == "output_and_lse"
    given = {**inputs, **upstream, **{n: values[n] for n in backward.inputs if n in values}}
    given = {n: v.to(device, dtype) if isinstance(v, torch.Tensor) else v for n, v in given.items()}
    got = dict(zip(wrt, backward(**given)))
    recomputed = compiler.grad(source, wrt=wrt, backend=backend)
    again = dict(zip(wrt, recomputed(**{n: v for n, v in given.items() if n in recomputed.inputs})))
    for name in wrt:
        torch.testing.assert_close(got[name].double().cpu(), theirs[name].grad, **TOL[backend], equal_nan=True)
        # NaN exactly where the recomputing backward has it (the masked rows)
        assert torch.equal(got[name].isnan(), again[name].isnan()), name
    if case == "masked":
        # as torch: the masked rows' dQ is 0 (where() sends nothing to a masked logit), dV is NaN
        assert values["lse_O"][:2].isneginf().all() and (got["Q"][:2] == 0).all() and got["V"].isnan().all()


def _normalisers_in_loops(loops, outer=()):
    """(loop index, fold) for each fold with a normaliser field `l` (the sum of the
    weights alone) inside a loop over another index."""
    found = []
    for loop in loops:
        if outer:
            found += [(loop.indices, f) for f in loop.folds if "l" in f.split("_")[1:]]
        found += _normalisers_in_loops(loop.inner, (*outer, *loop.indices))
    return found


def test_saved_statistics_cost_the_forward_no_kernel_and_the_backward_no_normaliser():
    sizes = {"Q": randn(70, 16), "K": randn(90, 16), "V": randn(90, 8), "scale": 0.25}
    for case in ("attention", "masked", "softcap"):
        program = compiler.compile(SAVED[case][0], backend="triton")
        assert program._saving is not program
        inputs = {n: sizes[n] for n in ("Q", "K", "V")} | {i.name: 0.25 for i in program.checked.inputs if i.rank == 0}
        assert len(program._saving.plan(**inputs).kernels) == len(program.plan(**inputs).kernels) == 1, case
    lse = compiler.compile(CORPUS["output_and_lse"][0], backend="triton")
    assert len(lse._saving.plan(**sizes).kernels) == len(lse.plan(**sizes).kernels)
    # the recomputing backward no longer folds row i's normaliser over m inside the loops over
    # i of dK and dV (cubic work): they read its (r, l), which dQ's fold streams once a row and
    # stores (twenty-third session)
    do, row = randn(70, 8), randn(70)
    recomputing = compiler.grad(CORPUS["attention"][0], backend="triton").plan(**sizes, dO=do)
    assert not any(_normalisers_in_loops(k.loops) for k in recomputing.kernels)
    assert all("stored by einfold_dQ" in k.why for k in recomputing.kernels
               if k.name in ("einfold_dK", "einfold_dV"))
    saving = compiler.grad(CORPUS["attention"][0], backend="triton", saved=True).plan(**sizes, dO=do, lse_O=row,
                                                                                   O=randn(70, 8))
    # dK and dV share one kernel and one loop over i (FlashAttention-2's structure)
    assert [(k.name, k.writes) for k in saving.kernels] == [("einfold_dQ", ("buf0", "dQ")),
                                                             ("einfold_dK", ("dK", "dV"))]
    assert not any(_normalisers_in_loops(k.loops) for k in saving.kernels)
    assert not any("_l_" in f or f.endswith("_l") for k in saving.kernels for f in _all_folds(k.loops))
    # FlashAttention's D = rowsum(dO * O) read from the output: dK and dV fold nothing over m
    # inside their loop over i, nor does the recomputing backward now
    assert "sum[j](dO[i, j] * O[i, j])" in compiler.grad(CORPUS["attention"][0], saved=True).text
    assert not any(_over("m", k.loops) for k in (*saving.kernels, *recomputing.kernels)
                   if k.name in ("einfold_dK", "einfold_dV"))


def _plan_shape(plan):
    """A plan's kernels with their loops and folds, index names aside."""
    def loop(x):
        return len(x.indices), x.folds, tuple(loop(y) for y in x.inner), len(x.bounds)
    return [(k.name, tuple(loop(x) for x in k.loops)) for k in plan.kernels]


@pytest.mark.parametrize("causal", [False, True])
def test_the_saved_backward_plan_does_not_depend_on_spelling(causal):
    # renamed indices and commuted factors: the same kernels with the same loops and
    # folds (index names aside), and both read the output for rowsum(dO * O)
    first = "where(m <= i, Q[i,k] * K[m,k] * scale, -inf)" if causal else "Q[i,k] * K[m,k] * scale"
    second = "where(z <= x, scale * K[z,w] * Q[x,w], -inf)" if causal else "scale * K[z,w] * Q[x,w]"
    sizes = {"Q": randn(7, 4), "K": randn(7, 4), "V": randn(7, 3), "scale": 0.5, "dO": randn(7, 3),
             "lse_O": randn(7), "O": randn(7, 3)}
    plans = []
    for source in (f"O[i,j] = softmax[m]({first}) * V[m,j]", f"O[x,y] = softmax[z]({second}) * V[z,y]"):
        backward = compiler.grad(source, wrt=("Q", "K", "V"), backend="triton", saved=True)
        assert {"O", "lse_O"} <= set(backward.inputs)
        plans.append(_plan_shape(backward.plan(**sizes)))
    assert plans[0] == plans[1]


def test_the_saved_backward_reads_an_output_its_adjoint_reads_whatever_the_spelling():
    # a sink in the normaliser: no softmax statistic to save, but the adjoint reads O itself
    # (its derivative through the normaliser): the saved backward takes O from the forward
    spellings = ["O[h,i,j] = sum[m](exp(sum[k](Q[h,i,k] * K[h,m,k]) * scale) * V[h,m,j]) / "
                 "(sum[m](exp(sum[k](Q[h,i,k] * K[h,m,k]) * scale)) + exp(S[h]))",
                 "O[a,x,y] = sum[n](V[a,n,y] * exp(scale * sum[d](K[a,n,d] * Q[a,x,d]))) / "
                 "(exp(S[a]) + sum[n](exp(scale * sum[d](K[a,n,d] * Q[a,x,d]))))"]
    inputs = {"Q": randn(2, 5, 3, seed=1), "K": randn(2, 6, 3, seed=2), "V": randn(2, 6, 4, seed=3),
              "S": randn(2, seed=4), "scale": 0.7, "dO": randn(2, 5, 4, seed=5)}
    forward = compiler.compile(spellings[0], backend="reference")
    given = {**inputs, "O": forward(**{n: v for n, v in inputs.items() if n != "dO"})}
    results, plans = [], []
    for source in spellings:
        backward = compiler.grad(source, wrt=("Q", "K", "V", "S"), backend="reference", saved=True)
        assert "O" in backward.inputs and not any(s.name == "O" for s in backward.checked.statements)
        got = backward(**given)
        want = compiler.grad(source, wrt=("Q", "K", "V", "S"), backend="reference")(**inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        results.append(got)
        plan = compiler.grad(source, wrt=("Q", "K", "V", "S"), backend="triton", saved=True).plan(**given)
        # and the recomputing backward, which reads the normaliser's (r, l) from dQ's buffers
        recomputing = compiler.grad(source, wrt=("Q", "K", "V", "S"), backend="triton").plan(**inputs)
        plans.append((_plan_shape(plan), _plan_shape(recomputing)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    assert plans[0] == plans[1]


def _over(index, loops):
    return any(index in loop.indices or _over(index, loop.inner) for loop in loops)


def _all_folds(loops):
    return [f for loop in loops for f in (*loop.folds, *_all_folds(loop.inner))]


def test_statistics_are_saved_per_distinct_softmax_and_explained_where_not():
    backward = compiler.grad("S[i,m] = X[i,k] * W[m,k]\nP[i,m] = softmax[m](S[i,m])\n"
                             "L[i] = logsumexp[m](X[i,k] * W[m,k])\nO[i,j] = P[i,m] * V[m,j] + L[i]",
                             backend="reference", saved=True)
    # one statistic per distinct softmax of the checked program (the passes fold them as one)
    assert [format_program_statement(s) for s in backward.saved] == [
        "lse_P[i] = logsumexp[m](S[i, m])", "lse_L[i] = logsumexp[m](sum[k](X[i, k] * W[m, k]))"]
    assert "softmax" not in backward.text and backward.unsaved == ()
    nested = "Y[i] = sum[k](softmax[m](X[i,m] * W[k,m]) * Z[k,m])"
    backward = compiler.grad(nested, backend="reference", saved=True)
    assert backward.saved == () and "softmax[m]" in backward.text
    assert backward.unsaved == ("softmax[m](...) in Y varies over k, which Y[i] folds over: its statistic "
                                "would be a tensor the forward does not write",)
    assert compiler.compile(nested)._saving.outputs == ("Y",)
    text = compiler.compile(nested, backend="reference").explain()
    assert "recomputed by the backward:\n  softmax[m](...) in Y varies over k" in text


def format_program_statement(s):
    from compiler.ir import format_statement
    return format_statement(s)


def test_a_backward_that_builds_a_graph_recomputes():
    # the saved statistic is a constant to the gradient program: second derivatives recompute
    program = compiler.compile("L[i] = logsumexp[j](X[i,j] * W[j])", backend="reference")
    x, w = randn(3, 4).requires_grad_(), randn(4, seed=1).requires_grad_()
    dx, = torch.autograd.grad(program(X=x, W=w).sum(), x, create_graph=True)
    (dx * dx).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dx2, = torch.autograd.grad(torch.logsumexp(x2 * w2, -1).sum(), x2, create_graph=True)
    (dx2 * dx2).sum().backward()
    torch.testing.assert_close(dx, dx2)
    torch.testing.assert_close(w.grad, w2.grad)
    assert set(program._gradients) == {(("X", "W"), False)}


def test_cli_grad_saved_prints_a_program_that_parses_back(capsys):
    source = CORPUS["attention"][0]
    assert main(["grad", "-e", source, "--saved"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out == compiler.grad(source, backend="reference", saved=True).text
    assert "lse_O[i]" in out and "softmax" not in out
    again = check(parse(out))
    assert format_program(again) == out and again.outputs == ("dQ", "dK", "dV")
    assert {i.name for i in again.inputs[-2:]} == {"lse_O", "O"}       # the statistic and the output
    assert main(["grad", "-e", source]) == 0
    assert "softmax[m]" in capsys.readouterr()[0]


def test_explain_ends_with_the_backward_and_its_saved_statistics():
    text = compiler.compile(CORPUS["attention"][0], backend="reference").explain()
    backward = compiler.grad(CORPUS["attention"][0], backend="reference", saved=True).text
    tail = ("backward (einfold grad --saved: the gradients of Q, K, V):\n"
            + "".join(f"  {line}\n" for line in backward.splitlines())
            + "saved by the forward (extra outputs that share the folds it makes anyway):\n"
            "  lse_O[i] = logsumexp[m](sum[k](Q[i, k] * K[m, k]) * scale)\n")
    assert text.endswith(tail)
    assert "backward" not in compiler.compile("N[i] = sum[k](where(X[i,k] > 0, 1, 0))").explain()


# ---------------------------------------------------------------- on the GPU, at real sizes
# bf16 storage, ragged lengths; each gradient's relative error against float64 torch
# autograd must be no worse than the same torch code's in bf16 (eager, on the GPU), or
# within bf16's own storage precision (2^-8 relative: one rounding of the result).
def _gpu_cases():
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.float64) * scale

    b, h, s, d = 2, 4, 1000, 64
    qkv = lambda: {"Q": rand(b, h, s, d), "K": rand(b, h, s, d), "V": rand(b, h, s, d), "scale": d ** -0.5}
    mask = lambda: torch.arange(s, device="cuda")[None, :] <= torch.arange(s, device="cuda")[:, None]
    return {
        "attention": ("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]",
                      lambda Q, K, V, scale: _attention(Q, K, V, scale), qkv, ("Q", "K", "V")),
        "causal": ("O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]",
                   lambda Q, K, V, scale: _attention(Q, K, V, scale, mask()), qkv, ("Q", "K", "V")),
        "bias": ("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale + Bias[h,i,m]) * V[b,h,m,j]",
                 lambda Q, K, V, Bias, scale: _attention(Q, K, V, scale, bias=Bias),
                 lambda: {**qkv(), "Bias": rand(h, s, s)}, ("Q", "K", "V", "Bias")),
        "gqa": ("O[g,r,i,j] = softmax[m](Q[g,r,i,k] * K[g,m,k] * scale) * V[g,m,j]",
                lambda Q, K, V, scale: _attention(Q, K[:, None], V[:, None], scale),
                lambda: {"Q": rand(2, 4, s, d), "K": rand(2, s, d), "V": rand(2, s, d), "scale": d ** -0.5},
                ("Q", "K", "V")),
        "layernorm": (CORPUS["layernorm"][0], _layernorm,
                      lambda: {"X": rand(4097, 1000), "G": rand(1000), "B": rand(1000)}, ("X", "G", "B")),
        "cross_entropy": (CORPUS["cross_entropy"][0],
                          lambda H, W, Y: torch.nn.functional.cross_entropy(H @ W.T, Y, reduction="none"),
                          lambda: {"H": rand(509, 256), "W": rand(5003, 256, scale=0.1),
                                   "Y": torch.nn.functional.one_hot(torch.randint(0, 5003, (509,), device="cuda"),
                                                                    5003).double()},
                          ("H", "W")),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["attention", "causal", "bias", "gqa", "layernorm", "cross_entropy"])
def test_gpu_bf16_gradients_are_as_accurate_as_torch(case):
    torch.manual_seed(0)
    source, reference, make, wrt = _gpu_cases()[case]
    inputs = make()
    inputs = {n: v.bfloat16().double() if isinstance(v, torch.Tensor) else v for n, v in inputs.items()}
    program = compiler.compile(source, backend="triton")

    def gradients(fn, dtype):
        given = {n: (v.detach().to(dtype, copy=True).requires_grad_(n in wrt) if isinstance(v, torch.Tensor) else v)
                 for n, v in inputs.items()}
        out = fn(**given)
        upstream = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        out.backward(upstream.bfloat16().to(dtype))
        return out.detach().double(), {n: given[n].grad.double() for n in wrt}

    oracle_out, oracle = gradients(reference, torch.float64)
    torch_out, theirs = gradients(reference, torch.bfloat16)
    our_out, ours = gradients(program, torch.bfloat16)

    def error(x, want):
        return float((x - want).norm() / want.norm())

    def bound(torch_error):
        return max(1.5 * torch_error, 2.0 ** -8)
    assert error(our_out, oracle_out) <= bound(error(torch_out, oracle_out)), \
        ("output", error(our_out, oracle_out), error(torch_out, oracle_out))
    for name in wrt:
        assert ours[name].isfinite().all(), name
        assert error(ours[name], oracle[name]) <= bound(error(theirs[name], oracle[name])), \
            (name, error(ours[name], oracle[name]), error(theirs[name], oracle[name]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_are_saved_in_float32_and_do_not_promote_the_backward(backend):
    # a bf16 logsumexp is off by up to 1/128 of itself: exp(x - lse) would carry that error
    source, _, make, wrt = CORPUS["attention"]
    program = compiler.compile(source, backend=backend)
    inputs = {n: v.to(DEVICE[backend], torch.bfloat16) if isinstance(v, torch.Tensor) else v
              for n, v in make().items()}
    out, lse = program._saving(**inputs)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    backward = compiler.grad(source, wrt=wrt, backend=backend, saved=True)
    given = {**inputs, "dO": torch.ones_like(out), "O": out, "lse_O": lse}
    assert all(g.dtype == torch.bfloat16 for g in backward(**given))
    ours = {n: v.clone().requires_grad_(n in wrt) if isinstance(v, torch.Tensor) else v for n, v in inputs.items()}
    program(**ours).sum().backward()
    assert all(ours[n].grad.dtype == torch.bfloat16 for n in wrt)


def test_float32_outputs_option():
    program = compiler.compile("L[i] = logsumexp[j](X[i,j])\nY[i,j] = X[i,j] - L[i]", backend="reference",
                               outputs=["L", "Y"], float32_outputs=["L"])
    L, Y = program(X=torch.ones(2, 3, dtype=torch.float16))
    assert (L.dtype, Y.dtype) == (torch.float32, torch.float16)
    assert program(X=torch.ones(2, 3, dtype=torch.float64))[0].dtype == torch.float64   # at least float32
    with pytest.raises(compiler.EinfoldError, match="float32_outputs= names Z, which is not among the outputs"):
        compiler.compile("L[i] = logsumexp[j](X[i,j])", float32_outputs=["Z"])
    with pytest.raises(compiler.EinfoldError, match="takes a list of output names"):
        compiler.compile("L[i] = logsumexp[j](X[i,j])", float32_outputs="L")


def test_the_saved_backward_is_plain_sums_with_causal_bounds():
    # exp(min(x - lse, 0)) is at most 1: no running max, every fold a plain sum
    # (tl.dot of the recomputed tile), and the causal mask bounds each loop
    source = CORPUS["causal"][0]
    backward = compiler.grad(source, backend="triton", saved=True)
    sizes = {"Q": randn(70, 16), "K": randn(70, 16), "V": randn(70, 8), "scale": 0.25, "dO": randn(70, 8),
             "lse_O": randn(70), "O": randn(70, 8)}
    plan = backward.plan(**sizes)
    assert all(set(f.split("_")) == {"sum"} for k in plan.kernels for f in _all_folds(k.loops))
    bounds = {k.name: [b for loop in k.loops for b in loop.bounds] for k in plan.kernels}
    assert bounds == {"einfold_dQ": ["m <= i"], "einfold_dK": ["i >= m"]}      # dK beside dV: one loop


def test_min_and_max_propagate_nan_on_triton():
    program = compiler.compile("Y[i] = min(X[i], 0) + max(X[i], -1)", backend="triton")
    x = torch.tensor([float("nan"), 2.0, -3.0])
    y = program(X=x)
    assert y[0].isnan() and y[1:].tolist() == [2.0, -4.0]


def _gpu_module(source: str, sizes: dict[str, tuple], saved=True, **scalars) -> str:
    """The GPU module of `source`'s saved backward for tensors of these shapes
    (built on the CPU, autotune candidates included; nothing runs)."""
    backward = compiler.grad(source, backend="triton", saved=saved)
    inputs = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in sizes.items()}
    # the saved statistics are float32, as the saving forward stores them
    inputs = {n: (torch.zeros(v.shape) if n in backward.statistic_inputs else v) for n, v in inputs.items()}
    return backward.backend.source_for(backward.binder({**inputs, **scalars}), sm_count=132)


def _kernels(module: str) -> dict[str, str]:
    parts = module.split("@triton.jit\ndef ")[1:]
    return {p.split("(")[0]: p.split("\n\n\n")[0] for p in parts}


S, D = 1000, 64
ATTENTION_SHAPES = {"Q": (2, 4, S, D), "K": (2, 4, S, D), "V": (2, 4, S, D), "dO": (2, 4, S, D),
                    "O": (2, 4, S, D), "lse_O": (2, 4, S)}


def test_a_contractions_batch_indices_are_taken_one_at_a_time():
    # Bias[h,i,m] lacks b, K[g,m,k] lacks r: neither makes b or r a tile dimension
    # (that made every operand 3-D: no tl.dot, and tiles of 4M elements on the GPU)
    bias = _kernels(_gpu_module("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale + Bias[h,i,m]) * V[b,h,m,j]",
                                {**ATTENTION_SHAPES, "Bias": (4, S, S)}, scale=0.125))
    assert set(bias) == {"einfold_dQ", "einfold_dK", "einfold_dBias"}          # dK beside dV: one kernel
    assert all("tl.dot" in k and "BLOCK_b" not in k and "BLOCK_h" not in k for k in bias.values())
    # dBias = sum[b](dS): b streamed one value at a time, each step a tile of i x m
    assert "for start_b in range(0, n_b, 1):" in bias["einfold_dBias"]
    gqa = _kernels(_gpu_module("O[g,r,i,j] = softmax[m](Q[g,r,i,k] * K[g,m,k] * scale) * V[g,m,j]",
                               {**ATTENTION_SHAPES, "K": (2, S, D), "V": (2, S, D)}, scale=0.125))
    # (dK's and dV's 16 programs split over the tiles of i: their merges hold no product)
    assert all("BLOCK_g" not in k and "BLOCK_r" not in k for k in gqa.values())
    assert all("tl.dot" in k for name, k in gqa.items() if not name.endswith("_merge"))


def test_a_fold_an_earlier_kernel_streams_is_read_not_recomputed():
    # D = rowsum(dO * O) is a fold of dQ's kernel (one per row i); dK's programs
    # (one per tile of m) would each recompute it for every i: they read it instead
    module = _gpu_module(CORPUS["attention"][0].replace("[i,", "[b,h,i,").replace("[m,", "[b,h,m,"),
                         ATTENTION_SHAPES, scale=0.125)
    kernels = _kernels(module)
    assert "buf0_ptr" in kernels["einfold_dQ"].split(")")[0] and "buf0_ptr" in kernels["einfold_dK"].split(")")[0]
    assert " O_ptr" not in kernels["einfold_dK"]            # no dO * O tile in the dK loop
    plan = compiler.grad(CORPUS["attention"][0], backend="triton", saved=True).plan(
        Q=randn(70, 16), K=randn(70, 16), V=randn(70, 8), scale=0.25, dO=randn(70, 8), O=randn(70, 8),
        lse_O=randn(70))
    assert plan.buffers == ("buf0",)
    assert set(plan.kernels[0].writes) == {"dQ", "buf0"}
    assert "reads buf0 (sum[j], stored by einfold_dQ) instead of recomputing it per program" in plan.kernels[1].why
    # a layernorm's row statistics inside its column sums dG, dB: the recomputing backward
    # folds them in dX's kernel and dG's reads them stored; the saved one reads the forward's
    layernorm = compiler.grad(CORPUS["layernorm"][0], backend="triton")
    why = [k.why for k in layernorm.plan(X=randn(9, 70), G=randn(70), dY=randn(9, 70)).kernels]
    assert len(why) == 2 and "stored by einfold_dX" in why[1]
    layernorm = compiler.grad(CORPUS["layernorm"][0], backend="triton", saved=True)
    plan = layernorm.plan(X=randn(9, 70), G=randn(70), dY=randn(9, 70), mean_mu=randn(9), mean_var=randn(9))
    assert len(plan.kernels) == 2 and plan.buffers == ()


def test_the_sink_backward_reads_its_normaliser_once_a_row_and_contracts_with_tl_dot():
    # D[h,i] = sum[m](exp(x)) + exp(S[h]) has no softmax statistic to save.  dQ's kernel
    # streams its (r, l) per row beside fields over k; dK and dV read them stored (one fold
    # over m a row, where each refolded them for every i of every program: cubic), keep of
    # their own fold over i only the running max they read, and take the row normaliser
    # 1 / D[i] into a tl.dot operand (sum[i](P[m,i] * dO[i,j] / D[i]) was a broadcast
    # product over 3-D tiles, which LLVM lowered for minutes); dQ's fold weights the value
    # K[m,k] * dP[i,m] as one tl.dot of P * dP and K, not a 3-D product either
    source = CORPUS["sink"][0]
    plan = compiler.grad(source, backend="triton", saved=True).plan(
        Q=randn(2, 70, 16), K=randn(2, 90, 16), V=randn(2, 90, 8), S=randn(2), scale=0.25,
        dO=randn(2, 70, 8), O=randn(2, 70, 8))
    _, dk, dv = plan.kernels[:3]
    assert "stored by einfold_dQ" in dk.why and "stored by einfold_dQ" in dv.why
    schedule = compiler.grad(source, backend="triton", saved=True).schedule
    for kernel in schedule.kernels[1:3]:
        assert "loop m" not in str(kernel), str(kernel)
        assert all(f.summary.field_names == ("r",) for f in kernel.program_folds if f.summary.rescaled)
    kernels = _kernels(_gpu_module(source, {"Q": (8, S, D), "K": (8, S, D), "V": (8, S, D), "S": (8,),
                                            "dO": (8, S, D), "O": (8, S, D)}, scale=0.125))
    for name in ("einfold_dQ", "einfold_dK", "einfold_dV"):
        assert "tl.dot(op" in kernels[name] and ", None, :]" not in kernels[name], kernels[name]


def test_column_sums_tile_the_columns_and_every_tiling_fits_triton():
    # dG[k] = sum[i](...) over a row-major X: a tile of 64 contiguous columns, rows
    # streamed in the rest of the column tile's budget (one column per program read
    # memory with a stride per element)
    module = _gpu_module(CORPUS["layernorm"][0], {"X": (16385, 1000), "G": (1000,), "dY": (16385, 1000),
                                                  "mean_mu": (16385,), "mean_var": (16385,)})
    # dG and dB are two sums, each a running value per element of the tile: they share the
    # 16384 elements, 64 columns by 128 rows; the split counts the work at the extents'
    # classes (16384 rows in 128 tiles, 512 columns in 8 tiles): 32 programs a column tile
    launch = module.split("einfold_dG_partial[(grid, n_split)](")[1].splitlines()[1]
    assert launch.endswith("BLOCK_k=64, BLOCK_i=128)")
    assert "n_split = 32" in module
    # the cross-entropy backward builds (every tile within Triton's 2**20 elements), and
    # dH, dW are one contraction each (tl.dot), not a fold of a pair of sums over 3-D tiles
    kernels = _kernels(_gpu_module(CORPUS["cross_entropy"][0], {"H": (509, 256), "W": (5003, 256), "Y": (509, 5003),
                                                                "dL": (509,), "lse_L": (509,)}))
    assert all("tl.dot" in kernels[k] and "tl.reduce" not in kernels[k] for k in ("einfold_dH_partial", "einfold_dW"))


def test_a_tiling_past_tritons_largest_tensor_is_a_backend_error():
    from compiler.backend.triton.emit import KernelCode
    from compiler.backend.triton.tuning import binding, candidates
    from compiler.specialise import Candidate
    code = KernelCode("einfold_Y", "", [], {"BLOCK_i": 2048, "BLOCK_j": 1024}, [], False, "", ("Y",),
                      tiles=frozenset({("BLOCK_i", "BLOCK_j")}))
    with pytest.raises(compiler.BackendError, match=r"einfold_Y would hold a tile of 2097152 elements "
                                                     r"\[BLOCK_i=2048, BLOCK_j=1024\], more than Triton's 1048576"):
        binding(code)
    fits = replace(code, constexprs={"BLOCK_i": 1024, "BLOCK_j": 64},
                   tunable={"BLOCK_i": ("grid", "i"), "BLOCK_j": ("loop", "j")})
    tilings = (Candidate((("i", 1024), ("j", 2048)), 8, 3), Candidate((("i", 1024), ("j", 1024)), 8, 3),
               Candidate((("i", 128), ("j", 64)), 4, 3))
    assert [c for c, *_ in candidates(fits, tilings)] == [{"BLOCK_i": 1024, "BLOCK_j": 1024},
                                                         {"BLOCK_i": 128, "BLOCK_j": 64}]


def test_the_attention_backward_holds_both_head_dimensions_whole_and_tunes_its_tiles():
    # dQ's epilogue over k recomputed the scores and dO V^T for every tile of k (two at
    # d = 128), and its loop over m was not tuned (the D = rowsum(dO * O) fold's j loop was
    # counted as a second contraction loop); dK and dV are one kernel over whole k and j
    shapes = {n: (2, 4, S, 128) for n in ("Q", "K", "V", "dO", "O")} | {"lse_O": (2, 4, S)}
    module = _gpu_module(CORPUS["attention"][0].replace("[i,", "[b,h,i,").replace("[m,", "[b,h,m,"), shapes,
                         scale=0.125)
    kernels = _kernels(module)
    assert set(kernels) == {"einfold_dQ", "einfold_dK"}
    tuned = {name: [dict(re.findall(r"'(BLOCK_\w+)': (\d+)", c)) for c in re.findall(
        r"triton\.Config\(\{([^}]*)\}", module.split(f"def {name}(")[0].rsplit("@triton.autotune", 1)[1])]
        for name in kernels}
    assert all(c["BLOCK_k"] == "128" for c in tuned["einfold_dQ"])
    assert len({(c["BLOCK_i"], c["BLOCK_m"]) for c in tuned["einfold_dQ"]}) > 1
    assert all(c["BLOCK_k"] == c["BLOCK_j"] == "128" for c in tuned["einfold_dK"])
    assert len({(c["BLOCK_m"], c["BLOCK_i"]) for c in tuned["einfold_dK"]}) > 1
    assert kernels["einfold_dK"].count("tl.dot(") == 4      # scores, dO V^T, dK's and dV's products


def test_a_slope_gradient_is_summed_in_the_loop_that_has_the_scores():
    # ALiBi's dA[h] = sum[i, m](sum[b](dS) * |i - m|) was a kernel of its own over every
    # score, one program per head and i one value at a time (99 ms against 6 for the rest
    # of the backward on an H200); as partial sums over i it joins dK and dV's loop, which
    # recomputes dS anyway, and a sum over (b, m) of one value per (b, h, m) finishes it
    source = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale - A[h] * abs(i - m)) * V[b,h,m,j]"
    backward = compiler.grad(source, backend="triton", saved=True, wrt=("Q", "K", "V", "A"))
    shapes = {"Q": (2, 3, 37, 8), "K": (2, 3, 29, 8), "V": (2, 3, 29, 5), "dO": (2, 3, 37, 5)}
    inputs = {n: randn(*s) for n, s in shapes.items()} | {"A": torch.rand(3), "scale": 0.3}
    inputs |= {"O": randn(2, 3, 37, 5), "lse_O": randn(2, 3, 37) + 3}
    plan = backward.plan(**inputs)
    assert [(k.name, k.writes) for k in plan.kernels] == [
        ("einfold_dQ", ("buf0", "dQ")), ("einfold_dK", ("dK", "dV", "buf1")), ("einfold_dA", ("dA",))]
    assert [str(loop) for loop in plan.kernels[2].loops] == ["loop m, b: sum"]
    oracle = compiler.grad(source, backend="reference", saved=True, wrt=("Q", "K", "V", "A"))(**inputs)
    for got, want in zip(backward(**inputs), oracle):
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_prefix_over_a_size_argument_and_its_gradient(backend):
    # t is only on the left: its extent is the call's size argument (t=...); the gradient
    # program measures t from the upstream gradient dL, and the size has none
    program = compiler.compile("L[b, t] = logsumexp[s](where(s <= t, X[b, s], -inf))", backend=backend)
    x = randn(3, 11).double().requires_grad_()
    want_x = x.detach().clone().requires_grad_()
    for t in (11, 4, 11):                           # each size its own runner, and back
        got = program(X=x, t=t)
        want = torch.logcumsumexp(want_x, dim=1)[:, :t]
        torch.testing.assert_close(got, want)
    (got * torch.arange(11.0, dtype=torch.float64)).sum().backward()
    (want * torch.arange(11.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(x.grad, want_x.grad)


def test_a_broadcast_adjoint_reads_its_shape_from_an_input_not_a_statement():
    # the adjoint of a mean loss over row losses L[t] broadcasts over t: it read its shape
    # as L[t] ** 0, which recomputed every row's logsumexp; the labels Y[t] have that shape
    source = ("L[t] = where(Y[t] == -100, 0, logsumexp[v](X[t, v]) - sum[v](where(v == Y[t], X[t, v], 0)))\n"
              "loss[] = sum[t](L[t]) / sum[t](where(Y[t] == -100, 0, 1))")
    text = compiler.grad(source, wrt=("X",), backend="reference").text
    assert "dL[t] = dloss / sum[t](where(Y[t] == -100, 0, 1)) * Y[t] ** 0" in text and "L[t] ** 0" not in text
    x, y = randn(5, 7).double().requires_grad_(), torch.tensor([1, 6, -100, 0, 3])
    compiler.compile(source, backend="reference")(X=x, Y=y).backward()
    want = x.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(want, y, ignore_index=-100).backward()
    torch.testing.assert_close(x.grad, want.grad)


def test_every_spelling_of_attention_gets_one_backward_schedule():
    # the sibling loop and the whole head dimensions follow from the algebra, not the text:
    # the scores as statements, renamed indices and the gradients asked in another order
    # schedule alike (dK and dV share one kernel and one loop over the queries)
    from compiler.bench import ATTENTION, THREE_STATEMENTS

    def outline(source, wrt=("Q", "K", "V")):
        schedule = compiler.grad(source, saved=True, wrt=wrt, backend="triton").schedule
        return [(sorted(s.name for s in k.statements), k.grid, [str(loop) for loop in k.loops])
                for k in schedule.kernels]
    want = outline(ATTENTION)
    assert want[1][0] == ["dK", "dV"] and want[1][1] == ("b", "h", "m", "k", "j")
    assert outline(THREE_STATEMENTS) == want
    assert ["dK", "dV"] in [names for names, _, _ in outline(ATTENTION, wrt=("V", "K", "Q"))]
    renamed = outline("O[z,y,a,c] = softmax[n](Q[z,y,a,e] * K[z,y,n,e] * scale) * V[z,y,n,c]")
    names = dict(zip("zyanec", "bhimkj"))
    assert [(st, tuple(names[g] for g in grid), [re.sub(r"\b[zyanec]\b", lambda m: names[m.group()], loop)
                                                  for loop in loops]) for st, grid, loops in renamed] == want


def test_a_norms_row_statistics_are_saved_by_the_forward_and_read_by_the_backward():
    """The rule of rsqrt(v) reads v: the gradient program would fold a norm's row mean
    and mean square again from X.  The forward stores them (float32, from the fold it
    makes anyway: still one kernel) and the backward reads them: one fold over the row
    left in dX's kernel (of dY's two sums), none in dG's.  A fold of exponentials (a
    sink's normaliser) is not saved: as a value it may overflow where its ratio does not;
    nor is a fold of integer value."""
    rms = "Y[i,k] = X[i,k] * rsqrt(mean[n](X[i,n] ** 2) + eps) * G[k]"
    program = compiler.compile(rms, backend="triton")
    assert program._saving.outputs == ("Y", "mean_Y")
    assert len(program._saving.plan(X=randn(9, 70), G=randn(70), eps=1e-6).kernels) == 1
    X, G = randn(9, 70).requires_grad_(), randn(70).requires_grad_()
    dY = randn(9, 70, seed=3)
    got = torch.autograd.grad(program(X=X, G=G, eps=1e-6), (X, G), dY)
    X64, G64 = (t.detach().double().requires_grad_() for t in (X, G))
    want = torch.autograd.grad(X64 * torch.rsqrt((X64 ** 2).mean(-1, keepdim=True) + 1e-6) * G64, (X64, G64),
                               dY.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    backward = compiler.grad(rms, backend="triton", saved=True)
    assert [s.name for s in backward.saved] == ["mean_Y"] and "mean_Y" in backward.inputs
    assert not any(isinstance(n, Reduce | Composite) and "n" in n.indices
                   for s in backward.checked.statements for n in walk(s.expr))
    assert not compiler.grad(CORPUS["sink"][0], backend="reference", saved=True).saved
    # an argmax's position is no float statistic: recomputed
    assert compiler.compile("Y[i,k] = X[i,k] * argmax[j](X[i,j], j)")._saving.outputs == ("Y",)


def _loop_structure(plan):
    """A plan's kernels with their loops, the number of folds each streams, index and fold names aside."""
    def loop(x):
        return len(x.indices), len(x.folds), tuple(loop(y) for y in x.inner), len(x.bounds)
    return [(k.name, tuple(loop(x) for x in k.loops)) for k in plan.kernels]


@pytest.mark.parametrize("spellings", [
    ["Y[i,k] = X[i,k] * rsqrt(mean[n](X[i,n] ** 2) + eps) * G[k]",
     "Y[i,k] = X[i,k] * rsqrt(sum[n](X[i,n] * X[i,n]) / len(n) + eps) * G[k]",
     "Out[r,c] = G[c] * X[r,c] * rsqrt(eps + mean[q](X[r,q] ** 2))",
     "ms[i] = mean[n](X[i,n] ** 2)\nY[i,k] = X[i,k] * rsqrt(ms[i] + eps) * G[k]"],
    ["mu[i] = mean[k](X[i,k])\nvar[i] = mean[k]((X[i,k] - mu[i]) ** 2)\n"
     "Y[i,k] = (X[i,k] - mu[i]) * rsqrt(var[i] + eps) * G[k]",
     "mu[i] = sum[j](X[i,j]) / len(j)\nvar[i] = sum[j]((X[i,j] - mu[i]) ** 2) / len(j)\n"
     "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + eps) * G[j]",
     "Y[a,b] = G[b] * (X[a,b] - mean[c](X[a,c])) * rsqrt(mean[d]((X[a,d] - mean[e](X[a,e])) ** 2) + eps)"]],
    ids=["rmsnorm", "layernorm"])
def test_a_norms_saved_backward_has_one_plan_whatever_the_spelling(spellings):
    """Spelled with mean or a sum over len, inline or through statements, with other
    names: every saved backward reads the row statistics (a len(n) beside a saved sum
    over n reads the extent under another name of it) and streams one fold over the row
    in dX's kernel and one over the rows in dG's."""
    plans = []
    for source in spellings:
        backward = compiler.grad(source, wrt=("X", "G"), backend="triton", saved=True)
        assert backward.saved and all(s.name in backward.inputs for s in backward.saved)
        upstream = next(iter(backward.upstream.values()))
        given = {"X": randn(9, 70), "G": randn(70), "eps": 1e-5, upstream: randn(9, 70, seed=1),
                 **{s.name: randn(9).abs() for s in backward.saved}}
        plans.append(_loop_structure(backward.plan(**{n: v for n, v in given.items() if n in backward.inputs})))
    assert all(p == plans[0] for p in plans), plans
    assert plans[0] == [("einfold_dX", ((1, 1, (), 0), (1, 0, (), 0))), ("einfold_dG", ((1, 1, (), 0),))]
