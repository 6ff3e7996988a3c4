"""compiler.nn: torch modules whose forward is one line of index notation.  Each
matches torch's own module (float64 on the oracle; float32 on the Triton
interpreter) in value and gradient, takes its state dict, and reads strided views."""
import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler import nn

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def same_gradients(ours, theirs, inputs, tol):
    """Value and the gradients of every input and parameter agree with torch's."""
    ys = [m(*[x.clone().requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]) for m in (ours, theirs)]
    torch.testing.assert_close(ys[0], ys[1], **tol)
    dy = randn(*ys[0].shape, seed=9, dtype=ys[0].dtype)
    grads = []
    for m in (ours, theirs):
        xs = [x.clone().requires_grad_() for x in inputs]
        m(*xs).backward(dy)
        grads.append([x.grad for x in xs] + [p.grad for p in getattr(m, "parameters", tuple)()])
    assert len(grads[0]) == len(grads[1])
    for g, h in zip(*grads):
        torch.testing.assert_close(g, h, **tol)


F64 = {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("shape,normalized", [((3, 5, 7), 7), ((2, 3, 4, 5), (4, 5)), ((7,), 7)])
def test_rmsnorm_is_torchs(shape, normalized):
    ours = nn.RMSNorm(normalized, eps=1e-6, dtype=torch.float64, backend="reference")
    theirs = torch.nn.RMSNorm(normalized, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(randn(*theirs.weight.shape, seed=3))
    ours.load_state_dict(theirs.state_dict())            # the same keys: weight
    same_gradients(ours, theirs, [randn(*shape)], F64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_layernorm_is_torchs(affine, bias):
    ours = nn.LayerNorm((4, 6), elementwise_affine=affine, bias=bias, dtype=torch.float64, backend="reference")
    theirs = torch.nn.LayerNorm((4, 6), elementwise_affine=affine, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(randn(*p.shape, seed=4))
    ours.load_state_dict(theirs.state_dict())            # weight, bias (or nothing)
    same_gradients(ours, theirs, [randn(2, 3, 4, 6)], F64)


def test_rmsnorm_without_eps_takes_the_dtypes_epsilon_as_torch():
    ours, theirs = nn.RMSNorm(5, backend="reference"), torch.nn.RMSNorm(5)
    x = randn(4, 5, dtype=torch.float32) * 1e-4
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", ["RMSNorm", "LayerNorm"])
def test_a_norm_returns_the_inputs_dtype_beside_float32_weights_as_torch(module):
    x = randn(4, 8, dtype=torch.bfloat16)
    ours, theirs = getattr(nn, module)(8, eps=1e-5, backend="reference"), getattr(torch.nn, module)(8, eps=1e-5)
    assert ours(x).dtype == theirs(x).dtype == torch.bfloat16
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_is_scaled_dot_product_attention(is_causal):
    ours = nn.Attention(is_causal=is_causal, backend="reference")

    def theirs(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    # 5 queries, 7 keys: torch's causal mask is top-left aligned (m <= i)
    same_gradients(ours, theirs, [randn(2, 3, 5, 4, seed=1), randn(2, 3, 7, 4, seed=2), randn(2, 3, 7, 6, seed=3)],
                   F64)


def test_the_triton_backend_runs_the_modules_under_the_interpreter():
    x = randn(3, 37, dtype=torch.float32)
    norm = nn.RMSNorm(37, eps=1e-5)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(37, eps=1e-5)(x), rtol=1e-5, atol=1e-5)
    q, k, v = (randn(1, 2, 9, 8, seed=s, dtype=torch.float32) for s in range(3))
    torch.testing.assert_close(nn.Attention(is_causal=True)(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


def test_a_strided_view_is_read_in_place_and_each_rank_compiles_once():
    ours = nn.Attention(backend="reference")
    q = randn(2, 5, 3, 4).transpose(1, 2)            # [b, h, i, k] as transformers passes it: a view
    k, v = randn(2, 3, 7, 4, seed=1), randn(2, 3, 7, 4, seed=2)
    compiled = len(nn._SHARED)
    torch.testing.assert_close(ours(q, k, v), F.scaled_dot_product_attention(q, k, v), **F64)
    ours(q[0], k[0], v[0])
    ours(q, k, v)
    nn.Attention(backend="reference")(q, k, v)
    assert len(nn._SHARED) - compiled <= 2 and nn.Attention(backend="reference")._program(4) is ours._program(4)


def test_a_module_from_any_program_owns_its_parameters():
    layer = nn.Module("Y[i,o] = X[i,c] * W[o,c] + B[o]", parameters={"W": randn(4, 3), "B": randn(4, seed=1)},
                      backend="reference")
    assert sorted(dict(layer.named_parameters())) == ["B", "W"]
    x = randn(5, 3, seed=2).requires_grad_()
    y = layer(X=x)
    torch.testing.assert_close(y, x @ layer.W.T + layer.B, **F64)
    y.sum().backward()
    torch.testing.assert_close(layer.B.grad, torch.full((4,), 5.0, dtype=torch.float64))
    torch.testing.assert_close(layer.W.grad, x.detach().sum(0).expand(4, 3), **F64)


def test_wrong_names_and_shapes_are_einfold_errors():
    with pytest.raises(compiler.CheckError, match="'Z'"):
        nn.Module("Y[i] = X[i] * W[i]", parameters={"Z": randn(3)}, backend="reference")
    with pytest.raises(compiler.BindError, match=r"RMSNorm\(\[5\]\) got an input of shape \[3, 4\]"):
        nn.RMSNorm(5, backend="reference")(randn(3, 4))
    with pytest.raises(compiler.BindError, match="rank 1"):
        nn.Attention(backend="reference")(randn(3), randn(3), randn(3))


def torch_linear_cross_entropy(hidden, weight, target, bias, ignore_index=-100, label_smoothing=0.0,
                               z_loss=0.0, softcap=None, reduction="mean"):
    """F.cross_entropy of the materialised logits, with the z-loss (reduced as the loss
    is) and the softcap written out."""
    logits = hidden @ weight.T + (0 if bias is None else bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    rows, labels = logits.reshape(-1, weight.shape[0]), target.reshape(-1).long()
    loss = F.cross_entropy(rows, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
    kept = labels != ignore_index
    z = torch.where(kept, z_loss * torch.logsumexp(rows, dim=1) ** 2, 0)
    z = {"none": z.reshape(target.shape), "sum": z.sum(), "mean": z.sum() / kept.sum()}[reduction]
    return loss + z


def same_loss_and_gradients(module, hidden, weight, target, bias=None, tol=F64):
    """Value and the gradients of the hidden states, the weight and the bias agree with
    torch on float64 copies (the module's own inputs may be of a narrower dtype)."""
    options = {name: getattr(module, name)
               for name in ("ignore_index", "label_smoothing", "z_loss", "softcap", "reduction")}
    floats = [x for x in (hidden, weight, bias) if x is not None]
    ours = [x.clone().requires_grad_() for x in floats]
    theirs = [x.detach().double().requires_grad_() for x in floats]
    loss = module(ours[0], ours[1], target, *ours[2:])
    want = torch_linear_cross_entropy(theirs[0], theirs[1], target, *(theirs[2:] or [None]), **options)
    torch.testing.assert_close(loss.double(), want, equal_nan=True, **tol)
    upstream = randn(*want.shape, seed=9)
    loss.backward(upstream.to(loss.dtype))
    want.backward(upstream)
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x.grad.double(), y.grad, **tol)


def labels(*shape, classes, ignored=(), seed=0):
    y = torch.randint(classes, shape, generator=torch.Generator().manual_seed(seed))
    y.view(-1)[list(ignored)] = -100
    return y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 3.0}],
                         ids=["plain", "smoothing-zloss-softcap"])
def test_fused_linear_cross_entropy_is_torchs(options, reduction):
    module = nn.FusedLinearCrossEntropy(reduction=reduction, backend="reference", **options)
    same_loss_and_gradients(module, randn(13, 8), randn(19, 8, seed=1),
                            labels(13, classes=19, ignored=[2, 5]), randn(19, seed=2))


def test_fused_linear_cross_entropy_names_leading_indices_and_ignores_any_label():
    # [2, 7, 8] hidden states, a transposed view; class 3 is the ignored label, a class like any other
    module = nn.FusedLinearCrossEntropy(ignore_index=3, label_smoothing=0.2, backend="reference")
    same_loss_and_gradients(module, randn(7, 2, 8).transpose(0, 1), randn(23, 8, seed=1),
                            labels(2, 7, classes=5, seed=4))
    assert "L[t0, t1] = where(Y[t0, t1] == 3, 0," in module.source(3)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy_of_only_ignored_rows_is_torchs(reduction):
    # the mean of no rows is NaN, as torch's; the gradients are zero
    module = nn.FusedLinearCrossEntropy(reduction=reduction, z_loss=1e-2, backend="reference")
    same_loss_and_gradients(module, randn(7, 8), randn(19, 8, seed=1), torch.full((7,), -100),
                            randn(19, seed=2))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_on_the_triton_backend(reduction):
    module = nn.FusedLinearCrossEntropy(reduction=reduction, label_smoothing=0.1, z_loss=1e-2, softcap=3.0)
    same_loss_and_gradients(module, randn(11, 8), randn(37, 8, seed=1), labels(11, classes=37, ignored=[4]),
                            randn(37, seed=2), tol={"rtol": 1e-7, "atol": 1e-7})


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_fused_linear_cross_entropy_labels_past_256_are_exact_beside_bfloat16(backend):
    # bfloat16 holds 257 as 256 and 259 as 260: a label that went through the logits'
    # dtype would pick its neighbour's logit
    y = torch.tensor([257, 259, 261, 299, 263, 7, 258], dtype=torch.int32)
    module = nn.FusedLinearCrossEntropy(reduction="none", backend=backend)
    hidden, weight = randn(7, 8, dtype=torch.bfloat16), randn(300, 8, seed=1, dtype=torch.bfloat16)
    same_loss_and_gradients(module, hidden, weight, y, tol={"rtol": 2e-2, "atol": 2e-2})
    rounded = y.to(torch.bfloat16).long().clamp(max=299)
    assert (torch_linear_cross_entropy(hidden.double(), weight.double(), rounded, None, reduction="none")
            - module(hidden, weight, y).double()).abs().max() > 0.5


def test_fused_linear_cross_entropy_keeps_no_logits_in_memory():
    module = nn.FusedLinearCrossEntropy(label_smoothing=0.1, z_loss=1e-2, softcap=3.0)
    schedule = nn.shared_program(module.source(2, bias=True), module.backend).schedule
    # the row losses, one float a row, stored by the kernel whose grid is the rows (a
    # scalar's one program would fold them row after row); no [tokens, vocab] buffer
    assert [schedule.indices_of(b) for b in schedule.buffers] == [("t0",)]
    assert [k.grid for k in schedule.kernels] == [("t0",), ()]


def test_fused_linear_cross_entropy_compiles_each_variant_once():
    # an ignored label no other test uses: a variant of its own
    a, b = (nn.FusedLinearCrossEntropy(ignore_index=-7, backend="reference") for _ in range(2))
    hidden, weight, y = randn(7, 8), randn(19, 8, seed=1), labels(7, classes=19)
    compiled = len(nn._SHARED)
    a(hidden, weight, y)
    b(hidden, weight, y)
    a(hidden[:5], weight, y[:5])
    assert len(nn._SHARED) == compiled + 1
    a(hidden, weight, y, randn(19, seed=2))
    assert len(nn._SHARED) == compiled + 2


def test_fused_linear_cross_entropy_rejects_bad_inputs_with_einfold_errors():
    with pytest.raises(compiler.CheckError, match="'avg'"):
        nn.FusedLinearCrossEntropy(reduction="avg")
    module = nn.FusedLinearCrossEntropy(backend="reference")
    hidden, weight = randn(7, 8), randn(19, 8, seed=1)
    with pytest.raises(compiler.BindError, match="integer class labels"):
        module(hidden, weight, torch.zeros(7))
    with pytest.raises(compiler.BindError, match="extent"):
        module(hidden, weight, labels(6, classes=19))
    with pytest.raises(compiler.BindError, match="extent"):
        module(hidden, randn(19, 5), labels(7, classes=19))
    with pytest.raises(compiler.BindError, match="dimensions"):
        module(hidden, weight, labels(7, 1, classes=19))
    with pytest.raises(compiler.BindError, match="rank 1"):
        module(hidden[0], weight, labels(classes=19))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_gives_a_float32_loss_beside_bfloat16_logits(reduction):
    # as F.cross_entropy under autocast: a bfloat16 loss of ~3 would be off by up to 0.008
    module = nn.FusedLinearCrossEntropy(reduction=reduction)
    hidden, weight = randn(7, 8, dtype=torch.bfloat16), randn(19, 8, seed=1, dtype=torch.bfloat16)
    y = labels(7, classes=19)
    loss = module(hidden, weight, y)
    want = torch_linear_cross_entropy(hidden.double(), weight.double(), y, None, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)


def test_modules_share_their_programs_and_torch_compile_traces_a_first_call_in_one_graph():
    # compiling a program is not traceable: torch.compile makes it at trace time and keeps
    # its key (a module's first call under fullgraph=True would otherwise break the graph),
    # and two norms share one program (one per module made one recompilation each)
    first, second = nn.RMSNorm(13), nn.RMSNorm(13)
    x = randn(2, 3, 13)
    out = torch.compile(lambda x: second(first(x)), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, torch.nn.RMSNorm(13)(torch.nn.RMSNorm(13)(x)))
    assert first._program(3) is second._program(3)


@pytest.mark.parametrize("split", [None, 3])
def test_the_saving_forward_folds_the_logits_once_for_the_loss_and_the_saved_logsumexp(split):
    # the row losses (elements of the mean) and the saved row logsumexp fold the same logits:
    # one kernel whose grid is the rows computes both in one loop (it was two kernels, each
    # streaming the [tokens, vocab] contraction); whole and split over the vocabulary
    source = nn.FusedLinearCrossEntropy().source(2)
    saving = compiler.compile(source, split=split)._saving
    rows = [k for k in saving.schedule.kernels if k.grid]
    assert len(rows) == 1 and {"lse_lse"} <= {st.name for st in rows[0].statements}
    hidden, weight, y = randn(7, 5), randn(300, 5, seed=1), labels(7, classes=300, ignored=(2,))
    inputs = {"H": hidden, "W": weight, "Y": y}
    got = saving(**inputs)
    want = compiler.compile(saving.text, outputs=saving.outputs, backend="reference")(**inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-5)
