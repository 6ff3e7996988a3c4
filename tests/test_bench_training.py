"""The `training` bench group's programs and baselines, on CPU at tiny sizes:
the einfold sources' gradients (reference backend, float64) against torch
autograd of the same function written by hand, and the FlexAttention
score_mods' forward (eager, which runs on CPU) against the same function."""
import math

import pytest
import torch

import compiler
from compiler import bench, bench_gpt

# einfold's "no CUDA tensors", FlexAttention's "called without torch.compile"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _cache(private_cache):
    """Generated modules go to a temporary folder."""


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def gradients(fn, inputs, wrt, upstream):
    given = {n: v.clone().requires_grad_(n in wrt) if isinstance(v, torch.Tensor) else v
             for n, v in inputs.items()}
    out = fn(given)
    return out.detach(), torch.autograd.grad(out, [given[n] for n in wrt], upstream)


def assert_same(ours, theirs):
    (out, grads), (want, wanted) = ours, theirs
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    for got, expected in zip(grads, wanted):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def run(source):
    program = compiler.compile(source, backend="reference")
    return bench._inputs_of(program)


def attention(x, variant, causal):
    """The math of the bench's attention variants, by hand."""
    s = x["Q"] @ x["K"].transpose(-1, -2) * x["scale"]
    i, m = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None]
    if variant == "softcap":
        s = x["cap"] * torch.tanh(s / x["cap"])
    else:
        s = s - x["A"][:, None, None] * (i - m).abs()
    if causal:
        s = s.masked_fill(m > i, -math.inf)
    return torch.softmax(s, -1) @ x["V"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", ["softcap", "alibi"])
def test_attention_gradients_and_flex_score_mods(variant, causal):
    b, h, s, d = 2, 3, 9, 4
    x = {"Q": randn(b, h, s, d), "K": randn(b, h, s, d, seed=1), "V": randn(b, h, s, d, seed=2), "scale": 0.6,
         "cap": 1.5, "A": randn(h, seed=3).abs()}
    wrt = ("Q", "K", "V", "A") if variant == "alibi" else ("Q", "K", "V")
    upstream = randn(b, h, s, d, seed=4)

    def by_hand(x):
        return attention(x, variant, causal)
    assert_same(gradients(run(bench.training_attention(variant, causal)), x, wrt, upstream),
                gradients(by_hand, x, wrt, upstream))
    # the baseline computes the same logits (FlexAttention's backward needs a GPU)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(bench.causal_mask, None, None, s, s, device="cpu") if causal else None
    flex = flex_attention(x["Q"], x["K"], x["V"], score_mod=bench.SCORE_MODS[variant](x), block_mask=mask,
                          scale=x["scale"])
    torch.testing.assert_close(flex, by_hand(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_norm_gradients(name):
    source, fn, wrt = {"layernorm": (bench.LAYERNORM_AFFINE, bench.torch_layernorm, ("X", "G", "B")),
                       "rmsnorm": (bench.RMSNORM, bench.torch_rmsnorm, ("X", "G"))}[name]
    x = {"X": randn(5, 7), "G": randn(7, seed=1), "B": randn(7, seed=2), "eps": 1e-6}
    upstream = randn(5, 7, seed=3)
    assert_same(gradients(run(source), x, wrt, upstream), gradients(fn, x, wrt, upstream))


def test_cross_entropy_gradients():
    labels = torch.tensor([0, 3, 10, 3, 1])
    x = {"H": randn(5, 3), "W": randn(11, 3, seed=1), "labels": labels,
         "Y": torch.nn.functional.one_hot(labels, 11).double()}
    upstream = randn(5, seed=2)
    assert_same(gradients(run(bench.CROSS_ENTROPY), x, ("H", "W"), upstream),
                gradients(bench.torch_cross_entropy, x, ("H", "W"), upstream))


def test_the_group_is_registered():
    assert bench.GROUPS["training"] is bench.training_cases


def test_the_training_gpt_with_einfolds_modules_gives_torchs_loss_and_gradients():
    # the training rows' two models differ only in their kit: float64, one batch
    config = bench_gpt.GPTConfig("tiny", vocab=11, d_model=8, heads=2, layers=2, seq=5, batch=3)
    ((tokens, labels),) = bench_gpt.batches(config, 1, device="cpu")
    assert torch.equal(labels[:, :-1], tokens[:, 1:]) and torch.equal(labels, (5 * tokens + 7) % 11)
    results = []
    for kit in (bench_gpt.einfold_kit(compiler, backend="reference"), bench_gpt.torch_kit()):
        torch.manual_seed(0)
        model = bench_gpt.GPT(config, kit, loss_dtype=torch.float64).double()
        loss = model(tokens, labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ours, our_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-8, atol=1e-10, msg=name)



def test_a_training_run_reports_its_steps_median_and_spread():
    # an eager step moves with the host: the rows give the 10th and 90th percentiles beside the median
    steps = [20.0, 13.0, 14.0, *[15.0] * 16, 25.0]          # 20 steps, shuffled extremes
    run = bench_gpt.trained(steps, 3000.0, [10.5, 0.03])
    assert (run.p10, run.ms, run.p90) == (14.0, 15.0, 15.0)
    assert bench_gpt.trained([7.0], 1.0, [1.0]) == bench_gpt.Trained(7.0, 7.0, 7.0, 1.0, [1.0])
    assert "steps p10-p90 14.00-15.00 ms" in bench_gpt._steps(run)
