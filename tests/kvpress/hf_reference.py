"""An independent Hugging Face reference for KV-cache eviction ("KV presses").

:func:`hf_greedy_with_eviction` decodes greedily with a transformers ``DynamicCache`` whose
per-(layer, KV head) contents are cut down by a ``keep`` callable after the prefill (and,
optionally, every ``compress_every`` decode steps). Kept tokens keep their original positions:
the cached keys already carry their rotary embedding, and each new token is fed with its true
position, however short the cache has become. The engine's presses are checked against it
token for token.

What transformers (checked on 5.24) needs for a cropped cache:

- Positions: the model derives ``position_ids`` from the cache length when none are passed,
  which is wrong once tokens are evicted, so the decode step passes them explicitly. 5.24 has no
  ``cache_position`` argument any more (the mask reads offsets from the cache itself); older
  versions, which had one, were not checked.
- Mask: ``create_causal_mask`` sizes the decode mask from the cache length of the first full
  attention layer (``q_offset = kv_len``, ``kv_length = kv_len + 1``), so for one query token
  every cached entry is visible and nothing is hidden. SDPA drops the mask entirely for a single
  query. But eager attention adds the mask unsliced, so a layer whose kept count differs from
  layer 0's would get a mask of the wrong width. A single decode token must see every cached
  entry plus itself, which is exactly "no mask", so during decode the mask handed to each
  attention module is replaced by ``None`` (:func:`_no_attention_mask`), whatever the layer
  lengths and the attention implementation.
- Sliding-window layers (Mistral, windowed Qwen2) keep their own counters and would fight the
  eviction, so such models are rejected.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch

KeepFn = Callable[[int, torch.Tensor, int], torch.Tensor]
"""``keep(layer_idx, keys [num_kv_heads, n, head_dim], context_len)`` returns the kept cache
indices ``[num_kv_heads, k]``, ascending per head."""


def sinks_and_window(n_sink: int, window: int) -> KeepFn:
    """A ``keep`` that retains the first ``n_sink`` and the last ``window`` cache slots of every
    head (StreamingLLM's attention sinks plus a recent window; Xiao et al., 2023), or every
    slot when the cache holds no more than ``n_sink + window``."""
    if n_sink < 0 or window < 0:
        raise ValueError(f"n_sink and window must be >= 0, got {n_sink} and {window}")

    def keep(layer_idx: int, keys: torch.Tensor, context_len: int) -> torch.Tensor:
        num_heads, n = keys.shape[0], keys.shape[1]
        if n <= n_sink + window:
            slots = torch.arange(n)
        else:
            slots = torch.cat([torch.arange(n_sink), torch.arange(n - window, n)])
        return slots.to(keys.device).expand(num_heads, -1)

    return keep


def hf_greedy_with_eviction(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    keep: KeepFn,
    compress_every: int | None = None,
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens after ``prompt_ids`` with ``model`` (an HF causal
    LM in eval mode, batch 1), evicting cached tokens with ``keep``; return the generated ids.

    The prompt is prefilled with full causal attention and its last logits give the first token.
    Then ``keep`` is called once per layer with that layer's cached keys and returns, per KV
    head, the ascending cache indices to retain (the same count for every head of a layer); keys
    and values are gathered accordingly. Each decode step feeds the previous token at its
    original position and attends to every kept entry plus itself. With ``compress_every``, the
    eviction repeats after every ``compress_every`` decode steps, on the kept tokens plus those
    decoded since. No EOS handling: exactly ``max_new_tokens`` ids come back.
    """
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if compress_every is not None and compress_every < 1:
        raise ValueError(f"compress_every must be None or >= 1, got {compress_every}")
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    cache_kwarg = _cache_kwarg_name(model)
    with torch.no_grad():
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        logits = model(input_ids=prompt, use_cache=True, **{cache_kwarg: cache}).logits
        generated = [int(logits[0, -1].argmax())]
        _check_full_attention_layers(cache)
        context_len = len(prompt_ids)
        _evict(cache, keep, context_len)

        steps_since_eviction = 0
        with _no_attention_mask(model):
            while len(generated) < max_new_tokens:
                # The token fed now sits after every token seen so far, evicted or not.
                position = context_len
                out = model(
                    input_ids=torch.tensor([[generated[-1]]], device=device),
                    position_ids=torch.tensor([[position]], device=device),
                    use_cache=True,
                    **{cache_kwarg: cache},
                )
                generated.append(int(out.logits[0, -1].argmax()))
                context_len += 1
                steps_since_eviction += 1
                if compress_every is not None and steps_since_eviction == compress_every:
                    _evict(cache, keep, context_len)
                    steps_since_eviction = 0
    return generated


def _evict(cache, keep: KeepFn, context_len: int) -> None:
    """Replace every layer's cached keys/values by the per-head entries ``keep`` selects."""
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values  # [1, num_kv_heads, n, head_dim]
        if keys.shape[0] != 1:
            raise ValueError(f"only batch 1 is supported, got batch {keys.shape[0]}")
        num_heads, n = keys.shape[1], keys.shape[2]
        kept = keep(layer_idx, keys[0], context_len)
        _check_kept(kept, layer_idx, num_heads, n)
        index = kept.to(device=keys.device, dtype=torch.long)[None, :, :, None]
        layer.keys = keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])).contiguous()
        layer.values = values.gather(2, index.expand(-1, -1, -1, values.shape[-1])).contiguous()


def _check_kept(kept: torch.Tensor, layer_idx: int, num_heads: int, n: int) -> None:
    where = f"keep(layer_idx={layer_idx}) on a cache of {n} entries"
    if kept.dim() != 2 or kept.shape[0] != num_heads:
        raise ValueError(
            f"{where} must return [num_kv_heads={num_heads}, k], got {tuple(kept.shape)}"
        )
    if kept.dtype.is_floating_point or kept.dtype == torch.bool:
        raise ValueError(f"{where} must return integer indices, got {kept.dtype}")
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= n):
        raise ValueError(f"{where} returned an index outside [0, {n})")
    if kept.shape[1] > 1 and not bool((kept[:, 1:] > kept[:, :-1]).all()):
        raise ValueError(f"{where} must return strictly ascending indices per head")


def _check_full_attention_layers(cache) -> None:
    for layer_idx, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise ValueError(
                f"layer {layer_idx} uses a {type(layer).__name__} cache; eviction is only defined "
                "for full-attention layers"
            )


def _cache_kwarg_name(model) -> str:
    # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works
    # there, with a deprecation warning, until 5.40); older versions only know the old name.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@contextlib.contextmanager
def _no_attention_mask(model) -> Iterator[None]:
    """Hand every attention module ``attention_mask=None`` while active (see module docstring:
    for one query token that means "attend to all cached entries and itself", for any per-layer
    cache length)."""
    modules = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not modules:
        raise ValueError(f"no '*.self_attn' modules found in {type(model).__name__}")

    def drop_mask(module, args, kwargs):
        if "attention_mask" not in kwargs:
            raise RuntimeError(f"{type(module).__name__} did not get attention_mask by keyword")
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        if hidden_states is not None and hidden_states.shape[1] != 1:
            raise RuntimeError("the mask may only be dropped for single-token decode steps")
        return args, {**kwargs, "attention_mask": None}

    handles = [m.register_forward_pre_hook(drop_mask, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
