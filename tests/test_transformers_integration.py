"""compiler.integrations.transformers: a Hugging Face model with
attn_implementation="einfold" computes what the same model computes with "sdpa"
(logits, greedy tokens, gradients) through prefill, decode from a cache, chunked
prefill, grouped-query heads, left padding and a sliding window; what einfold's
programs cannot say raises an einfold error.  Tiny random models in float32, the
kernels under Triton's interpreter."""
import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import compiler  # noqa: E402
from compiler.integrations import transformers as einfold_transformers  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.filterwarnings("ignore:.past_key_values. is deprecated"),
              pytest.mark.usefixtures("private_cache")]

einfold_transformers.register()

TOLERANCE = dict(rtol=1e-4, atol=1e-5)
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
CONFIGS = {
    "llama": transformers.LlamaConfig(**SHAPE),
    "mistral": transformers.MistralConfig(**SHAPE, sliding_window=4),     # shorter than the sequences
}


def model(config, attn_implementation: str):
    # from_config sets the implementation on the config it is given: one copy each
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation=attn_implementation)


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request):
    """(sdpa, einfold): the same weights, in eval mode."""
    torch.manual_seed(0)
    sdpa = model(CONFIGS[request.param], "sdpa").eval()
    ours = model(CONFIGS[request.param], "einfold").eval()
    ours.load_state_dict(sdpa.state_dict())
    return sdpa, ours


def batch(length: int = 10, padding: int = 3):
    """Two sequences; the second left-padded by `padding` positions."""
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :padding] = 0
    return ids, mask


@torch.no_grad()
def test_prefill_logits_match_sdpa(models):
    ids, _ = batch()
    sdpa, ours = (m(ids).logits for m in models)
    torch.testing.assert_close(ours, sdpa, **TOLERANCE)


@torch.no_grad()
def test_left_padding_matches_sdpa_on_real_positions_and_pads_stay_finite(models):
    ids, mask = batch()
    sdpa, ours = (m(ids, attention_mask=mask).logits for m in models)
    real = mask.bool()
    torch.testing.assert_close(ours[real], sdpa[real], **TOLERANCE)
    assert torch.isfinite(ours).all()


@torch.no_grad()
def test_chunked_prefill_with_a_cache_matches_sdpa(models):
    ids, mask = batch()
    logits = []
    for m in models:
        first = m(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        logits.append(m(ids[:, 6:], attention_mask=mask, past_key_values=first.past_key_values).logits)
    real = mask[:, 6:].bool()
    torch.testing.assert_close(logits[1][real], logits[0][real], **TOLERANCE)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_gives_sdpa_tokens(models, cache):
    ids, mask = batch(length=8)
    sdpa, ours = (m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             cache_implementation=cache) for m in models)
    assert torch.equal(ours, sdpa)


def test_gradients_match_sdpa(models):
    ids, mask = batch()
    weights = torch.randn(2, 10, 128, generator=torch.Generator().manual_seed(2))
    grads = []
    for m in copy.deepcopy(models):
        m.train()
        # the loss reads real positions only: what a padded query row sees is not sdpa's business
        (m(ids, attention_mask=mask).logits * weights)[mask.bool()].sum().backward()
        grads.append({name: p.grad for name, p in m.named_parameters()})
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


UNSUPPORTED = {
    "dropout": (dict(attention_dropout=0.1), dict(), "dropout"),
    "output_attentions": (dict(), dict(output_attentions=True), "attention weights"),
    "4-d mask": (dict(), dict(attention_mask=torch.zeros(1, 1, 6, 6)), "Tensor of shape"),
    "bidirectional": (dict(is_causal=False), dict(), "bidirectional_mask_function"),
    "packed sequences": (dict(), dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False),
                         "another pattern"),
}


@pytest.mark.parametrize("request_", list(UNSUPPORTED))
def test_an_unsupported_request_raises_an_einfold_error(request_):
    overrides, call, named = UNSUPPORTED[request_]
    config = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": 1, **overrides})
    m = model(config, "einfold").train(request_ == "dropout")
    with pytest.raises(compiler.BindError, match=named):
        m(torch.zeros(1, 6, dtype=torch.long), **call)


@torch.no_grad()
def test_a_generation_builds_a_module_per_shape_class_not_per_length():
    """Decoding 32 tokens calls attention at 33 lengths of the cache; the kernels read
    extents as arguments and every length of a shape class decides alike, so the
    lengths share modules (they built one each: 34 modules for 32 tokens)."""
    torch.manual_seed(0)
    ours = model(CONFIGS["llama"], "einfold").eval()
    ids, mask = batch(length=40)
    before = {name for name in sys.modules if name.startswith("einfold_")}
    ours.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    built = {name for name in sys.modules if name.startswith("einfold_")} - before
    assert 1 <= len(built) <= 3, sorted(built)
