"""Log-probabilities as the engine carries them and as vLLM returns them.

Inside the engine, one position's logprobs are a compact :class:`TokenLogprobs` (the token
that was sampled, or the prompt token that follows, first; then the ``k`` most likely tokens
by rank). Outputs turn them into vLLM's shape: a ``dict`` ``{token_id: Logprob}`` per position.
Logprobs are those of the model's raw distribution, ``log_softmax(logits)`` before any
processing (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.define
class Logprob:
    """One token's log-probability at a position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability under the model's raw distribution.
        rank: 1 for the most likely token; for the chosen token, the number of tokens at
            least as likely as it.
        decoded_token: the token's text, when the request detokenizes.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@attrs.frozen
class TokenLogprobs:
    """Logprobs at one position: ``token_ids[0]`` is the chosen token, then the top-k.

    The chosen token may appear twice (first, and again among the top-k): the dict form
    keeps one entry per token.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]

    def to_dict(self, decode=None) -> dict[int, Logprob]:
        """vLLM's ``{token_id: Logprob}``; ``decode(token_id) -> str`` fills ``decoded_token``."""
        out: dict[int, Logprob] = {}
        for tok, lp, rank in zip(self.token_ids, self.logprobs, self.ranks, strict=True):
            if tok not in out:
                out[tok] = Logprob(lp, rank, decode(tok) if decode is not None else None)
        return out


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row of ``logprobs`` ``[N, V]``: the chosen token's logprob and rank, plus the
    ``num_top[i]`` most likely tokens (None for a row that asked for none, -1 for all).

    One top-k over the batch (the largest ``k`` asked), one rank count, one transfer.
    """
    vocab = logprobs.shape[1]
    # -1 asks for the whole vocabulary (vLLM's meaning).
    num_top = [vocab if k is not None and k < 0 else k for k in num_top]
    rows = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return out
    index = torch.tensor(rows, device=logprobs.device)
    lp = logprobs.index_select(0, index)
    tok = chosen.index_select(0, index)
    chosen_lp = lp.gather(1, tok[:, None])
    # vLLM's rank: how many tokens are at least as likely as the chosen one.
    rank = (lp >= chosen_lp).sum(dim=1)
    k_max = min(max(num_top[i] for i in rows), lp.shape[1])
    if k_max > 0:
        top_lp, top_ids = lp.topk(k_max, dim=1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    chosen_lp, tok, rank = chosen_lp[:, 0].tolist(), tok.tolist(), rank.tolist()
    for j, i in enumerate(rows):
        k = min(num_top[i], k_max)
        ids = (tok[j], *(top_ids[j][:k] if k else ()))
        lps = (chosen_lp[j], *(top_lp[j][:k] if k else ()))
        out[i] = TokenLogprobs(ids, lps, (rank[j], *range(1, k + 1)))
    return out
