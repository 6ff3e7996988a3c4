"""einfold attention for Hugging Face transformers.

    from compiler.integrations import transformers as einfold_transformers
    einfold_transformers.register()                 # once, under the name "einfold"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="einfold")

`register` puts two functions under one name: the mask function transformers calls
once a forward (`AttentionMaskInterface`), which reduces its mask to a `KeyMask`
(the causal offset of the cache, the sliding window, a padding vector over the keys),
and the attention function each layer calls (`AttentionInterface`), which runs one
of the programs of `attention_source` on transformers' tensors as they come.
Whatever those programs cannot say raises `BindError` naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ..errors import BindError
from ..nn import shared_program
from ..program import Program


@dataclass(frozen=True)
class KeyMask:
    """What einfold's attention reads of a transformers mask.  Query i sits at key
    position i + `offset` and sees the keys m <= i + offset (the latest `window` of
    them where `window` is set) that `key_valid[b, m]` marks as real; a query that is
    padding itself sees its own key, so that its row stays finite."""

    offset: int
    kv_length: int
    window: int | None
    key_valid: torch.Tensor | None          # [batch, kv_length]: 1 a real key, 0 padding; None: no padding

    # `generate` builds the mask of a static cache ahead of the forward and hands it to the
    # model's mask function again, which asks any mask it gets for its `ndim` (2: a padding
    # mask to build from); `key_mask` then passes it on unchanged.
    ndim = 4


def attention_source(windowed: bool, padded: bool) -> str:
    """The program for one variant: queries as (kv head g, head r of the group) in
    `repeat_kv`'s order, so grouped heads read their key and value head in place; the
    output's [b, g, r, i, j] layout tiles one query head's rows at a time."""
    allowed = ["m <= i + offset"]
    if windowed:
        allowed.append("i + offset - m < window")
    if padded:
        allowed.append("(Valid[b, m] > 0 or m == i + offset)")
    return (f"O[b, g, r, i, j] = softmax[m](where({' and '.join(allowed)}, "
            f"Q[b, g, r, i, k] * K[b, g, m, k] * scale, -inf)) * V[b, g, m, j]")


def _program(windowed: bool, padded: bool) -> Program:
    return shared_program(attention_source(windowed, padded))


def _window(mask_function, config, batch_size: int, q_length: int, kv_length: int, q_offset: int,
            kv_offset: int, use_vmap: bool, device) -> int | None:
    """The sliding window `mask_function` draws (None: plain causal).  A function other
    than transformers' causal one is drawn once and compared with the causal pattern,
    windowed by the config's `sliding_window` or not; any other pattern raises."""
    if mask_function is causal_mask_function:
        return None
    drawn = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      allow_is_causal_skip=False, use_vmap=use_vmap, device=device)
    query = torch.arange(q_length, device=device)[:, None] + q_offset
    key = torch.arange(kv_length, device=device)[None, :] + kv_offset
    configured = getattr(config, "sliding_window", None)
    for window in ([configured] if configured else []) + [None]:
        pattern = (key <= query) if window is None else (key <= query) & (query - key < window)
        if torch.equal(drawn, pattern.expand_as(drawn)):
            return window
    windowed = f" or causal within the config's sliding window of {configured}" if configured else ""
    raise BindError(f"einfold attention takes causal masks{windowed}; transformers asked for another pattern "
                    f"({mask_function.__qualname__}: a bidirectional, chunked, packed-sequence "
                    f"or custom mask)")


def key_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=causal_mask_function, attention_mask: torch.Tensor | KeyMask | None = None,
             config=None, use_vmap: bool = False, dtype: torch.dtype = torch.float32, device="cpu",
             **kwargs) -> KeyMask:
    """transformers' mask interface (the signature of `masking_utils.sdpa_mask`): the
    `KeyMask` of one forward, shared by every layer that reads this mask."""
    if isinstance(attention_mask, KeyMask):
        return attention_mask
    q_offset = int(q_offset)                # a static cache gives a 0-d tensor
    window = _window(mask_function, config, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap,
                     device)
    key_valid = None
    if attention_mask is not None:
        # positions kv_offset ... of the whole sequence; a static cache's slots past it are empty
        padding = attention_mask[:, kv_offset:kv_offset + kv_length]
        padding = torch.nn.functional.pad(padding, (0, kv_length - padding.shape[1]))
        if not padding.all():
            key_valid = padding.to(dtype)
    return KeyMask(q_offset - kv_offset, kv_length, window, key_valid)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: KeyMask | torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (the signature of `sdpa_attention_forward`):
    query [b, h, q, d], key and value [b, kv heads, kv, d] (the whole cache) in,
    [b, q, h, d] out, computed where the tensors lie."""
    _refuse_unsupported(attention_mask, dropout, kwargs)
    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise BindError(f"einfold attention groups query heads by key-value head: {heads} query heads "
                        f"are not a multiple of {kv_heads} key-value heads")
    if kv_length != attention_mask.kv_length:
        raise BindError(f"the keys hold {kv_length} positions but the mask was built for "
                        f"{attention_mask.kv_length} (a cache that does not match its mask sizes)")
    inputs = dict(Q=query.unflatten(1, (kv_heads, heads // kv_heads)), K=key, V=value,
                  offset=attention_mask.offset, scale=1 / math.sqrt(head_dim) if scaling is None else scaling)
    if attention_mask.window is not None:
        inputs["window"] = attention_mask.window
    if attention_mask.key_valid is not None:
        inputs["Valid"] = attention_mask.key_valid.to(query.dtype)
    out = _program(attention_mask.window is not None, attention_mask.key_valid is not None)(**inputs)
    return out.flatten(1, 2).transpose(1, 2), None


def _refuse_unsupported(attention_mask, dropout: float, kwargs: dict) -> None:
    if not isinstance(attention_mask, KeyMask):
        given = ("no mask" if attention_mask is None
                 else f"a {type(attention_mask).__name__} of shape {tuple(attention_mask.shape)}")
        raise BindError(f"einfold attention reads the masks its own mask function builds; it got {given} "
                        f"(a custom 4-d mask, or a model that builds no mask through masking_utils)")
    if dropout > 0:
        raise BindError(f"einfold attention has no dropout (got dropout={dropout}); call model.eval() "
                        f"or set the config's attention_dropout to 0")
    if kwargs.get("output_attentions"):
        raise BindError("einfold attention does not return attention weights (output_attentions=True)")
    for name in ("softcap", "position_bias", "s_aux", "cu_seq_lens_q"):
        if kwargs.get(name) is not None:
            raise BindError(f"einfold attention does not support {name!r}")


def register(name: str = "einfold") -> None:
    """Register einfold attention and its mask function with transformers under
    `name`, so that `attn_implementation=name` selects it."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, key_mask)
