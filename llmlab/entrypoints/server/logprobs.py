"""OpenAI's two logprob shapes: the completions API's (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and chat's (``content`` with each token's alternatives).

Both are built as plain dicts in the JSON shape of their protocol models
(``CompletionLogProbs``, ``ChatLogProbs``): a streamed chunk is serialized as it is, with no
model built per chunk; a full response validates them into its model."""

from __future__ import annotations

import math

from llmlab.entrypoints.server import protocol as p

# JSON has no -inf: a token with probability 0 is reported with this logprob (as vLLM does).
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class _LogprobText:
    """Completions-style logprobs (tokens, token_logprobs, top_logprobs, text_offset).

    ``as_ids``: tokens as ``"token_id:{id}"`` (vLLM's ``return_tokens_as_token_ids``), so
    tokens that decode to the same text (byte-level pieces of one character) stay apart;
    ``text_offset`` still counts the text's characters."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.offset = 0
        self.reset()

    def reset(self) -> None:
        # CompletionLogProbs' fields, in its order
        self.result = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}

    def _name(self, token_id: int, logprob) -> str:
        if self.as_ids:
            return _as_id(token_id)
        return _token_text(self.tokenizer, token_id, logprob)

    def add(self, token_ids, positions, k: int) -> None:
        if positions is None:
            return
        tokens, token_logprobs = self.result["tokens"], self.result["token_logprobs"]
        top_logprobs, text_offset = self.result["top_logprobs"], self.result["text_offset"]
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:  # the first prompt token has no logprob
                text = _token_text(self.tokenizer, token_id, None)
                tokens.append(self._name(token_id, None))
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = position.get(token_id)
                text = _token_text(self.tokenizer, token_id, chosen)
                tokens.append(self._name(token_id, chosen))
                token_logprobs.append(
                    _finite(chosen.logprob) if chosen is not None else _MIN_LOGPROB)
                top = {}
                for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank):
                    if lp.rank <= k or tid == token_id:
                        top.setdefault(self._name(tid, lp), _finite(lp.logprob))
                top_logprobs.append(top)
            text_offset.append(self.offset)
            self.offset += len(text)


def _as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _token_text(tokenizer, token_id: int, logprob) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is None:
        return _as_id(token_id)
    return tokenizer.decode([token_id])


def _chat_logprobs(tokenizer, token_ids, positions, k: int, as_ids: bool = False) -> dict:
    """Chat's logprobs (``ChatLogProbs``' JSON shape); ``as_ids`` as in :class:`_LogprobText`
    (``bytes`` are then those of the ``"token_id:{id}"`` string, as in vLLM)."""

    def name(tid, lp) -> str:
        return _as_id(tid) if as_ids else _token_text(tokenizer, tid, lp)

    content = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        chosen = position.get(token_id)
        text = name(token_id, chosen)
        top = [
            {"token": (t := name(tid, lp)), "logprob": _finite(lp.logprob),
             "bytes": list(t.encode("utf-8"))}
            for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
            if lp.rank <= k
        ][:k]
        content.append({
            "token": text,
            "logprob": _finite(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": top,
        })
    return {"content": content}


def _prompt_logprobs(tokenizer, positions) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, -inf as :data:`_MIN_LOGPROB`."""
    if positions is None:
        return None
    return [
        None if position is None else {
            tid: p.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank,
                                 decoded_token=_token_text(tokenizer, tid, lp))
            for tid, lp in position.items()
        }
        for position in positions
    ]
