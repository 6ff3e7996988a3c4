"""The `flex` and `host` bench groups' programs and baselines, on CPU at tiny sizes:
each einfold source (reference backend, float32 inputs) and FlexAttention with the
variant's score_mod and mask (eager, which runs on CPU) against the same masked
attention written in float64 torch; the kept fractions that the FLOPs count against
that mask; add+gelu against torch; both groups on the command line."""
import math

import pytest
import torch

import compiler
from compiler import bench
from compiler.cli import build_parser

# FlexAttention's "called without torch.compile"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B, H, S, D = 2, 3, 9, 4
DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 2, 2, 2, 5]])
I, M = torch.arange(S)[:, None], torch.arange(S)[None, :]
CAUSAL = M <= I
# each variant's mask by hand ([i, m], or [b, 1, i, m] where it depends on b); None: every pair
KEEP = {"softcap": None, "softcap causal": CAUSAL, "alibi": None, "alibi causal": CAUSAL,
        "window 2": CAUSAL & (I - M < 2),          # the bench's window at S = 9: min(1024, S // 4)
        "document causal": (DOCS[:, None, :, None] == DOCS[:, None, None, :]) & CAUSAL}


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def attention(x, keep, logits=lambda x, s: s):
    """Softmax attention in float64 over logits(q.k * scale), -inf where `keep` fails."""
    x = {n: v.double() if isinstance(v, torch.Tensor) else v for n, v in x.items()}
    s = logits(x, x["Q"] @ x["K"].transpose(-1, -2) * x["scale"])
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ x["V"]


def by_hand(x, name):
    if name.startswith("softcap"):
        return attention(x, KEEP[name], lambda x, s: x["cap"] * torch.tanh(s / x["cap"]))
    if name.startswith("alibi"):
        return attention(x, KEEP[name], lambda x, s: s - x["A"][:, None, None] * (I - M).abs())
    return attention(x, KEEP[name])


def flex(x, score_mod=None, mask_mod=None, enable_gqa=False):
    """FlexAttention in float64 with the bench's score_mod (of the inputs) and mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    x = {n: v.double() if isinstance(v, torch.Tensor) else v for n, v in x.items()}
    b, _, s, _ = x["Q"].shape
    mask = create_block_mask(mask_mod, b, None, s, s, device="cpu") if mask_mod else None
    return flex_attention(x["Q"], x["K"], x["V"], score_mod=score_mod(x) if score_mod else None,
                          block_mask=mask, scale=x["scale"], enable_gqa=enable_gqa)


def test_the_variants_are_those_checked_here():
    assert set(bench.flex_variants(S, DOCS)) == set(KEEP)


@pytest.mark.parametrize("name", list(KEEP))
def test_each_source_and_its_flex_baseline_compute_the_masked_attention(name):
    source, score_mod, mask_mod = bench.flex_variants(S, DOCS)[name]
    # float32 inputs as the bench passes them: cap 30 would leave tanh near linear here
    x = {"Q": randn(B, H, S, D), "K": randn(B, H, S, D, seed=1), "V": randn(B, H, S, D, seed=2), "scale": 0.6,
         "cap": 1.5, "A": randn(H, seed=3).abs(), "D": DOCS.bfloat16()}
    want = by_hand(x, name)
    program = compiler.compile(source, backend="reference")
    got = bench._inputs_of(program)(x)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(flex(x, score_mod, mask_mod), want, rtol=1e-9, atol=1e-9)


def test_grouped_query_attention_pairs_heads_as_enable_gqa_does():
    kv_heads = 2
    x = {"Q": randn(B, 4, S, D), "K": randn(B, kv_heads, S, D, seed=1), "V": randn(B, kv_heads, S, D, seed=2),
         "scale": 0.6}
    # query head h reads KV head h // (4 / kv_heads)
    repeated = {**x, "K": x["K"].repeat_interleave(2, 1), "V": x["V"].repeat_interleave(2, 1)}
    want = attention(repeated, None)
    got = bench._grouped_query(compiler.compile(bench.GROUPED_QUERY, backend="reference"), kv_heads)(x)
    assert got.shape == (B, 4, S, D)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(flex(x, enable_gqa=True), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", list(KEEP))
def test_the_flops_count_the_pairs_the_mask_keeps(name):
    mask_mod = bench.flex_variants(S, DOCS)[name][2]
    keep = KEEP[name]
    want = 1.0 if keep is None else int(keep.expand(B, 1, S, S).sum()) / (B * S * S)
    assert bench.kept_fraction(mask_mod, B, S) == want


@pytest.mark.parametrize("s", [1024, 4096])
def test_the_document_ids_are_exact_in_bf16(s):
    docs = bench.document_ids(16384 // s, s)
    assert torch.equal(docs.bfloat16().long(), docs)
    assert (docs.diff(dim=1) >= 0).all() and (docs[:, -1] > docs[:, 0]).all()   # several per sequence


def test_add_gelu_is_torch_gelu():
    x = {"X": randn(37).double(), "B": randn(37, seed=1).double()}
    got = compiler.compile(bench.ADD_GELU_1D, backend="reference")(**x)
    torch.testing.assert_close(got, torch.nn.functional.gelu(x["X"] + x["B"]), rtol=1e-12, atol=1e-12)


def test_the_groups_are_registered_and_on_the_command_line():
    assert bench.GROUPS["flex"] is bench.flex_cases and bench.ROW_GROUPS["host"] is bench.host_cost
    assert build_parser().parse_args(["bench", "--group", "flex", "--group", "host"]).group == ["flex", "host"]
