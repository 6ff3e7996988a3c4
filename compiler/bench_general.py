"""`einfold bench --group general`: programs that ML users and scientists write
beyond attention, each in index notation against the same computation written in
plain torch (eager and under torch.compile) and, where users would pick one, a
hand-written library (Liger-Kernel, Cut Cross-Entropy), with each contender's
error against the torch code run in float64 and its peak memory.

Each family is one `Family`: its einfold source, its torch function (the eager and
compiled baseline and, on float64 copies, the oracle), random inputs at given
extents, and its sizes. tests/test_bench_general.py runs every source (reference
backend and Triton's interpreter) against its torch function in float64 at tiny sizes.
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from . import bench

Inputs = dict
Result = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Family:
    name: str
    source: str
    torch_fn: Callable[[Inputs], Result]            # the computation in plain torch, as a user writes it
    make: Callable[[dict, torch.dtype, torch.Generator], Inputs]   # (extents, dtype, generator) -> inputs
    sizes: tuple[dict, ...]                         # extents of each full-size case
    quick: dict                                     # extents of the one --quick case
    work: Callable[[dict, int], float]              # (extents, bytes per element) -> FLOPs or bytes
    unit: str                                       # "TFLOP/s" or "GB/s"
    dtype: torch.dtype = torch.bfloat16
    outputs: tuple[str, ...] | None = None          # the statements a call returns, where not the default
    # other ways to write it in torch, each timed eager and under torch.compile
    spellings: dict[str, Callable[[Inputs], Result]] = field(default_factory=dict)
    # hand-written libraries a user would call instead (imported on the first call)
    libraries: dict[str, Callable[[Inputs], Result]] = field(default_factory=dict)
    note: str = ""
    summaries: tuple = ()                           # user summaries the source names
    # the torch.compile baseline, where compiling torch_fn whole is not what a user would do
    # (a loop over thousands of steps, which dynamo unrolls): None compiles torch_fn
    compiled: Callable[[Inputs], Result] | None = None


def _randn(g: torch.Generator, dtype: torch.dtype, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=g, device=g.device, dtype=torch.float32)).to(dtype)


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """float32 math for 16-bit storage; float64 stays float64 (the oracle)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _library(module: str, name: str, call: Callable) -> Callable[[Inputs], Result]:
    """A library baseline `call(function, inputs)`, its function imported on the first call:
    where the package is missing that call raises, and run_case makes the row "unavailable"."""
    function = functools.cache(lambda: getattr(importlib.import_module(module), name))
    return lambda x: call(function(), x)


LIGER = "liger_kernel.transformers.functional"


def _labels(g: torch.Generator, rows: int, vocab: int, ignored: float = 0.0) -> torch.Tensor:
    """Class labels, int64; a fraction `ignored` of them -100 (torch's and Liger's ignore_index)."""
    labels = torch.randint(0, vocab, (rows,), generator=g, device=g.device)
    dropped = torch.rand(rows, generator=g, device=g.device) < ignored
    return labels.masked_fill(dropped, -100)


def _one_hot(labels: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense one-hot rows of the labels, zero rows where ignored (the spelling of the labels
    before integer inputs: the families that read it keep their measured programs)."""
    return F.one_hot(labels.clamp_min(0), vocab).to(dtype) * (labels >= 0)[:, None].to(dtype)


# ---------------------------------------------------------------- MLP layers
SWIGLU = "G[i,f] = silu(sum[d](X[i,d] * W1[f,d])) * sum[d](X[i,d] * W3[f,d])"
SWIGLU_MLP = f"{SWIGLU}\nY[i,e] = G[i,f] * W2[e,f]"
GELU_MLP = "H[i,f] = gelu(X[i,d] * W1[f,d] + B1[f])\nY[i,e] = H[i,f] * W2[e,f] + B2[e]"


def torch_swiglu(x):
    return F.silu(x["X"] @ x["W1"].T) * (x["X"] @ x["W3"].T)


def torch_swiglu_mlp(x):
    return torch_swiglu(x) @ x["W2"].T


def torch_gelu_mlp(x):
    return F.linear(F.gelu(F.linear(x["X"], x["W1"], x["B1"])), x["W2"], x["B2"])


# Liger's SwiGLU takes both projections, computed by torch (as LigerSwiGLUMLP does)
liger_swiglu = _library(LIGER, "liger_swiglu", lambda swiglu, x: swiglu(x["X"] @ x["W1"].T, x["X"] @ x["W3"].T))


def make_mlp(n, dtype, g):
    d, f, e = n["d"], n["f"], n.get("e", n["d"])
    return {"X": _randn(g, dtype, n["i"], d), "W1": _randn(g, dtype, f, d, scale=d ** -0.5),
            "W3": _randn(g, dtype, f, d, scale=d ** -0.5), "W2": _randn(g, dtype, e, f, scale=f ** -0.5),
            "B1": _randn(g, dtype, f, scale=0.1), "B2": _randn(g, dtype, e, scale=0.1)}


# ---------------------------------------------------------------- distances
CHAMFER = "C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))"
KMEANS = "A[i] = argmin[c](sum[k]((X[i,k] - M[c,k]) ** 2), c)"


def torch_chamfer(x):
    return torch.cdist(x["X"], x["Y"]).square().amin(-1)


def expanded_chamfer(x):
    """|x|^2 - 2 x.y + |y|^2: one batched matmul, as fast torch code writes the distances."""
    X, Y = x["X"], x["Y"]
    squared = X.square().sum(-1)[..., :, None] - 2 * X @ Y.mT + Y.square().sum(-1)[..., None, :]
    return squared.amin(-1)


def make_chamfer(n, dtype, g):
    return {"X": _randn(g, dtype, n["b"], n["i"], n["k"]), "Y": _randn(g, dtype, n["b"], n["m"], n["k"])}


def torch_kmeans(x):
    return torch.cdist(x["X"], x["M"]).argmin(1)


def expanded_kmeans(x):
    """|c|^2 - 2 x.c (|x|^2 does not change the argmin), as k-means libraries write it."""
    return (x["M"].square().sum(1) - 2 * x["X"] @ x["M"].T).argmin(1)


def make_kmeans(n, dtype, g):
    return {"X": _randn(g, dtype, n["i"], n["k"]), "M": _randn(g, dtype, n["c"], n["k"])}


# ---------------------------------------------------------------- losses
LINEAR_CROSS_ENTROPY = bench.CROSS_ENTROPY
MASKED_CROSS_ENTROPY = "L[i] = M[i] * (logsumexp[v](Z[i,v]) - sum[v](Y[i,v] * Z[i,v]))"
# the label as a float tensor compared with the vocabulary index: no one-hot matrix to read
LABEL_CROSS_ENTROPY = "L[i] = where(T[i] < 0, 0.0, logsumexp[v](Z[i,v]) - sum[v](where(v == T[i], Z[i,v], 0.0)))"
MEAN_CROSS_ENTROPY = "L[] = mean[t](logsumexp[v](Z[t,v]) - sum[v](Y[t,v] * Z[t,v]))"
# integer labels read through a gathered subscript: each row's label logit is one element
LABELLED_CROSS_ENTROPY = "L[i] = where(labels[i] == -100, 0.0, logsumexp[v](Z[i,v]) - Z[i, labels[i]])"
LINEAR_LABELLED_CROSS_ENTROPY = "L[i] = logsumexp[v](H[i,k] * W[v,k]) - sum[k](H[i,k] * W[labels[i],k])"
EMBEDDING = "Y[i,d] = E[ids[i],d]"


def torch_embedding(x):
    return F.embedding(x["ids"], x["E"])


def make_embedding(n, dtype, g):
    return {"E": _randn(g, dtype, n["v"], n["d"]),
            "ids": torch.randint(0, n["v"], (n["i"],), generator=g, device=g.device)}


def torch_logits_cross_entropy(x):
    return F.cross_entropy(x["Z"], x["labels"], reduction="none")


def torch_mean_cross_entropy(x):
    return F.cross_entropy(x["Z"], x["labels"])


liger_linear_cross_entropy = _library(LIGER, "liger_fused_linear_cross_entropy",
                                      lambda flce, x: flce(x["H"], x["W"], x["labels"], reduction="none"))
cut_cross_entropy = _library("cut_cross_entropy", "linear_cross_entropy",
                             lambda cce, x: cce(x["H"], x["W"], x["labels"], reduction="none"))
liger_cross_entropy = _library(LIGER, "liger_cross_entropy",
                               lambda ce, x: ce(x["Z"], x["labels"], reduction="none"))
liger_mean_cross_entropy = _library(LIGER, "liger_cross_entropy", lambda ce, x: ce(x["Z"], x["labels"]))


def make_linear_cross_entropy(n, dtype, g):
    labels = _labels(g, n["i"], n["v"])
    return {"H": _randn(g, dtype, n["i"], n["k"]), "W": _randn(g, dtype, n["v"], n["k"], scale=0.02),
            "labels": labels, "Y": _one_hot(labels, n["v"], dtype)}


def make_logits(rows: str, ignored: float):
    """Logits Z[rows, v] and their labels, a fraction `ignored` of the rows ignored: as int labels
    (torch, Liger), as a one-hot Y with a float mask M (1 kept, 0 ignored), and as float ids T."""
    def make(n, dtype, g):
        labels = _labels(g, n[rows], n["v"], ignored)
        return {"Z": _randn(g, dtype, n[rows], n["v"], scale=2.0), "labels": labels,
                "Y": _one_hot(labels, n["v"], dtype), "M": (labels >= 0).to(dtype),
                "T": labels.to(torch.promote_types(dtype, torch.float32))}
    return make


SINKHORN = "f[i] = -eps * logsumexp[j]((g[j] - C[i,j]) / eps)"


def torch_sinkhorn(x):
    return -x["eps"] * torch.logsumexp((x["g"] - x["C"]) / x["eps"], dim=1)


def make_sinkhorn(n, dtype, g):
    return {"C": torch.rand(n["i"], n["j"], generator=g, device=g.device).to(dtype),
            "g": _randn(g, dtype, n["j"], scale=0.1), "eps": 0.05}


# ---------------------------------------------------------------- norms and statistics
ADD_RMSNORM = ("S[i,k] = X[i,k] + R[i,k]\n"
               "Y[i,k] = S[i,k] * rsqrt(mean[n](S[i,n] ** 2) + eps) * G[k]")
GROUPNORM = ("mu[b,g] = mean[c,s](X[b,g,c,s])\n"
             "var[b,g] = mean[c,s]((X[b,g,c,s] - mu[b,g]) ** 2)\n"
             "Y[b,g,c,s] = (X[b,g,c,s] - mu[b,g]) * rsqrt(var[b,g] + eps) * G[g,c] + B[g,c]")
ROW_STATISTICS = ("mu[i] = mean[k](X[i,k])\n"
                  "var[i] = mean[k]((X[i,k] - mu[i]) ** 2)\n"
                  "hi[i] = max[k](X[i,k])\n"
                  "lo[i] = min[k](X[i,k])")
COLUMN_STATISTICS = "mu[k] = mean[n](X[n,k])\nvar[k] = mean[n]((X[n,k] - mu[k]) ** 2)"


def torch_add_rmsnorm(x):
    """The residual stream's sum and its RMSNorm, as a decoder layer returns both."""
    s = x["X"] + x["R"]
    return s, bench.torch_rmsnorm({"X": s, "G": x["G"], "eps": x["eps"]})


def torch_groupnorm(x):
    X = x["X"]
    b, groups, c, s = X.shape
    return F.group_norm(X.reshape(b, groups * c, s), groups, x["G"].reshape(-1), x["B"].reshape(-1),
                        x["eps"]).view_as(X)


def torch_row_statistics(x):
    var, mean = torch.var_mean(_at_least_float32(x["X"]), dim=1, correction=0)
    return mean.to(x["X"].dtype), var.to(x["X"].dtype), x["X"].amax(1), x["X"].amin(1)


def torch_column_statistics(x):
    var, mean = torch.var_mean(_at_least_float32(x["X"]), dim=0, correction=0)
    return mean.to(x["X"].dtype), var.to(x["X"].dtype)


def _liger_add_rmsnorm(add_rms_norm, x):
    y, s = add_rms_norm(x["X"], x["R"], x["G"], x["eps"])
    return s, y


def _liger_groupnorm(group_norm, x):
    X = x["X"]
    b, groups, c, s = X.shape
    return group_norm(X.reshape(b, groups * c, s), x["G"].reshape(-1), x["B"].reshape(-1), groups * c, groups,
                      x["eps"]).view_as(X)


def make_rows(n, dtype, g):
    """Activations X[i,k] (and a residual R), a norm's weight G and bias B."""
    return {"X": _randn(g, dtype, n["i"], n["k"]), "R": _randn(g, dtype, n["i"], n["k"]),
            "G": 1 + _randn(g, dtype, n["k"], scale=0.1), "B": _randn(g, dtype, n["k"], scale=0.1), "eps": 1e-6}


def make_groupnorm(n, dtype, g):
    return {"X": _randn(g, dtype, n["b"], n["g"], n["c"], n["s"], scale=2.0),
            "G": 1 + _randn(g, dtype, n["g"], n["c"], scale=0.1), "B": _randn(g, dtype, n["g"], n["c"], scale=0.1),
            "eps": 1e-5}


def make_columns(n, dtype, g):
    return {"X": 1 + _randn(g, dtype, n["n"], n["k"])}


# ---------------------------------------------------------------- attention-like
RETENTION = "O[b,h,i,j] = where(m <= i, G[h] ** (i - m), 0.0) * sum[k](Q[b,h,i,k] * K[b,h,m,k]) * V[b,h,m,j]"
MLA_DECODE = "O[b,h,c] = softmax[m](sum[c2](Q[b,h,c2] * C[b,m,c2]) * scale) * C[b,m,c]"
LINEAR_ATTENTION = ("KV[b,h,k,j] = K[b,h,m,k] * V[b,h,m,j]\n"
                    "Z[b,h,k] = sum[m](K[b,h,m,k])\n"
                    "O[b,h,i,j] = sum[k](Q[b,h,i,k] * KV[b,h,k,j]) / sum[k](Q[b,h,i,k] * Z[b,h,k])")
GAUSSIAN_MIXTURE = "L[n] = logsumexp[c](A[c] - 0.5 * sum[e](sum[d]((X[n,d] - Mu[c,d]) * P[c,d,e]) ** 2))"


def torch_retention(x):
    """RetNet's parallel retention, (Q K^T * D) V with D[h,i,m] = gamma_h^(i-m) where m <= i
    (without the normalisation of D's rows that RetNet adds)."""
    q, k, gamma = x["Q"], x["K"], x["G"]
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    m = torch.arange(k.shape[-2], device=q.device)[None, :]
    decay = torch.where(m <= i, gamma[:, None, None] ** (i - m), 0.0)
    return ((q @ k.mT) * decay) @ x["V"].to(decay.dtype)


def make_retention(n, dtype, g):
    b, h = n["b"], n["h"]
    return {"Q": _randn(g, dtype, b, h, n["i"], n["k"]), "K": _randn(g, dtype, b, h, n["m"], n["k"]),
            "V": _randn(g, dtype, b, h, n["m"], n["j"]),
            # RetNet's per-head decays 1 - 2^(-5 - h), in float32 (1 - 2^-20 is 1 in bf16)
            "G": 1 - 2.0 ** (-5 - torch.arange(h, device=g.device, dtype=torch.promote_types(dtype, torch.float32)))}


def torch_mla_decode(x):
    return torch.softmax(x["Q"] @ x["C"].mT * x["scale"], dim=-1) @ x["C"]


def sdpa_mla_decode(x):
    """The heads as queries of one head whose keys and values are the latent cache."""
    C = x["C"][:, None]
    return F.scaled_dot_product_attention(x["Q"][:, None], C, C, scale=x["scale"])[:, 0]


def make_mla_decode(n, dtype, g):
    return {"Q": _randn(g, dtype, n["b"], n["h"], n["c"]), "C": _randn(g, dtype, n["b"], n["m"], n["c"]),
            "scale": 1 / math.sqrt(n["c"])}


def torch_linear_attention(x):
    """Non-causal linear attention with its normaliser, associated as (K^T V) first."""
    q, k = x["Q"], x["K"]
    return (q @ (k.mT @ x["V"])) / (q @ k.sum(-2)[..., None])


def make_linear_attention(n, dtype, g):
    b, h = n["b"], n["h"]
    # queries and keys through the feature map elu(x) + 1, positive as the normaliser needs
    return {"Q": (F.elu(_randn(g, torch.float32, b, h, n["i"], n["k"])) + 1).to(dtype),
            "K": (F.elu(_randn(g, torch.float32, b, h, n["m"], n["k"])) + 1).to(dtype),
            "V": _randn(g, dtype, b, h, n["m"], n["j"])}


def torch_gaussian_mixture(x):
    """scikit-learn's log-likelihood of a full-covariance mixture: y = (x - mu_c) P_c, with P_c
    the Cholesky factor of component c's precision, and A[c] its log weight and normaliser."""
    P = x["P"]
    y = torch.einsum("nd,cde->nce", x["X"], P) - torch.einsum("cd,cde->ce", x["Mu"], P)
    return torch.logsumexp(x["A"] - 0.5 * y.square().sum(-1), dim=1)


def make_gaussian_mixture(n, dtype, g):
    c, d = n["c"], n["d"]
    # lower-triangular factors with a positive diagonal near 1
    P = torch.tril(_randn(g, torch.float64, c, d, d, scale=0.1)) + torch.eye(d, device=g.device, dtype=torch.float64)
    log_weights = torch.log_softmax(_randn(g, torch.float64, c), 0)
    A = log_weights + P.diagonal(dim1=1, dim2=2).log().sum(-1) - d / 2 * math.log(2 * math.pi)
    return {"X": _randn(g, dtype, n["n"], d), "Mu": _randn(g, dtype, c, d), "P": P.to(dtype), "A": A.to(dtype)}


CUMSUM = "C[b,t] = sum[s](where(s <= t, X[b,s], 0.0))"
LOGCUMSUMEXP = "C[b,t] = logsumexp[s](where(s <= t, X[b,s], -inf))"
CDF = "F[b,t] = sum[s](where(s <= t, P[b,s], 0.0)) / sum[s](P[b,s])"
# Mamba's selective scan: h[t] = exp(D[t] A) h[t-1] + D[t] B[t] x[t] per channel d and state n,
# y[t] = C[t] . h[t]; the recurrence is the prefix of the affine maps h -> a h + b
SELECTIVE_SCAN = ("H[b,d,n,t] = affine[s](where(s <= t, exp(D[b,d,s] * A[d,n]), 1.0), "
                  "where(s <= t, D[b,d,s] * Bm[b,n,s] * X[b,d,s], 0.0))\n"
                  "Y[b,d,t] = sum[n](C[b,n,t] * H[b,d,n,t])")


@functools.cache
def affine_summary():
    """The composition of affine maps h -> A h + B, in order: a linear recurrence's summary."""
    import compiler
    return compiler.summary("affine", fields=("A", "B"), identity=(1.0, 0.0), lift=lambda a, b: (a, b),
                            combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B), finalize=lambda s: s.B)


def make_sequence(n, dtype, g):
    return {"X": _randn(g, dtype, n["b"], n["t"]), "t": n["t"]}


def torch_cumsum(x):
    return x["X"].cumsum(-1)


def make_weights(n, dtype, g):
    return {"P": torch.rand(n["b"], n["t"], generator=g, device=g.device, dtype=torch.float32).to(dtype),
            "t": n["t"]}


def torch_cdf(x):
    p = _at_least_float32(x["P"])
    return p.cumsum(-1) / p.sum(-1, keepdim=True)


def torch_logcumsumexp(x):
    return x["X"].logcumsumexp(-1)


def _selective_step(h, d, a, b, c, x):
    h = torch.exp(d[..., None] * a) * h + d[..., None] * b[:, None, :] * x[..., None]
    return h, (h * c[:, None, :]).sum(-1)


def torch_selective_scan(x, step=_selective_step):
    """The recurrence step by step, as Mamba's reference (selective_scan_ref) runs it, in
    float32 (or float64)."""
    D, A, Bm, C, X = (_at_least_float32(x[k]) for k in ("D", "A", "Bm", "C", "X"))
    h = torch.zeros(*D.shape[:2], A.shape[1], device=D.device, dtype=D.dtype)
    ys = []
    for t in range(D.shape[-1]):
        h, y = step(h, D[..., t], A, Bm[..., t], C[..., t], X[..., t])
        ys.append(y)
    return torch.stack(ys, -1)


@functools.cache
def _compiled_selective_step():
    return torch.compile(_selective_step, dynamic=False)


def compiled_selective_scan(x):
    """The loop around a torch.compile'd step (compiling the whole loop unrolls every step)."""
    return torch_selective_scan(x, _compiled_selective_step())


def make_selective_scan(n, dtype, g):
    b, d, s, t = n["b"], n["d"], n["n"], n["t"]
    return {"D": (F.softplus(_randn(g, torch.float32, b, d, t) - 3)).to(dtype),   # Mamba's delta, softplus'd
            "A": (-torch.exp(_randn(g, torch.float32, d, s, scale=0.5))).to(dtype),
            "Bm": _randn(g, dtype, b, s, t), "C": _randn(g, dtype, b, s, t), "X": _randn(g, dtype, b, d, t)}


# ---------------------------------------------------------------- the families
def _bytes(*counts: str):
    """GB/s work: each named extent product (e.g. "i*k") read or written once."""
    return lambda n, size: size * sum(math.prod(n[name] for name in count.split("*")) for count in counts)


FAMILIES = [
    Family("swiglu", SWIGLU, torch_swiglu, make_mlp,
           ({"i": 4096, "d": 4096, "f": 11008},), {"i": 2048, "d": 2048, "f": 5632},
           lambda n, _: 4 * n["i"] * n["d"] * n["f"], "TFLOP/s",
           libraries={"liger swiglu + torch matmuls": liger_swiglu}),
    Family("swiglu mlp", SWIGLU_MLP, torch_swiglu_mlp, make_mlp,
           ({"i": 4096, "d": 4096, "f": 11008, "e": 4096},), {"i": 2048, "d": 2048, "f": 5632, "e": 2048},
           lambda n, _: 2 * n["i"] * n["f"] * (2 * n["d"] + n["e"]), "TFLOP/s",
           libraries={"liger swiglu + torch matmuls": lambda x: liger_swiglu(x) @ x["W2"].T}),
    Family("gelu mlp", GELU_MLP, torch_gelu_mlp, make_mlp,
           ({"i": 8192, "d": 2048, "f": 8192, "e": 2048},), {"i": 2048, "d": 1024, "f": 4096, "e": 1024},
           lambda n, _: 2 * n["i"] * n["f"] * (n["d"] + n["e"]), "TFLOP/s"),
    Family("chamfer", CHAMFER, torch_chamfer, make_chamfer,
           ({"b": 4, "i": 8192, "m": 8192, "k": 3}, {"b": 4, "i": 8192, "m": 8192, "k": 64}),
           {"b": 1, "i": 4096, "m": 4096, "k": 3},
           lambda n, _: 3 * n["b"] * n["i"] * n["m"] * n["k"], "TFLOP/s", dtype=torch.float32,
           spellings={"expanded": expanded_chamfer},
           note="3 FLOPs per (pair, coordinate)"),
    Family("k-means assign", KMEANS, torch_kmeans, make_kmeans,
           ({"i": 262144, "c": 1024, "k": 64},), {"i": 65536, "c": 256, "k": 64},
           lambda n, _: 3 * n["i"] * n["c"] * n["k"], "TFLOP/s", dtype=torch.float32,
           spellings={"expanded": expanded_kmeans},
           note="3 FLOPs per (point, centre, coordinate)"),
    Family("linear cross-entropy", LINEAR_CROSS_ENTROPY, bench.torch_cross_entropy, make_linear_cross_entropy,
           ({"i": 8192, "k": 2048, "v": 32000},), {"i": 2048, "k": 1024, "v": 16000},
           lambda n, _: 2 * n["i"] * n["k"] * n["v"], "TFLOP/s",
           libraries={"liger fused linear CE": liger_linear_cross_entropy, "cut cross-entropy": cut_cross_entropy},
           note="einfold reads the labels as a dense one-hot Y here (integer labels would skip it), "
                "the others as int64; forward only; FLOPs of the logits' matmul"),
    Family("linear cross-entropy, int labels", LINEAR_LABELLED_CROSS_ENTROPY, bench.torch_cross_entropy,
           make_linear_cross_entropy,
           ({"i": 8192, "k": 2048, "v": 32000},), {"i": 2048, "k": 1024, "v": 16000},
           lambda n, _: 2 * n["i"] * n["k"] * n["v"], "TFLOP/s",
           libraries={"liger fused linear CE": liger_linear_cross_entropy, "cut cross-entropy": cut_cross_entropy},
           note="the labels as int64 for all: the label's logit a gathered row W[labels[i], k]; forward only; "
                "FLOPs of the logits' matmul"),
    Family("embedding", EMBEDDING, torch_embedding, make_embedding,
           ({"i": 16384, "v": 50257, "d": 4096},), {"i": 4096, "v": 50257, "d": 2048},
           _bytes("i*d", "i*d"), "GB/s", note="rows gathered through int64 ids; forward only"),
    Family("sinkhorn step", SINKHORN, torch_sinkhorn, make_sinkhorn,
           ({"i": 4096, "j": 4096},), {"i": 2048, "j": 2048},
           _bytes("i*j", "j", "i"), "GB/s", dtype=torch.float32),
    Family("residual + rmsnorm", ADD_RMSNORM, torch_add_rmsnorm, make_rows,
           ({"i": 16384, "k": 4096},), {"i": 4096, "k": 4096},
           _bytes("i*k", "i*k", "k", "i*k", "i*k"), "GB/s", outputs=("S", "Y"),
           libraries={"liger fused add rmsnorm": _library(LIGER, "liger_fused_add_rms_norm", _liger_add_rmsnorm)}),
    Family("rmsnorm", bench.RMSNORM, bench.torch_rmsnorm, make_rows,
           ({"i": 16384, "k": 4096},), {"i": 4096, "k": 4096},
           _bytes("i*k", "k", "i*k"), "GB/s",
           libraries={"liger rmsnorm": _library(LIGER, "liger_rms_norm",
                                                lambda rms_norm, x: rms_norm(x["X"], x["G"], x["eps"]))}),
    Family("layernorm", bench.LAYERNORM_AFFINE, bench.torch_layernorm, make_rows,
           ({"i": 16384, "k": 4096},), {"i": 4096, "k": 4096},
           _bytes("i*k", "k", "k", "i*k"), "GB/s",
           # the source's eps is 1e-5, as torch_layernorm's
           libraries={"liger layernorm": _library(LIGER, "liger_layer_norm",
                                                  lambda layer_norm, x: layer_norm(x["X"], x["G"], x["B"], 1e-5))}),
    Family("groupnorm", GROUPNORM, torch_groupnorm, make_groupnorm,
           ({"b": 32, "g": 32, "c": 16, "s": 4096},), {"b": 8, "g": 32, "c": 16, "s": 4096},
           _bytes("b*g*c*s", "g*c", "g*c", "b*g*c*s"), "GB/s",
           libraries={"liger groupnorm": _library(LIGER, "liger_group_norm", _liger_groupnorm)},
           note="X as [batch, group, channel of the group, spatial]"),
    Family("masked cross-entropy", MASKED_CROSS_ENTROPY, torch_logits_cross_entropy, make_logits("i", 0.1),
           ({"i": 8192, "v": 32000},), {"i": 2048, "v": 32000},
           _bytes("i*v", "i*v", "i", "i"), "GB/s",
           libraries={"liger cross-entropy": liger_cross_entropy},
           note="10% of rows ignored: a float mask M for ours, ignore_index -100 for the others; "
                "einfold reads the labels as a dense one-hot Y"),
    Family("label-id cross-entropy", LABEL_CROSS_ENTROPY, torch_logits_cross_entropy, make_logits("i", 0.1),
           ({"i": 8192, "v": 32000},), {"i": 2048, "v": 32000},
           lambda n, size: size * n["i"] * n["v"] + 8 * n["i"], "GB/s",
           libraries={"liger cross-entropy": liger_cross_entropy},
           note="the labels as float32 ids T (-100 ignored), exact below 2^24; the result is float32"),
    Family("labelled cross-entropy", LABELLED_CROSS_ENTROPY, torch_logits_cross_entropy, make_logits("i", 0.1),
           ({"i": 8192, "v": 32000},), {"i": 2048, "v": 32000},
           lambda n, size: size * n["i"] * n["v"] + 8 * n["i"], "GB/s",
           libraries={"liger cross-entropy": liger_cross_entropy},
           note="10% of rows ignored (-100); int64 labels for all: the label's logit a gathered element"),
    Family("mean cross-entropy", MEAN_CROSS_ENTROPY, torch_mean_cross_entropy, make_logits("t", 0.0),
           ({"t": 8192, "v": 32000},), {"t": 2048, "v": 32000},
           _bytes("t*v", "t*v"), "GB/s",
           libraries={"liger cross-entropy": liger_mean_cross_entropy},
           note="one scalar; einfold reads the labels as a dense one-hot Y"),
    Family("row statistics", ROW_STATISTICS, torch_row_statistics, make_rows,
           ({"i": 16384, "k": 4096},), {"i": 4096, "k": 4096},
           _bytes("i*k", "i", "i", "i", "i"), "GB/s", outputs=("mu", "var", "hi", "lo")),
    Family("column statistics", COLUMN_STATISTICS, torch_column_statistics, make_columns,
           ({"n": 262144, "k": 256},), {"n": 65536, "k": 256},
           _bytes("n*k", "k", "k"), "GB/s", outputs=("mu", "var"),
           note="batch norm's statistics: each column's mean and variance"),
    Family("retention", RETENTION, torch_retention, make_retention,
           ({"b": 4, "h": 16, "i": 2048, "m": 2048, "k": 128, "j": 128},),
           {"b": 2, "h": 16, "i": 1024, "m": 1024, "k": 128, "j": 128},
           lambda n, _: n["b"] * n["h"] * n["i"] * n["m"] * (n["k"] + n["j"]), "TFLOP/s",
           note="causal: half the pairs' FLOPs; float32 decays make the result float32"),
    Family("gaussian mixture", GAUSSIAN_MIXTURE, torch_gaussian_mixture, make_gaussian_mixture,
           ({"n": 65536, "c": 64, "d": 32},), {"n": 16384, "c": 64, "d": 32},
           lambda n, _: 2 * n["n"] * n["c"] * n["d"] ** 2, "TFLOP/s", dtype=torch.float32,
           note="full covariances, by the Cholesky factors P of the precisions"),
    Family("mla decode", MLA_DECODE, torch_mla_decode, make_mla_decode,
           ({"b": 16, "h": 128, "m": 4096, "c": 512},), {"b": 4, "h": 128, "m": 4096, "c": 512},
           lambda n, _: 4 * n["b"] * n["h"] * n["m"] * n["c"], "TFLOP/s",
           spellings={"sdpa": sdpa_mla_decode}),
    Family("linear attention", LINEAR_ATTENTION, torch_linear_attention, make_linear_attention,
           ({"b": 4, "h": 16, "i": 4096, "m": 4096, "k": 128, "j": 128},),
           {"b": 2, "h": 16, "i": 2048, "m": 2048, "k": 128, "j": 128},
           _bytes("b*h*i*k", "b*h*m*k", "b*h*m*j", "b*h*i*j"), "GB/s"),
    Family("cumsum", CUMSUM, torch_cumsum, make_sequence,
           ({"b": 4096, "t": 4096}, {"b": 16, "t": 262144}), {"b": 1024, "t": 4096},
           _bytes("b*t", "b*t"), "GB/s", note="a prefix scan: t in order through each program"),
    Family("cdf", CDF, torch_cdf, make_weights,
           ({"b": 4096, "t": 4096},), {"b": 1024, "t": 4096},
           _bytes("b*t", "b*t"), "GB/s", note="the row's total, then the prefix scanned in the epilogue loop"),
    Family("logcumsumexp", LOGCUMSUMEXP, torch_logcumsumexp, make_sequence,
           ({"b": 4096, "t": 4096},), {"b": 1024, "t": 4096},
           _bytes("b*t", "b*t"), "GB/s"),
    Family("selective scan", SELECTIVE_SCAN, torch_selective_scan, make_selective_scan,
           ({"b": 4, "d": 1536, "n": 16, "t": 2048},), {"b": 2, "d": 768, "n": 16, "t": 1024},
           _bytes("b*d*t", "b*n*t", "b*n*t", "b*d*t", "b*d*t"), "GB/s", outputs=("Y",),
           summaries=(affine_summary,), compiled=compiled_selective_scan,
           note="Mamba's recurrence, state n held whole; torch steps through t (a compiled step)"),
]


def _label(extents: dict, dtype: torch.dtype) -> str:
    short = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    return " ".join(f"{name}{extent}" for name, extent in extents.items()) + f" {short}"


def general_cases(compile_, quick: bool) -> list[bench.Case]:
    """Every family at its sizes (one smaller size with `quick`): ours against its torch function
    and other torch spellings, each torch.compile'd and eager, and its libraries; errors against
    the torch function on float64 copies of the inputs."""
    cases = []
    for family in FAMILIES:
        # compiled on the first call, so that a program the compiler rejects is a FAILED row
        # of its case, not the end of the group; one program for all sizes
        program = functools.cache(lambda family=family: bench._inputs_of(
            compile_(family.source, outputs=family.outputs, summaries=[make() for make in family.summaries])))
        baselines = {"torch.compile": family.compiled or torch.compile(family.torch_fn, dynamic=False),
                     "torch eager": family.torch_fn}
        for name, fn in family.spellings.items():
            baselines |= {f"torch.compile, {name}": torch.compile(fn, dynamic=False), f"torch eager, {name}": fn}
        baselines |= family.libraries
        for extents in ((family.quick,) if quick else family.sizes):
            def make(family=family, extents=extents):
                return family.make(extents, family.dtype, torch.Generator(device="cuda").manual_seed(0))
            cases.append(bench.Case("general", f"{family.name} {_label(extents, family.dtype)}",
                                    family.work(extents, family.dtype.itemsize), family.unit, make,
                                    lambda x, program=program: program()(x), baselines,
                                    reference=bench.float64_oracle(family.torch_fn), note=family.note))
    return cases


GROUPS = {"general": general_cases}
