"""The ``KVPress`` component kind: which cached tokens of a request are worth keeping.

A press *scores* the tokens one layer of one request holds in the KV cache; the engine keeps
the best-scored ones up to a budget and moves them into fewer blocks (the mechanism lives
in the engine: :mod:`llmlab.kvpress.schedule` on the scheduler side,
:mod:`llmlab.kvpress.runner` on the executor side). A new method is one class with one
method::

    from llmlab.kvpress import KVPress, register_press

    @register_press("value_norm")
    class ValueNorm(KVPress):
        \"\"\"Keep the tokens whose values are largest.\"\"\"

        def score(self, layer):
            return layer.values.float().norm(dim=-1)  # [kv_heads, tokens]

    LLM(model, kv_press="value_norm", kv_press_config={"compression_ratio": 0.5})
    LLM(model, kv_press=ValueNorm(compression_ratio=0.5))      # or an instance

What a press is given (:class:`PressInput`): the layer's cached keys and values, in cache
order (the order the tokens came in; rotary embedding already applied to the keys), the
most recent queries when the press asks for them (``query_window``), and, computed on
demand, those queries' attention over the cached keys. It returns one score per KV head and
token (``[num_kv_heads, num_tokens]``, higher is kept), or one per token (``[num_tokens]``,
the same for every head). Each KV head then keeps its own top tokens, the same number for
every head of a layer; :meth:`KVPress.layer_budgets` says how many per layer (uniform by
default; the ``pyramid`` wrapper gives lower layers more).

Budgets: ``compression_ratio`` is the fraction of the context dropped (0 keeps everything,
which must be token-identical to no press); a request may ask for its own kept fraction
with ``SamplingParams(extra_args={"kv_budget": 0.25})``. The budget counts the request's
whole context so far, so a press that compacts again every ``compress_every`` decode steps
keeps the cache near ``(1 - ratio)`` of the context as it grows.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
import torch

from llmlab import registry
from llmlab.validation import check_budget

__all__ = ["KIND", "KVPress", "PressInput", "check_budget", "kept_count", "register_press",
           "resolve_press"]

KIND = "kv_press"


def _ratio(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"{attribute.name} must be a number in [0, 1) (the fraction of the context "
            f"dropped; 0 keeps everything), got {value!r}"
        )


def _every(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{attribute.name} must be None (compact once, after the prompt) or an int >= 1 "
            f"(also every that many decode steps), got {value!r}"
        )


@attrs.frozen(eq=False)
class PressInput:
    """One layer of one request, as a press sees it at a compaction.

    Attributes:
        layer: the layer index; ``num_layers`` of them in the model.
        keys, values: ``[num_kv_heads, num_tokens, head_dim]``, the cached tokens of this
            layer in cache order (oldest first; earlier compactions keep that order), in
            the cache's dtype. Keys have the rotary embedding applied.
        queries: ``[num_heads, num_queries, head_dim]``, the queries of the most recent
            tokens (rotary applied; the last of them is the newest token), up to the
            press's ``query_window``; None when the press asks for none or none were
            computed (a prompt read from the prefix cache computes only its tail).
        scale: the layer's attention scale (the softmax temperature).
        context_len: the request's whole context (prompt and output so far) in tokens;
            ``num_tokens`` may be smaller after an earlier compaction.
        is_prompt: whether this compaction follows the prompt (else a periodic one).
        generator: a seeded generator for presses that draw (on the cache's device).
    """

    layer: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None
    scale: float
    context_len: int
    is_prompt: bool = True
    generator: torch.Generator | None = None
    _attention: list = attrs.field(factory=list, repr=False, alias="_attention")

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_queries(self) -> int:
        return 0 if self.queries is None else int(self.queries.shape[1])

    def attention(self) -> torch.Tensor:
        """``[num_heads, num_queries, num_tokens]`` float32 softmax weights of the recent
        queries over the cached keys, causal: the ``i``-th of ``q`` recent queries belongs
        to the token at cache index ``num_tokens - q + i`` and sees keys up to it.
        Computed once per layer, on first use."""
        if not self._attention:
            self._attention.append(self._weights(0, self.num_queries))
        return self._attention[0]

    def attention_sum(self, chunk: int = 256) -> torch.Tensor:
        """``[num_heads, num_tokens]`` float32: :meth:`attention` summed over the recent
        queries, computed ``chunk`` queries at a time so a press reading every prompt query
        (H2O) never holds a ``[heads, queries, tokens]`` tensor."""
        if self._attention:
            return self._attention[0].sum(dim=1)
        total = self._weights(0, min(chunk, self.num_queries)).sum(dim=1)
        for lo in range(chunk, self.num_queries, chunk):
            total += self._weights(lo, min(lo + chunk, self.num_queries)).sum(dim=1)
        return total

    def _weights(self, lo: int, hi: int) -> torch.Tensor:
        """Causal softmax weights ``[num_heads, hi - lo, num_tokens]`` of recent queries
        ``lo .. hi - 1``."""
        if self.queries is None:
            raise ValueError(
                "this press asked for attention but has no queries: give it a query_window"
            )
        q = self.queries[:, lo:hi].float()
        k = self.keys.float()
        group = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(group, dim=0) if group > 1 else k
        logits = torch.einsum("hqd,hkd->hqk", q, k) * self.scale
        n = k.shape[1]
        key_pos = torch.arange(n, device=q.device)
        # the i-th recent query is the token at cache index n - num_queries + i
        query_pos = n - self.num_queries + lo + torch.arange(hi - lo, device=q.device)
        logits.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        return torch.softmax(logits, dim=-1)

    def per_kv_head(self, scores: torch.Tensor) -> torch.Tensor:
        """Average ``[num_heads, ...]`` scores over the query heads that share each KV head
        (grouped-query attention): ``[num_kv_heads, ...]``."""
        heads = scores.shape[0]
        kv = self.num_kv_heads
        if heads == kv:
            return scores
        return scores.reshape(kv, heads // kv, *scores.shape[1:]).mean(dim=1)


@attrs.define
class KVPress:
    """Base of every press: subclass it, implement :meth:`score`, and the engine does the
    rest (budgets, selection, moving the kept tokens, freeing blocks).

    Attributes:
        compression_ratio: the fraction of the context dropped at each compaction, in
            ``[0, 1)`` (0: keep everything). A request's ``extra_args["kv_budget"]``
            (the fraction kept, in ``(0, 1]``) overrides it.
        compress_every: also compact every this many decode steps (None: only after the
            prompt).

    Class attributes a press may set:
        query_window: how many of the most recent queries it reads (0: none; -1: all the
            prompt's). The engine keeps them while they are computed, and recomputes at
            least that many prompt tokens even on a prefix-cache hit so the window is whole.
    """

    compression_ratio: float = attrs.field(default=0.0, validator=_ratio, kw_only=True)
    compress_every: int | None = attrs.field(default=None, validator=_every, kw_only=True)

    name: ClassVar[str] = "press"
    query_window: ClassVar[int] = 0

    def score(self, layer: PressInput) -> torch.Tensor:
        """Scores ``[num_kv_heads, num_tokens]`` (or ``[num_tokens]``): higher is kept."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(layer)")

    # -- the plumbing (rarely overridden) ---------------------------------------------------

    @property
    def query_span(self) -> int:
        """The queries this press reads (a wrapper reports its inner press's)."""
        return type(self).query_window

    def keep_fraction(self) -> float:
        return 1.0 - float(self.compression_ratio)

    def layer_budgets(self, context_len: int, keep: float, num_layers: int) -> list[int]:
        """Tokens each layer keeps of a ``context_len``-token context at kept fraction
        ``keep`` (uniform by default). The engine caps each at what the layer holds and at
        least 1; the largest sets how many blocks the request keeps."""
        return [kept_count(context_len, keep)] * num_layers

    def select(self, layer: PressInput, budget: int) -> torch.Tensor:
        """Cache indices each KV head keeps: ``[num_kv_heads, budget]``, ascending: the
        ``budget`` best scores (ties: the later token).

        Raises ``ValueError`` when :meth:`score` returns the wrong shape or non-finite
        values where a choice depends on them (the engine reports it, naming the press,
        and the request goes on uncompressed)."""
        scores = self.score(layer)
        n, heads = layer.num_tokens, layer.num_kv_heads
        if not isinstance(scores, torch.Tensor):
            raise ValueError(
                f"score() must return a tensor [num_kv_heads={heads}, num_tokens={n}] or "
                f"[num_tokens={n}], got {type(scores).__name__}"
            )
        if scores.shape == (n,):
            scores = scores.expand(heads, n)
        if tuple(scores.shape) != (heads, n):
            raise ValueError(
                f"score() must return [num_kv_heads={heads}, num_tokens={n}] or "
                f"[num_tokens={n}], got {list(scores.shape)} for layer {layer.layer}"
            )
        scores = scores.float()
        if torch.isnan(scores).any():
            raise ValueError(f"score() returned NaN for layer {layer.layer}")
        if budget >= n:
            return torch.arange(n, device=scores.device).expand(heads, n)
        # A stable sort over the tokens newest first, so ties keep the later token on every
        # backend and run: topk's choice among equal scores is unspecified, and ties are
        # common (a press's +inf for the tokens it always keeps, which a small budget must
        # cut, newest kept; equal key norms: rotary keeps a repeated token's norm).
        order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices
        return torch.sort(n - 1 - order[:, :budget], dim=-1).values


def kept_count(context_len: int, keep: float) -> int:
    """``floor(context_len * keep)``, at least 1 (a tolerance keeps 0.7 * 10 at 7)."""
    return max(1, min(context_len, math.floor(context_len * keep + 1e-9)))


def register_press(name: str | None = None):
    """Register a press class under ``name`` (for ``LLM(kv_press=...)``, the CLI, the server)."""
    return registry.register(KIND, name)


def resolve_press(press: Any, config: dict | None = None) -> KVPress:
    """A press from a registered name, ``"package.module:Class"`` or a class (``config``:
    its keyword arguments), or an instance as it is: :func:`llmlab.registry.build` (a
    config with an instance is refused), with the older ``ValueError`` for a config the
    press does not take (``registry.build`` raises ``TypeError``)."""
    try:
        return registry.build(KIND, press, config)
    except TypeError as err:
        raise ValueError(str(err)) from err
