"""`einfold bench`: the generated kernels against what a user would pick
instead, side by side in one run on the GPU, as ratios.

Every case checks each contender against its float64 oracle where it has one,
else against the first baseline (relative error in float64), times each
contender with the median of triton.testing.do_bench, records the peak GPU
memory one call allocates, and reports TFLOP/s (FLOP-bound cases) or GB/s
(memory-bound cases, each input read once and each output written once).
Results go to stdout as a table and to OUT/bench.{csv,json,png}.
"""
from __future__ import annotations

import csv
import json
import math
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Case:
    group: str
    name: str
    work: float                      # FLOPs or bytes
    unit: str                        # "TFLOP/s" or "GB/s"
    make: Callable[[], dict]         # -> inputs
    # each contender returns a tensor, or a tuple of them for a program with several outputs
    ours: Callable[[dict], torch.Tensor]
    baselines: dict[str, Callable[[dict], torch.Tensor]]
    tolerance: float = 2e-2
    # ours compiled afresh from its source, then called: when given, run_case times this
    # first call against the first baseline's first call (two "compile" rows)
    fresh: Callable[[dict], torch.Tensor] | None = None
    # the exact answer (float64_oracle of a baseline): when given, every contender's error is
    # against it instead of against the first baseline
    reference: Callable[[dict], torch.Tensor] | None = None
    note: str = ""                   # said on ours' row


@dataclass
class Row:
    group: str
    name: str
    contender: str
    ms: float
    rate: float
    unit: str
    ratio_ours_over_this: float | None = None
    error: float | None = None
    peak_mib: float | None = None    # GPU memory one call allocates at its peak, its output included
    note: str = ""
    extra: dict = field(default_factory=dict)


def _rate(work: float, unit: str, ms: float) -> float:
    return work / (ms * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9)


def _error(got, want) -> float:
    """Relative error in float64; of several outputs (tuples), the largest of theirs. Another
    shape or number of outputs is infinitely wrong (not broadcast)."""
    if isinstance(want, tuple) or isinstance(got, tuple):
        if not (isinstance(want, tuple) and isinstance(got, tuple)) or len(got) != len(want):
            return math.inf
        return max(_error(g, w) for g, w in zip(got, want))
    if got.shape != want.shape:
        return math.inf
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


class _Float64Inputs(Mapping):
    """A case's inputs with each floating tensor copied to float64 when first read, so that an
    oracle copies only the inputs it reads (a float64 one-hot beside int labels would be GiBs)."""

    def __init__(self, inputs: dict):
        self._inputs, self._copies = inputs, {}

    def __getitem__(self, name):
        if name not in self._copies:
            value = self._inputs[name]
            is_float = isinstance(value, torch.Tensor) and value.is_floating_point()
            self._copies[name] = value.detach().double() if is_float else value
        return self._copies[name]

    def __iter__(self):
        return iter(self._inputs)

    def __len__(self):
        return len(self._inputs)


def float64_oracle(fn: Callable[[dict], torch.Tensor]) -> Callable[[dict], torch.Tensor]:
    """fn run on float64 copies of the inputs: a case's `reference`."""
    return lambda x: fn(_Float64Inputs(x))


# ---------------------------------------------------------------- cases
ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
THREE_STATEMENTS = ("S[b,h,i,m] = Q[b,h,i,k] * K[b,h,m,k] * scale\n"
                    "P[b,h,i,m] = softmax[m](S[b,h,i,m])\n"
                    "O[b,h,i,j] = P[b,h,i,m] * V[b,h,m,j]")
SOFTMAX = "P[i,j] = softmax[j](X[i,j])"
LAYERNORM = ("mu[i] = sum[j](X[i,j]) / len(j)\nvar[i] = sum[j]((X[i,j] - mu[i]) ** 2) / len(j)\n"
             "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + eps)")
LOGSUMEXP = "L[i] = logsumexp[j](X[i,j])"
ADD_GELU = "O[i,j] = gelu(X[i,j] + Y[i,j])"
MATMUL = "C[i,j] = A[i,k] * B[k,j]"


def _sdpa(backend_name: str, causal: bool, enable_gqa: bool = False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(x):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                x["Q"], x["K"], x["V"], is_causal=causal, scale=x["scale"], enable_gqa=enable_gqa)
    return run


def _naive_causal(x):
    s = (x["Q"] @ x["K"].transpose(-1, -2)) * x["scale"]
    n, m = s.shape[-2:]
    mask = torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1)
    return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ x["V"]


def attention_cases(compile_, quick: bool) -> list[Case]:
    import compiler
    cases = []
    shapes = [(64, 1024), (128, 1024)] if quick else [(d, s) for d in (64, 128) for s in (1024, 4096, 16384)]
    compiled_naive = torch.compile(_naive_causal)
    for d, s in shapes:
        b, h = 16384 // s, 2048 // d
        for causal in (False, True):
            def make(b=b, h=h, s=s, d=d):
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(3))
                return {"Q": q, "K": k, "V": v, "scale": 1 / math.sqrt(d)}
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            program = compile_(CAUSAL if causal else ATTENTION)
            baselines = {"sdpa_flash": _sdpa("FLASH_ATTENTION", causal),
                         "sdpa_cudnn": _sdpa("CUDNN_ATTENTION", causal)}
            if causal:
                baselines["torch.compile naive"] = compiled_naive
            else:
                three = compile_(THREE_STATEMENTS)
                baselines["einfold three statements"] = lambda x, p=three: p(**x)
            cases.append(Case("attention", f"B{b} H{h} S{s} d{d}{' causal' if causal else ''}", flops,
                              "TFLOP/s", make, lambda x, p=program: p(**x), baselines))
    del compiler
    return cases


def decode_cases(compile_, quick: bool) -> list[Case]:
    cases = []
    program = compile_(ATTENTION)
    for h in (8, 32):
        for length in ((8192,) if quick else (8192, 65536, 262144)):
            def make(h=h, length=length):
                g = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(1, h, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                k, v = (torch.randn(1, h, length, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                        for _ in range(2))
                return {"Q": q, "K": k, "V": v, "scale": 1 / math.sqrt(128)}
            nbytes = 2 * (2 * h * length * 128 + 2 * h * 128)
            baselines = {f"sdpa_{n.lower()}": _sdpa(n, False)
                         for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")}
            cases.append(Case("decode", f"H{h} L{length}", nbytes, "GB/s", make,
                              lambda x, p=program: p(**x), baselines))
    return cases


def _grad_of(forward, wrt=("Q", "K", "V")):
    """The backward alone, as FlashAttention's benchmarks time it: the forward runs
    once per input set (its graph kept), each call runs torch.autograd.grad of the
    output with respect to the inputs `wrt` against the fixed upstream gradient dO
    and returns the first of them, dQ (the error column compares dQ;
    tests/test_grad.py checks every gradient)."""
    kept = {}

    def run(x):
        if kept.get("inputs") is not x:            # a new input set: run its forward once
            kept.update(inputs=x, output=forward(x))
        return torch.autograd.grad(kept["output"], [x[n] for n in wrt], x["dO"], retain_graph=True)[0]
    return run


def backward_cases(compile_, quick: bool) -> list[Case]:
    """Attention backward (bf16, B*S = 16k tokens, H*d = 2048), causal and not,
    against SDPA's FLASH_ATTENTION and cuDNN backends; work = 2.5x the forward's FLOPs."""
    cases = []
    shapes = [(64, 1024), (128, 4096)] if quick else [(d, s) for d in (64, 128) for s in (1024, 4096, 16384)]
    for d, s in shapes:
        b, h = 16384 // s, 2048 // d
        for causal in (False, True):
            def make(b=b, h=h, s=s, d=d):
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
                               for _ in range(4))
                return {"Q": q.requires_grad_(), "K": k.requires_grad_(), "V": v.requires_grad_(),
                        "scale": 1 / math.sqrt(d), "dO": do}
            program = compile_(CAUSAL if causal else ATTENTION)
            ours = _grad_of(lambda x, p=program: p(Q=x["Q"], K=x["K"], V=x["V"], scale=x["scale"]))
            baselines = {f"sdpa_{n.lower()}": _grad_of(_sdpa(n, causal))
                         for n in ("FLASH_ATTENTION", "CUDNN_ATTENTION")}
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            cases.append(Case("backward", f"B{b} H{h} S{s} d{d}{' causal' if causal else ''}", flops,
                              "TFLOP/s", make, ours, baselines))
    return cases


# ---------------------------------------------------------------- training
# The backward of training workloads. The sources are tests/test_grad.py's corpus,
# attention on [b,h,i,k]; tests/test_bench_training.py checks their gradients, and
# the baselines below, against float64 torch.
LOGITS = {"softcap": "cap * tanh(Q[b,h,i,k] * K[b,h,m,k] * scale / cap)",
          "alibi": "Q[b,h,i,k] * K[b,h,m,k] * scale - A[h] * abs(i - m)"}
LAYERNORM_AFFINE = ("mu[i] = mean[k](X[i,k])\nvar[i] = mean[k]((X[i,k] - mu[i]) ** 2)\n"
                    "Y[i,k] = (X[i,k] - mu[i]) * rsqrt(var[i] + 1e-5) * G[k] + B[k]")
RMSNORM = "Y[i,k] = X[i,k] * rsqrt(mean[n](X[i,n] ** 2) + eps) * G[k]"
CROSS_ENTROPY = "L[i] = logsumexp[v](sum[k](H[i,k] * W[v,k])) - sum[v, k](Y[i,v] * H[i,k] * W[v,k])"


def attention_of(logits: str, keep: str | None = None) -> str:
    """Attention over `logits`, masked to -inf where the predicate `keep` fails."""
    if keep is not None:
        logits = f"where({keep}, {logits}, -inf)"
    return f"O[b,h,i,j] = softmax[m]({logits}) * V[b,h,m,j]"


def training_attention(variant: str, causal: bool) -> str:
    return attention_of(LOGITS[variant], "m <= i" if causal else None)


# FlexAttention's score_mod(score, b, h, q_idx, kv_idx) gets score = q.k * scale,
# so each of these is the logits above (a function of the inputs: ALiBi's captures
# the slopes, and FlexAttention's backward scatters their gradient).
def softcap_mod(x):
    cap = x["cap"]
    return lambda score, b, h, i, m: cap * torch.tanh(score / cap)


def alibi_mod(x):
    slopes = x["A"]
    # the distance in the score's dtype: a bf16 product slope * |i - m| would round
    # the bias by up to 4 at distances near 4096
    return lambda score, b, h, i, m: score - slopes[h] * (i - m).abs().to(score.dtype)


SCORE_MODS = {"softcap": softcap_mod, "alibi": alibi_mod}


# FlexAttention's mask_mod(b, h, q_idx, kv_idx): True where the pair is attended. Written
# with & so that kept_fraction can evaluate them on whole index grids.
def causal_mask(b, h, i, m):
    return m <= i


def window_mask(window: int):
    return lambda b, h, i, m: (m <= i) & (i - m < window)


def document_mask(docs: torch.Tensor):
    """Causal within each document; docs[b, i] is the document of token i."""
    return lambda b, h, i, m: (docs[b, i] == docs[b, m]) & (m <= i)


def kept_fraction(mask_mod, batch: int, s: int, device: str = "cpu") -> float:
    """The fraction of (b, i, m) that mask_mod keeps, counted exactly on the whole grid (a
    masked attention's FLOPs are those of the pairs kept)."""
    if mask_mod is None:
        return 1.0
    b = torch.arange(batch, device=device)[:, None, None]
    i, m = torch.arange(s, device=device)[:, None], torch.arange(s, device=device)[None, :]
    return int(mask_mod(b, 0, i, m).expand(batch, s, s).sum()) / (batch * s * s)


def _flex(s: int, score_mod=None, mask_mod=None, batch: int | None = None, enable_gqa: bool = False):
    """flex_attention compiled for one case: score_mod makes the score mod from the
    inputs (SCORE_MODS' values), mask_mod becomes a block mask over [batch (None: the
    mask does not depend on b), s, s]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # one graph per case, as FlexAttention's benchmarks compile it; past dynamo's
    # recompile_limit (8 graphs of flex_attention's frame) it would run unfused, eagerly
    torch._dynamo.config.recompile_limit += 1
    attend = torch.compile(flex_attention, dynamic=False)
    block_mask = create_block_mask(mask_mod, batch, None, s, s, device="cuda") if mask_mod else None

    def run(x):
        return attend(x["Q"], x["K"], x["V"], score_mod=score_mod(x) if score_mod else None,
                      block_mask=block_mask, scale=x["scale"], enable_gqa=enable_gqa)
    return run


def torch_layernorm(x):
    return torch.nn.functional.layer_norm(x["X"], x["X"].shape[-1:], x["G"], x["B"], eps=1e-5)


def torch_rmsnorm(x):
    X = x["X"].to(torch.promote_types(x["X"].dtype, torch.float32))   # float32 math for bf16 storage
    return (X * torch.rsqrt((X * X).mean(-1, keepdim=True) + x["eps"]) * x["G"]).to(x["X"].dtype)


def torch_cross_entropy(x):
    return torch.nn.functional.cross_entropy(x["H"] @ x["W"].T, x["labels"], reduction="none")


def _inputs_of(program):
    """A program called on the inputs it reads from a case's dict."""
    return lambda x: program(**{i.name: x[i.name] for i in program.checked.inputs})


def _step(forward, wrt, upstream):
    """Forward and backward, as a training step runs a layer: each call runs the
    forward and torch.autograd.grad of its output with respect to `wrt` against
    the fixed upstream gradient, and returns the first gradient (dX, dH)."""
    def run(x):
        return torch.autograd.grad(forward(x), [x[n] for n in wrt], x[upstream])[0]
    return run


def training_cases(compile_, quick: bool) -> list[Case]:
    """bf16. Attention backward with softcap (cap 30) and ALiBi (bf16 slopes, their
    gradient included), causal and not, B*S = 16k tokens, H*d = 2048, d = 128,
    against FlexAttention, timed as `backward` times it; work = 2.5x the forward's
    FLOPs. Then forward + backward of layernorm, RMSNorm (GB/s of X, dY, Y, dX and
    the weights and their gradients) and fused cross-entropy (TFLOP/s of its three
    matmuls) against the same torch code, torch.compile'd and eager."""
    cases = []
    d = 128
    for s in ((4096,) if quick else (1024, 4096)):
        b, h = 16384 // s, 2048 // d
        for variant in ("softcap", "alibi"):
            wrt = ("Q", "K", "V", "A") if variant == "alibi" else ("Q", "K", "V")
            for causal in (False, True):
                def make(b=b, h=h, s=s, variant=variant):
                    g = torch.Generator(device="cuda").manual_seed(0)
                    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
                                   for _ in range(4))
                    x = {"Q": q.requires_grad_(), "K": k.requires_grad_(), "V": v.requires_grad_(),
                         "scale": 1 / math.sqrt(d), "dO": do}
                    if variant == "softcap":
                        x["cap"] = 30.0
                    else:                          # ALiBi's slopes 2^(-8 (h+1) / H)
                        slopes = 2.0 ** (-8 * torch.arange(1, h + 1, device="cuda") / h)
                        x["A"] = slopes.bfloat16().requires_grad_()
                    return x
                program = compile_(training_attention(variant, causal))
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                flex = _flex(s, SCORE_MODS[variant], causal_mask if causal else None)
                cases.append(Case("training", f"{variant} B{b} H{h} S{s} d{d}{' causal' if causal else ''}",
                                  flops, "TFLOP/s", make, _grad_of(_inputs_of(program), wrt),
                                  {"flex_attention": _grad_of(flex, wrt)}))

    n, features = (8192, 4096) if quick else (16384, 4096)
    norms = {"layernorm": (LAYERNORM_AFFINE, torch_layernorm, ("X", "G", "B")),
             "rmsnorm": (RMSNORM, torch_rmsnorm, ("X", "G"))}
    for name, (source, fn, wrt) in norms.items():
        def make(wrt=wrt):
            g = torch.Generator(device="cuda").manual_seed(0)
            x = {key: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
                 for key, shape in (("X", (n, features)), ("dY", (n, features)), ("G", (features,)),
                                     ("B", (features,)))}
            for w in wrt:
                x[w].requires_grad_()
            return {**x, "eps": 1e-6}
        # read X, dY, write Y, dX; read each weight, write its gradient
        nbytes = 2 * (4 * n * features + 2 * (len(wrt) - 1) * features)
        cases.append(Case("training", f"{name} {n}x{features}", nbytes, "GB/s", make,
                          _step(_inputs_of(compile_(source)), wrt, "dY"),
                          {"torch.compile": _step(torch.compile(fn), wrt, "dY"),
                           "torch eager": _step(fn, wrt, "dY")}))

    tokens, hidden, vocab = (2048, 1024, 16000) if quick else (4096, 2048, 32000)

    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        h, w, dl = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
                    for shape in ((tokens, hidden), (vocab, hidden), (tokens,)))
        labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
        return {"H": h.requires_grad_(), "W": (0.02 * w).requires_grad_(), "labels": labels,
                "Y": torch.nn.functional.one_hot(labels, vocab).bfloat16(), "dL": dl}
    flops = 3 * 2 * tokens * vocab * hidden        # the logits' matmul, and dH's and dW's
    cases.append(Case("training", f"cross-entropy T{tokens} D{hidden} V{vocab}", flops, "TFLOP/s", make,
                      _step(_inputs_of(compile_(CROSS_ENTROPY)), ("H", "W"), "dL"),
                      {"torch.compile": _step(torch.compile(torch_cross_entropy), ("H", "W"), "dL"),
                       "torch eager": _step(torch_cross_entropy, ("H", "W"), "dL")}))
    return cases


# ---------------------------------------------------------------- flex
# Forward attention variants a user would otherwise write with FlexAttention: each an
# einfold program and the score_mod and mask_mod that make flex_attention compute the
# same function (tests/test_bench_flex.py checks both against float64 torch on CPU).
SCALED = "Q[b,h,i,k] * K[b,h,m,k] * scale"
DOCUMENT = "D[b,i] == D[b,m] and m <= i"
# grouped-query attention: query head g*R + r reads KV head g, as enable_gqa pairs them
GROUPED_QUERY = "O[b,g,r,i,j] = softmax[m](Q[b,g,r,i,k] * K[b,g,m,k] * scale) * V[b,g,m,j]"


def flex_variants(s: int, docs: torch.Tensor) -> dict[str, tuple[str, Callable | None, Callable | None]]:
    """name -> (einfold source, FlexAttention score_mod of the inputs or None, mask_mod or
    None) at sequence length s; docs[b, i] is the document of token i (the document mask's)."""
    window = min(1024, s // 4)          # 256 at s = 1024, so that the window skips there too
    return {"softcap": (training_attention("softcap", False), softcap_mod, None),
            "softcap causal": (training_attention("softcap", True), softcap_mod, causal_mask),
            "alibi": (training_attention("alibi", False), alibi_mod, None),
            "alibi causal": (training_attention("alibi", True), alibi_mod, causal_mask),
            f"window {window}": (attention_of(SCALED, f"m <= i and i - m < {window}"), None,
                                 window_mask(window)),
            "document causal": (attention_of(SCALED, DOCUMENT), None, document_mask(docs))}


def document_ids(batch: int, s: int) -> torch.Tensor:
    """Sequences packed with documents of random lengths, 8 per sequence on average
    (seeded): the document of each token, [batch, s] int64, nondecreasing along s."""
    g = torch.Generator().manual_seed(0)
    return (torch.rand(batch, s, generator=g) < 8 / s).long().cumsum(1)


def _grouped_query(program, kv_heads: int):
    """Ours for grouped-query attention: Q [b, H, s, d] read as [b, G, R, s, d] (query
    head g*R + r as (g, r)), the output returned as [b, H, s, d]."""
    def run(x):
        b, h, s, d = x["Q"].shape
        q = x["Q"].view(b, kv_heads, h // kv_heads, s, d)
        return program(Q=q, K=x["K"], V=x["V"], scale=x["scale"]).reshape(b, h, s, d)
    return run


def flex_cases(compile_, quick: bool) -> list[Case]:
    """Forward, bf16 Q, K, V, B*S = 16k tokens, d = 128, H = 16 (grouped-query attention:
    32 query heads over 8 KV heads): flex_variants and grouped-query attention against
    flex_attention compiled per case with the same score_mod and block mask (grouped-query
    attention also against SDPA); work = the forward's FLOPs over the pairs the mask keeps.
    Each case also times einfold's first call against FlexAttention's."""
    cases = []
    d, heads, kv_heads = 128, 32, 8
    for s in ((4096,) if quick else (1024, 4096)):
        b, h = 16384 // s, 2048 // d
        docs = document_ids(b, s).cuda()

        def make(b=b, h=h, s=s, docs=docs):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(3))
            # every variant's inputs (each program and score_mod reads its own): ALiBi's slopes
            # 2^(-8 (h+1) / H) in float32; the document ids in bf16, exact below 256 (einfold
            # takes no integer tensors, and float32 ids would make the output float32)
            return {"Q": q, "K": k, "V": v, "scale": 1 / math.sqrt(d), "cap": 30.0,
                    "A": 2.0 ** (-8 * torch.arange(1, h + 1, device="cuda") / h), "D": docs.bfloat16()}
        for variant, (source, score_mod, mask_mod) in flex_variants(s, docs).items():
            flops = 4 * b * h * s * s * d * kept_fraction(mask_mod, b, s, "cuda")
            flex = _flex(s, score_mod, mask_mod, batch=b)        # a block mask per b: the documents differ
            cases.append(Case("flex", f"{variant} B{b} H{h} S{s} d{d}", flops, "TFLOP/s", make,
                              _inputs_of(compile_(source)), {"flex_attention": flex},
                              fresh=lambda x, source=source: _inputs_of(compile_(_cold(source)))(x)))

        def make_grouped(b=b, s=s):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(b, kv_heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
            return {"Q": q, "K": k, "V": v, "scale": 1 / math.sqrt(d)}
        baselines = {"flex_attention": _flex(s, enable_gqa=True),
                     **{f"sdpa_{n.lower()}": _sdpa(n, False, enable_gqa=True)
                        for n in ("FLASH_ATTENTION", "CUDNN_ATTENTION")}}
        cases.append(Case("flex", f"gqa B{b} H{heads}/{kv_heads} S{s} d{d}", 4 * b * heads * s * s * d, "TFLOP/s",
                          make_grouped, _grouped_query(compile_(GROUPED_QUERY), kv_heads), baselines,
                          fresh=lambda x: _grouped_query(compile_(_cold(GROUPED_QUERY)), kv_heads)(x)))
    return cases


def _torch_layernorm(x):
    X = x["X"].float()
    mu = X.mean(-1, keepdim=True)
    var = ((X - mu) ** 2).mean(-1, keepdim=True)
    return ((X - mu) * torch.rsqrt(var + x["eps"])).to(x["X"].dtype)


def memory_cases(compile_, quick: bool) -> list[Case]:
    torch_fns = {
        "softmax": (SOFTMAX, lambda x: torch.softmax(x["X"].float(), -1).to(x["X"].dtype), 2),
        "layernorm": (LAYERNORM, _torch_layernorm, 2),
        "logsumexp": (LOGSUMEXP, lambda x: torch.logsumexp(x["X"].float(), -1).to(x["X"].dtype), 1),
        "add+gelu": (ADD_GELU, lambda x: torch.nn.functional.gelu(x["X"] + x["Y"]), 3),
    }
    cases = []
    n = 4096 if quick else 8192
    for dtype in (torch.float32, torch.bfloat16):
        for name, (src, fn, tensors) in torch_fns.items():
            def make(dtype=dtype, name=name):
                g = torch.Generator(device="cuda").manual_seed(0)
                x = {"X": torch.randn(n, n, device="cuda", dtype=dtype, generator=g)}
                if name == "add+gelu":
                    x["Y"] = torch.randn(n, n, device="cuda", dtype=dtype, generator=g)
                if name == "layernorm":
                    x["eps"] = 1e-5
                return x
            nbytes = n * n * dtype.itemsize * tensors + (n * dtype.itemsize if name == "logsumexp" else 0)
            program = compile_(src)
            cases.append(Case("memory", f"{name} {n}x{n} {str(dtype).split('.')[-1]}", nbytes, "GB/s",
                              make, lambda x, p=program: p(**x),
                              {"torch.compile": torch.compile(fn), "torch eager": fn}))
    return cases


def matmul_cases(compile_, quick: bool) -> list[Case]:
    program = compile_(MATMUL)
    cases = []
    for n in ((4096,) if quick else (4096, 8192)):
        def make(n=n):
            g = torch.Generator(device="cuda").manual_seed(0)
            return {"A": torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g),
                    "B": torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)}
        cases.append(Case("matmul", f"{n}^3 bf16", 2 * n ** 3, "TFLOP/s", make,
                          lambda x, p=program: p(**x), {"torch.matmul": lambda x: x["A"] @ x["B"]}))
    return cases


# the groups of this module; compiler/bench_general.py (which imports this one) adds "general"
GROUPS = {"attention": attention_cases, "decode": decode_cases, "memory": memory_cases,
          "matmul": matmul_cases, "backward": backward_cases, "training": training_cases,
          "flex": flex_cases}


ADD_GELU_1D = "Y[i] = gelu(X[i] + B[i])"


def _host_us(fn, x, calls: int = 200, rounds: int = 5) -> float:
    """Microseconds of host time per warm call of fn(x) (see _host_us_side_by_side)."""
    return _host_us_side_by_side({"fn": fn}, x, calls, rounds)["fn"]


def _host_us_side_by_side(fns: dict[str, Callable], x, calls: int = 200, rounds: int = 7) -> dict[str, float]:
    """Microseconds of host time per warm call of each fn(x): the median over `rounds`
    of `calls` calls timed to the last call's return, then synchronized (few enough
    calls that the launch queue never fills, which would make the host wait for the
    GPU).  The rounds of the functions alternate, so that a busy spell of the host
    (a compile worker of an earlier case, say) slows all of them alike."""
    for fn in fns.values():
        fn(x)
    torch.cuda.synchronize()
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            per_call[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(times) for name, times in per_call.items()}


def host_cost(compile_, quick: bool = False) -> list[Row]:
    """Host time per cached call on tiny inputs, where launching is most of the cost:
    einfold against the torch call a user would make instead (attention and a single
    query row split over 8192 keys against SDPA, add+gelu against eager torch)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def sdpa(x):
        return torch.nn.functional.scaled_dot_product_attention(x["Q"], x["K"], x["V"], scale=x["scale"])
    attention = compile_(ATTENTION)
    cases = [("attention B1 H1 S16 d64", attention,
              {"Q": randn(1, 1, 16, 64), "K": randn(1, 1, 16, 64), "V": randn(1, 1, 16, 64), "scale": 0.125},
              "sdpa", sdpa),
             ("add+gelu 1024", compile_(ADD_GELU_1D), {"X": randn(1024), "B": randn(1024)},
              "torch eager", lambda x: torch.nn.functional.gelu(x["X"] + x["B"])),
             ("split decode H8 L8192 d128", attention,
              {"Q": randn(1, 8, 1, 128), "K": randn(1, 8, 8192, 128), "V": randn(1, 8, 8192, 128),
               "scale": 1 / math.sqrt(128)}, "sdpa", sdpa)]
    rows = []
    for name, program, x, baseline, fn in cases:
        captured = program.capture(**x)
        # a replay reading the capture's own inputs (written in place), and one given the inputs
        us = _host_us_side_by_side({"ours": lambda x, p=program: p(**x), "theirs": fn,
                                    "replay": lambda x: captured(), "copied": lambda x: captured(**x)}, x)
        ours_us, theirs_us, replay_us, copied_us = us["ours"], us["theirs"], us["replay"], us["copied"]
        extra = {"direct_triton_launch_us": program.backend.launch_overhead_probe(x),
                 "kernels": len(program.plan(**x).kernels)}       # 2 where the decode is split
        rows += [Row("host", name, "einfold", ours_us, float("nan"), "us", 1.0, _error(program(**x), fn(x)),
                     extra=extra),
                 Row("host", name, "einfold captured", replay_us, float("nan"), "us", None,
                     _error(captured(**x), fn(x)),
                     note=f"us per replay: {theirs_us / replay_us:.2f}x {baseline}'s speed; "
                          f"{copied_us:.1f} us with the inputs copied in",
                     extra={"with_inputs_copied_us": copied_us}),
                 Row("host", name, baseline, theirs_us, float("nan"), "us", theirs_us / ours_us, 0.0)]
    return rows


# groups that make their own rows instead of cases for run_case: name -> (compile_, quick) -> rows
# (compiler/bench_gpt.py adds its rows to "training")
ROW_GROUPS = {"host": host_cost}


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, counting bytes read and written."""
    import triton.testing
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _first_call(fn, x) -> tuple[torch.Tensor, float]:
    """fn(x), and the milliseconds to the end of its kernels."""
    start = time.perf_counter()
    out = fn(x)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def _cold(source: str) -> str:
    """`source` as a program text this process has not compiled (a comment of the time):
    einfold generates, loads and autotunes its kernels anew."""
    return f"{source}  # cold {time.perf_counter_ns()}"


def _peak_mib(fn, x) -> float:
    """MiB that one warm call of fn(x) allocates on the GPU at its peak, its output included,
    above what was allocated before (the inputs, earlier results)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(x)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def run_case(case: Case) -> list[Row]:
    import triton.testing
    x = case.make()
    first = next(iter(case.baselines))
    want, against, oracle_note = None, first, ""
    if case.reference is not None:
        try:
            want, against = case.reference(x), "float64 oracle"
        except Exception as e:          # out of memory, say: errors against the first baseline instead
            oracle_note = f"oracle failed ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
    rows, timings, outputs, first_calls, fresh_ms = [], {}, {}, {}, None
    for name, fn in [("einfold", case.ours), *case.baselines.items()]:
        try:
            if name == "einfold" and case.fresh is not None:    # first: nothing of the case has run yet
                fresh_ms = _first_call(case.fresh, x)[1]
            outputs[name], first_calls[name] = _first_call(fn, x)
            peak = _peak_mib(fn, x)
            ms = triton.testing.do_bench(lambda fn=fn: fn(x), warmup=25, rep=100, return_mode="median")
            timings[name] = ms
            rows.append(Row(case.group, case.name, name, ms, _rate(case.work, case.unit, ms), case.unit,
                            peak_mib=peak))
        except Exception as e:
            # a baseline backend this device or shape does not support, or a program of
            # ours that fails: a row that says so, and the run goes on to the other cases
            rows.append(Row(case.group, case.name, name, float("nan"), float("nan"), case.unit,
                            note=f"{'FAILED' if name == 'einfold' else 'unavailable'}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
    ours = timings.get("einfold")
    for row in rows:
        if want is not None and row.contender in outputs:
            row.error = _error(outputs[row.contender], want)
        elif first in outputs and row.contender in outputs:      # errors against the first baseline
            row.error = _error(outputs[row.contender], outputs[first]) if row.contender != first else 0.0
        if ours and row.contender in timings:
            row.ratio_ours_over_this = timings[row.contender] / ours   # >1: einfold is faster
    mismatch = ""
    if rows[0].error is not None and rows[0].error > case.tolerance:
        mismatch = f"MISMATCH vs {against}: rel err {rows[0].error:.2e}"
    rows[0].note = "; ".join(note for note in (rows[0].note, mismatch, oracle_note, case.note) if note)
    if fresh_ms is not None:
        note = ("einfold: compile + first call of a new program text; the baseline: its first call "
                "(tracing, compiling); Triton's and Inductor's on-disk caches may be warm")
        rows.append(Row("compile", f"{case.group} {case.name} first call", "einfold", fresh_ms, float("nan"),
                        "ms", 1.0, note=note))
        if first in first_calls:
            rows.append(Row("compile", f"{case.group} {case.name} first call", first, first_calls[first],
                            float("nan"), "ms", first_calls[first] / fresh_ms, note=note))
    return rows


def compile_cost() -> list[Row]:
    """Cold compile + autotuning of attention for one shape, and the host time a
    cached call adds over launching nothing but the kernel (measured per call)."""
    import compiler
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 16, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    start = time.perf_counter()
    program = compiler.compile(_cold(ATTENTION), backend="triton")
    program(Q=q, K=k, V=v, scale=0.088)
    torch.cuda.synchronize()
    cold = time.perf_counter() - start
    rows = [Row("compile", "attention cold compile + autotune", "einfold", cold * 1e3, float("nan"), "ms")]
    tiny = {"Q": q[:1, :1, :16], "K": k[:1, :1, :16], "V": v[:1, :1, :16], "scale": 0.088}
    per_call_us = _host_us(lambda x: program(**x), tiny)
    launch = getattr(program.backend, "launch_overhead_probe", None)
    direct = launch(tiny) if launch is not None else float("nan")
    rows.append(Row("compile", "cached call host time", "einfold", per_call_us, float("nan"), "us",
                    extra={"direct_triton_launch_us": direct}))
    return rows


def main(out: Path, groups: list[str], quick: bool = False, only: list[str] | None = None,
         cases_of: dict[str, Callable] | None = None, rows_of: dict[str, Callable] | None = None) -> list[Row]:
    """Run `groups` side by side and write the table; `cases_of`: each group's case maker,
    `rows_of`: each group's row maker (defaults: this module's GROUPS and ROW_GROUPS); a
    group may have both."""
    cases_of = GROUPS if cases_of is None else cases_of
    rows_of = ROW_GROUPS if rows_of is None else rows_of
    import compiler
    import triton
    out.mkdir(parents=True, exist_ok=True)
    compile_ = lambda src, **options: compiler.compile(src, backend="triton", **options)  # noqa: E731
    rows: list[Row] = []
    bandwidth = copy_bandwidth()
    for group in groups:
        for case in cases_of.get(group, lambda *_: [])(compile_, quick):
            if only and not any(text in case.name for text in only):
                continue
            rows += run_case(case)
            print(f"  done {case.group}: {case.name}", flush=True)
        if group in rows_of:
            rows += [r for r in rows_of[group](compile_, quick) if not only or any(text in r.name for text in only)]
            print(f"  done {group}", flush=True)
    rows += compile_cost()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "copy_bandwidth_GBps": bandwidth}
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    _plot(rows, out / "bench.png")
    print(format_table(rows, meta))
    return rows


def format_table(rows: list[Row], meta: dict) -> str:
    lines = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
             f"copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s",
             f"{'case':60} {'contender':28} {'ms':>9} {'rate':>10} {'ours/this':>9} {'rel err':>8} "
             f"{'peak MiB':>9}  note"]
    for r in rows:
        ratio = f"{r.ratio_ours_over_this:.2f}x" if r.ratio_ours_over_this else ""
        rate = f"{r.rate:.1f}" if r.rate == r.rate else ""
        error = f"{r.error:.1e}" if r.error is not None else ""
        peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else ""
        lines.append(f"{r.group + ' ' + r.name:60} {r.contender:28} {r.ms:9.3f} {rate:>10} {ratio:>9} {error:>8} "
                     f"{peak:>9}  {r.unit if rate else ''} {r.note}")
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(dict.fromkeys((r.group, r.name) for r in rows if r.ratio_ours_over_this))
    fig, ax = plt.subplots(figsize=(12, max(4, 0.3 * len(cases))))
    labels, values = [], []
    for group, name in cases:
        for r in rows:
            if (r.group, r.name) == (group, name) and r.contender != "einfold" and r.ratio_ours_over_this:
                labels.append(f"{group} {name} vs {r.contender}")
                values.append(r.ratio_ours_over_this)
    ax.barh(range(len(values)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
    ax.set_yticks(range(len(values)), labels, fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("speed of einfold relative to the baseline (log scale; >1: einfold faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
