"""torch.nn modules whose forward is an einfold program.

    from compiler import nn                  # (`import compiler` alone stays free of torch)
    norm = nn.RMSNorm(4096)                  # torch.nn.RMSNorm's signature and state dict
    attend = nn.Attention(is_causal=True)    # F.scaled_dot_product_attention's semantics
    loss = nn.FusedLinearCrossEntropy()      # F.cross_entropy(hidden @ weight.T, target), no logits
    layer = nn.Module("Y[i,o] = X[i,c] * W[o,c] + B[o]",
                      parameters={"W": torch.randn(64, 32), "B": torch.zeros(64)})

Each module is one line of index notation, compiled once per rank of its inputs (the
leading indices of a tensor of any rank are named in the program, so strided views
are read in place, never copied); its gradients are einfold's (`Program.__call__`
under autograd).  The norms and the attention take the parameters, defaults and
state-dict keys of torch's modules, so a model swaps them in with `load_state_dict`
unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from .bind import DTYPE_TYPES
from .errors import BindError, CheckError
from .ops import INT
from .program import Program, compile as compile_program


class Module(torch.nn.Module):
    """A module from any program.

    Args:
        source: the program (one or more statements).
        parameters: inputs of the program the module owns, by name: each becomes an
            `nn.Parameter` (trained) under that name.
        buffers: inputs the module owns but does not train (`register_buffer`).
        outputs: as `compiler.compile`.
        backend: as `compiler.compile`.
        **options: as `compiler.compile`.

    `forward(**inputs)` takes the other inputs by keyword and returns what the
    program returns.

    Raises:
        CheckError: a parameter or buffer names no input of the program.
    """

    def __init__(self, source: str, parameters: Mapping[str, torch.Tensor] | None = None,
                 buffers: Mapping[str, torch.Tensor] | None = None, *, outputs: Iterable[str] | None = None,
                 backend: str = "auto", **options) -> None:
        super().__init__()
        self.program: Program = compile_program(source, outputs=outputs, backend=backend, **options)
        owned = {**(parameters or {}), **(buffers or {})}
        names = {i.name for i in self.program.checked.inputs}
        unknown = sorted(set(owned) - names)
        if unknown:
            raise CheckError(f"the module's {', '.join(map(repr, unknown))} name(s) no input of the program "
                             f"(its inputs: {', '.join(sorted(names))})")
        for name, value in (parameters or {}).items():
            self.register_parameter(name, torch.nn.Parameter(torch.as_tensor(value)))
        for name, value in (buffers or {}).items():
            self.register_buffer(name, torch.as_tensor(value))
        self._owned = tuple(owned)

    def forward(self, **inputs):
        return self.program(**{name: getattr(self, name) for name in self._owned}, **inputs)


def _indices(stem: str, count: int) -> list[str]:
    return [f"{stem}{d}" for d in range(count)]


# The programs modules run, by the text of their source and options: each compiled once
# per process and shared by every module that runs it
_SHARED: dict[str, Program] = {}


@torch._dynamo.assume_constant_result
def _shared_key(source: str, backend: str, float32_outputs: tuple[str, ...]) -> str:
    """The key of the shared program of `source` (compiled on first use).  torch.compile
    runs this when it traces a module and keeps the key, a string, as a constant:
    compiling is not traceable (a graph break at a module's first call), and a program
    per module instance made one recompilation each (past dynamo's limit of 8 in a
    6-layer GPT's 13 norms); reading a dict by a constant key is traceable."""
    key = repr((source, backend, float32_outputs))
    if key not in _SHARED:
        _SHARED[key] = compile_program(source, backend=backend, float32_outputs=float32_outputs)
    return key


def shared_program(source: str, backend: str = "auto", float32_outputs: tuple[str, ...] = ()) -> Program:
    """The program of `source` that every module running it shares (see _shared_key)."""
    return _SHARED[_shared_key(source, backend, float32_outputs)]


class _ByRank(torch.nn.Module):
    """A module whose program depends on its input's rank (its `source(rank)`)."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend

    def _program(self, rank: int) -> Program:
        return shared_program(self.source(rank), self.backend)


class _Norm(_ByRank):
    """The shared shape of RMSNorm and LayerNorm: statistics over the trailing
    `normalized_shape`, an optional elementwise weight (and bias); the result in the
    input's dtype, as torch's."""

    def __init__(self, normalized_shape, eps, elementwise_affine: bool, bias: bool, device, dtype,
                 backend: str) -> None:
        super().__init__(backend)
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = torch.nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def _subscripts(self, rank: int) -> tuple[str, str, str, str]:
        """(the rows: the leading indices; the input's subscript; the normalised indices
        as a reduction binds them; the input's subscript under that reduction)."""
        norm = len(self.normalized_shape)
        if rank < norm:
            raise BindError(f"{type(self).__name__} normalises the last {norm} dimension(s) "
                            f"{list(self.normalized_shape)}; the input has {rank}")
        lead, own, reduced = _indices("b", rank - norm), _indices("k", norm), _indices("n", norm)
        return ", ".join(lead), ", ".join(lead + own), ", ".join(reduced), ", ".join(lead + reduced)

    def _affine(self, normalised: str) -> str:
        own = ", ".join(_indices("k", len(self.normalized_shape)))
        if self.weight is not None:
            normalised += f" * G[{own}]"
        if self.bias is not None:
            normalised += f" + B[{own}]"
        return normalised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[x.dim() - len(self.normalized_shape):]) != self.normalized_shape:
            raise BindError(f"{type(self).__name__}({list(self.normalized_shape)}) got an input of shape "
                             f"{list(x.shape)}")
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        owned = {"G": self.weight, "B": self.bias}
        y = self._program(x.dim())(X=x, eps=eps, **{n: p for n, p in owned.items() if p is not None})
        # torch's norms return the input's dtype (float32 weights beside bfloat16 activations
        # give bfloat16): computed in float32, rounded once
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_Norm):
    """`torch.nn.RMSNorm`: x / sqrt(mean(x^2) + eps) * weight over the trailing
    `normalized_shape` (eps None: the input dtype's machine epsilon, as torch)."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, backend: str = "auto") -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype, backend)

    def source(self, rank: int) -> str:
        """The program for an input of this rank."""
        _, x, n, xn = self._subscripts(rank)
        return self._affine(f"Y[{x}] = X[{x}] * rsqrt(mean[{n}](X[{xn}] ** 2) + eps)")


class LayerNorm(_Norm):
    """`torch.nn.LayerNorm`: (x - mean) / sqrt(var + eps) * weight + bias over the
    trailing `normalized_shape`, var the biased variance."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, backend: str = "auto") -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype, backend)

    def source(self, rank: int) -> str:
        """The program for an input of this rank."""
        row, x, n, xn = self._subscripts(rank)
        return (f"mu[{row}] = mean[{n}](X[{xn}])\n"
                f"var[{row}] = mean[{n}]((X[{xn}] - mu[{row}]) ** 2)\n"
                + self._affine(f"Y[{x}] = (X[{x}] - mu[{row}]) * rsqrt(var[{row}] + eps)"))


class Attention(_ByRank):
    """`torch.nn.functional.scaled_dot_product_attention` as a module: softmax(q k^T *
    scale) v over the last two dimensions of q [..., L, E], k [..., S, E], v [..., S, Ev],
    the leading ones shared; `is_causal`: query i sees keys m <= i (torch's top-left
    alignment); `scale` None: 1 / sqrt(E)."""

    def __init__(self, is_causal: bool = False, scale: float | None = None, *, backend: str = "auto") -> None:
        super().__init__(backend)
        self.is_causal = is_causal
        self.scale = scale

    def source(self, rank: int) -> str:
        """The program for queries of this rank."""
        if rank < 2:
            raise BindError(f"Attention takes [..., L, E] queries; got rank {rank}")
        lead = ", ".join(_indices("b", rank - 2) + [""])
        scores = f"Q[{lead}i, k] * K[{lead}m, k] * scale"
        if self.is_causal:
            scores = f"where(m <= i, {scores}, -inf)"
        return f"O[{lead}i, j] = softmax[m]({scores}) * V[{lead}m, j]"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        scale = 1 / math.sqrt(query.shape[-1]) if self.scale is None else self.scale
        return self._program(query.dim())(Q=query, K=key, V=value, scale=scale)

    def extra_repr(self) -> str:
        return f"is_causal={self.is_causal}, scale={self.scale}"


class FusedLinearCrossEntropy(torch.nn.Module):
    """Cross-entropy of the logits `hidden @ weight.T + bias` against class labels,
    as `F.cross_entropy`, without the [tokens, vocab] logits in memory: the logsumexp
    over the vocabulary streams the contraction (as FlashAttention streams the scores),
    and the derived backward stores the logits' gradient one chunk of the vocabulary (or of
    the rows) at a time, no larger than the weight, and reads it in two matrix products
    (compiler/schedule/chunks.py; at a narrow hidden dimension it recomputes the logits tile
    by tile instead).

    Args:
        ignore_index: a label whose rows count for nothing, in the loss and in the
            mean's count (a mean over no rows is NaN, as torch's).
        label_smoothing: eps in torch's (1 - eps) * nll + eps * mean over classes of
            -log p.
        z_loss: adds z_loss * logsumexp(logits)^2 a row (PaLM's z-loss, Liger-Kernel's
            `lse_square_scale`).
        softcap: logits = softcap * tanh(logits / softcap) before the softmax (Gemma 2);
            None: none.
        reduction: "mean" (over the rows not ignored), "sum" or "none" (one loss a row,
            0 at ignored rows).
        backend: as `compiler.compile`.

    The loss is float32 (as `F.cross_entropy` under autocast, Liger-Kernel's and Cut
    Cross-Entropy's); the gradients take their inputs' dtypes.

    `forward(hidden, weight, target, bias=None)` takes hidden states [..., d], the
    classifier weight [v, d] (`lm_head.weight`), integer labels of the leading shape
    (any integer dtype, compared exactly) and an optional bias [v]: `F.linear`'s order
    followed by `F.cross_entropy`'s, where Liger-Kernel's
    `LigerFusedLinearCrossEntropyLoss` takes the weight first.  A label outside [0, v)
    other than `ignore_index` picks no logit, its row's loss is the logsumexp alone
    (unchecked: checking would synchronise with the device).

    Raises:
        CheckError: an unknown reduction.
        BindError: float labels, or shapes that do not fit.
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: float | None = None, reduction: str = "mean", *, backend: str = "auto") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise CheckError(f"FusedLinearCrossEntropy's reduction is 'mean', 'sum' or 'none', "
                             f"not {reduction!r}")
        self.ignore_index = int(ignore_index)
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.reduction = reduction
        self.backend = backend

    def source(self, rank: int, bias: bool = False) -> str:
        """The program for hidden states of this rank (with a bias or without).  The
        ignored label is a literal, so it is compared as an integer."""
        if rank < 2:
            raise BindError(f"FusedLinearCrossEntropy takes [..., d] hidden states; got rank {rank}")
        rows = ", ".join(_indices("t", rank - 1))
        logits = f"sum[d](H[{rows}, d] * W[v, d])" + (" + B[v]" if bias else "")
        if self.softcap is not None:
            logits = f"softcap * tanh(({logits}) / softcap)"
        ignored = f"Y[{rows}] == {self.ignore_index}"
        label_logit = f"sum[v](where(v == Y[{rows}], Z[{rows}, v], 0))"
        row_loss = f"lse[{rows}] - {label_logit}"
        if self.label_smoothing:
            row_loss = f"lse[{rows}] - (1 - smoothing) * {label_logit} - smoothing * mean[v](Z[{rows}, v])"
        if self.z_loss:
            row_loss += f" + z_loss * lse[{rows}] ** 2"
        lines = [f"Z[{rows}, v] = {logits}",
                 f"lse[{rows}] = logsumexp[v](Z[{rows}, v])",
                 f"L[{rows}] = where({ignored}, 0, {row_loss})"]
        if self.reduction == "sum":
            lines.append(f"loss = sum[{rows}](L[{rows}])")
        elif self.reduction == "mean":
            lines += [f"total = sum[{rows}](L[{rows}])",
                      f"loss = total / sum[{rows}](where({ignored}, 0, 1))"]
        return "\n".join(lines)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if DTYPE_TYPES.get(target.dtype) != INT:
            raise BindError(f"FusedLinearCrossEntropy takes integer class labels; "
                            f"the target is {target.dtype}")
        # the loss in float32 whatever the logits' dtype, as F.cross_entropy under autocast
        # gives it (a bfloat16 mean of ~10 would be off by up to 0.03)
        if hidden.dim() < 2:
            raise BindError(f"FusedLinearCrossEntropy takes [..., d] hidden states; got rank {hidden.dim()}")
        if target.dim() != hidden.dim() - 1:
            raise BindError(f"FusedLinearCrossEntropy: the labels have {target.dim()} dimensions, the hidden "
                            f"states {hidden.dim() - 1} leading ones")
        for k, (n, m) in enumerate(zip(target.shape, hidden.shape)):
            if n != m:
                raise BindError(f"FusedLinearCrossEntropy: the labels' extent {n} at dimension {k} is not "
                                f"the hidden states' {m}")
        program = shared_program(self.source(2, bias is not None), self.backend,
                                 ("L",) if self.reduction == "none" else ("loss",))
        # the rows as one index (a view of contiguous states): the weight's gradient is then a
        # matrix product over one index, where over (batch, sequence) it takes the batch one
        # value at a time beside the tl.dot
        inputs = {"H": hidden.reshape(-1, hidden.shape[-1]), "W": weight, "Y": target.reshape(-1), "B": bias,
                  "softcap": self.softcap, "smoothing": self.label_smoothing, "z_loss": self.z_loss}
        # a variant reads only the inputs of its options
        read = {i.name for i in program.checked.inputs}
        loss = program(**{name: value for name, value in inputs.items() if name in read})
        return loss.reshape(hidden.shape[:-1]) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"z_loss={self.z_loss}, softcap={self.softcap}, reduction={self.reduction!r}")
