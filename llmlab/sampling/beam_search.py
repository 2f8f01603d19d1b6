"""Beam search with vLLM's ``LLM.beam_search`` shapes and Hugging Face's results.

The shapes are vLLM's (:class:`BeamSearchParams`, :class:`BeamSearchSequence`,
:class:`BeamSearchOutput`); the algorithm is written against a callable, ``expand``, so it
runs without an engine: the engine supplies ``expand`` (one batched forward over every live
beam, then a top-k of the last position's log-probabilities) and ``decode``.

Which Hugging Face search this is
---------------------------------
:func:`beam_search` returns, token for token and in the same order, what the installed
``transformers`` returns for::

    model.generate(input_ids, do_sample=False, num_beams=beam_width,
                   num_return_sequences=beam_width, max_new_tokens=max_tokens,
                   length_penalty=length_penalty, early_stopping=False,
                   eos_token_id=sorted(eos_token_ids))   # eos_token_id=None for ignore_eos

with no other logits processors (no ``min_length``, repetition penalty, ...), one prompt per
``generate`` call (so no padding), and the same per-step log-probabilities. Concretely,
following ``GenerationMixin._beam_search`` and its helpers:

* Each step, the ``K = max(2, 1 + len(eos_token_ids)) * beam_width`` candidates with the
  highest cumulative log-probability are taken over every live beam of a prompt (``K`` is
  ``2 * beam_width`` for one EOS id or with ``ignore_eos``; asking each beam for its own top
  ``K`` is enough to find the overall top ``K``). The first step starts from the prompt alone.
* A candidate *hits a stop* when its token is an EOS id (unless ``ignore_eos``) or when it
  brings the sequence to its length limit. The next live beams are the ``beam_width`` best
  candidates that did not hit a stop.
* Only the first ``beam_width`` of the ``K`` candidates may become finished hypotheses (HF's
  ``top_num_beam_mask``): an EOS candidate ranked below that is dropped. A finished
  hypothesis scores ``cum_logprob / generated_len ** length_penalty``, ``generated_len``
  counting the EOS token; the ``beam_width`` best are kept.
* ``early_stopping=False``'s "done" test: a prompt stops once it holds ``beam_width``
  finished hypotheses and its best live beam's ``cum_logprob / generated_len **
  length_penalty`` (its current length, a heuristic when ``length_penalty > 0``) is not
  above the worst finished score. It also stops at its length limit, where every candidate
  hits a stop.
* The result is the finished hypotheses, best score first (HF's ``sequences_scores`` is
  :func:`beam_score` of each).

Not matched: ``early_stopping=True`` or ``"never"`` (HF's other heuristics), sampling
(``do_sample=True``), exact ties between candidates (HF's order is ``torch.topk``'s; here it
is the beam's order, then the token's rank), and a vocabulary smaller than ``K`` (HF then
fills with candidates from its padding beams at -1e9; here fewer beams live on, and fewer
than ``beam_width`` sequences may come back).

Where vLLM differs
------------------
vLLM's ``LLM.beam_search`` ranks beams with ``get_beam_search_score``, whose length counts
the prompt (and leaves out a final EOS); here the length is the number of generated tokens,
EOS included, as HF does. vLLM also sends every EOS candidate of each beam's ``2 *
beam_width`` to the finished list (not only those among the overall best ``beam_width``),
has no early stop (it always runs ``max_tokens`` steps), and returns the whole candidate dict
as each position's logprobs. Here each position's logprobs hold the chosen token only,
``{token: Logprob(logprob, rank)}``, ``rank`` being its place in that beam's ``expand`` list.

Fields, as vLLM fills them: ``tokens`` is prompt plus generated tokens, a final EOS
included (as ``LLM.beam_search`` and HF keep it). ``finish_reason`` is ``"stop"`` for a
sequence that ended on EOS, with ``stop_reason`` that EOS id (vLLM's ``EngineClient``
beam search; ``LLM.beam_search`` leaves both unset), else ``"length"`` with ``stop_reason``
None. ``text`` is ``decode(tokens)`` over the whole sequence, prompt included, as
``LLM.beam_search`` does, without the final EOS unless ``include_stop_str_in_output``.
``temperature`` is carried for the caller, which applies it to the logits before
``log_softmax``: the search sees only what ``expand`` returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import attrs

from llmlab.sampling.logprobs import Logprob
from llmlab.validation import as_bool, as_int, as_real

Expand = Callable[[list[list[int]], int], list[list[tuple[int, float]]]]


@attrs.frozen
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, checked at construction.

    Attributes:
        beam_width: beams kept per prompt, and sequences returned (>= 1).
        max_tokens: most tokens generated per sequence (>= 1).
        ignore_eos: EOS is an ordinary token: nothing finishes before ``max_tokens``.
        temperature: for the caller's ``expand``, which divides the logits by it before
            ``log_softmax`` (0 means none). The search itself does not read it.
        length_penalty: exponent of the generated length dividing a finished sequence's
            ``cum_logprob`` (HF's meaning; any finite value).
        include_stop_str_in_output: keep a final EOS in ``text``.
    """

    beam_width: int = attrs.field(
        converter=functools.partial(as_int, "beam_width", min=1, allowed="an int >= 1")
    )
    max_tokens: int = attrs.field(
        converter=functools.partial(as_int, "max_tokens", min=1, allowed="an int >= 1")
    )
    ignore_eos: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "ignore_eos")
    )
    temperature: float = attrs.field(
        default=0.0, converter=functools.partial(as_real, "temperature", min=0, allowed=">= 0")
    )
    length_penalty: float = attrs.field(
        default=1.0, converter=functools.partial(as_real, "length_penalty")
    )
    include_stop_str_in_output: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "include_stop_str_in_output")
    )


@attrs.define
class BeamSearchSequence:
    """One beam (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: prompt plus generated tokens (a final EOS included).
        logprobs: per generated position, ``{token: Logprob}`` for the chosen token.
        cum_logprob: sum of the generated tokens' log-probabilities.
        text: ``decode`` of the sequence, filled on the returned sequences only.
        finish_reason: ``"stop"`` (ended on EOS) or ``"length"``; None while live.
        stop_reason: the EOS id for ``"stop"``, else None.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@attrs.define
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


def beam_score(cum_logprob: float, generated_len: int, length_penalty: float) -> float:
    """HF's hypothesis score: ``cum_logprob / generated_len ** length_penalty``."""
    return cum_logprob / (generated_len**length_penalty)


@attrs.define
class _Beam:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float


@attrs.define
class _Prompt:
    """One prompt's search: live beams (best first) and finished hypotheses (best first)."""

    prompt_len: int
    max_len: int  # total length (prompt + generated) at which a sequence stops
    live: list[_Beam]
    finished: list[tuple[float, BeamSearchSequence]] = attrs.Factory(list)
    done: bool = False


def _max_len(prompt_len: int, max_tokens: int, max_model_len: int | None, index: int) -> int:
    if prompt_len == 0:
        raise ValueError(f"prompts[{index}] is empty; beam search needs at least one token")
    limit = prompt_len + max_tokens
    if max_model_len is not None:
        if prompt_len >= max_model_len:
            raise ValueError(
                f"prompts[{index}] has {prompt_len} tokens, which leaves no room to generate "
                f"within max_model_len={max_model_len}"
            )
        limit = min(limit, max_model_len)
    return limit


def candidates_per_beam(params: BeamSearchParams, eos_token_ids: Iterable[int]) -> int:
    """How many next tokens each beam is expanded with: HF's ``beams_to_keep``, enough
    candidates that ``beam_width`` of them do not end on EOS."""
    num_eos = 0 if params.ignore_eos else len(frozenset(eos_token_ids))
    return max(2, 1 + num_eos) * params.beam_width


def beam_search(
    expand: Expand,
    prompts: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: frozenset[int],
    max_model_len: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search over every prompt at once; one :class:`BeamSearchOutput` per prompt.

    ``expand(sequences, k)`` gets every live beam of every unfinished prompt (prompt plus
    generated tokens) and returns, per sequence, its ``k`` most likely next tokens as
    ``(token, logprob)``, most likely first (fewer if the vocabulary is smaller). It is
    called once per step. ``max_model_len`` caps prompt plus generated tokens (a sequence
    reaching it finishes with ``"length"``). ``decode`` fills ``text``. See the module
    docstring for the exact Hugging Face semantics.
    """
    width = params.beam_width
    eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
    num_candidates = candidates_per_beam(params, eos)
    states = []
    for i, prompt in enumerate(prompts):
        tokens = [int(t) for t in prompt]
        limit = _max_len(len(tokens), params.max_tokens, max_model_len, i)
        states.append(_Prompt(len(tokens), limit, [_Beam(tokens, [], 0.0)]))

    while True:
        active = [s for s in states if not s.done]
        if not active:
            break
        sequences = [beam.tokens for s in active for beam in s.live]
        expansions = expand(sequences, num_candidates)
        if len(expansions) != len(sequences):
            raise RuntimeError(
                f"expand returned {len(expansions)} candidate lists for {len(sequences)} sequences"
            )
        start = 0
        for state in active:
            stop = start + len(state.live)
            _step(state, expansions[start:stop], width, num_candidates, eos, params.length_penalty)
            start = stop

    outputs = []
    for state in states:
        best = [seq for _, seq in state.finished[:width]]
        for seq in best:
            if decode is not None:
                keep_eos = params.include_stop_str_in_output or seq.finish_reason != "stop"
                seq.text = decode(seq.tokens if keep_eos else seq.tokens[:-1])
        outputs.append(BeamSearchOutput(best))
    return outputs


def _step(
    state: _Prompt,
    expansions: list[list[tuple[int, float]]],
    width: int,
    num_candidates: int,
    eos: frozenset[int],
    length_penalty: float,
) -> None:
    """One step of HF's ``_beam_search`` for one prompt (batch size 1)."""
    # Every beam's candidates, best cumulative logprob first; the sort is stable, so ties
    # keep beam order, then rank order.
    candidates = []
    for beam_index, (beam, top) in enumerate(zip(state.live, expansions, strict=True)):
        for rank, (token, logprob) in enumerate(top[:num_candidates], start=1):
            logprob = float(logprob)
            candidates.append((beam.cum_logprob + logprob, beam_index, rank, int(token), logprob))
    candidates.sort(key=lambda c: -c[0])
    candidates = candidates[:num_candidates]

    new_len = len(state.live[0].tokens) + 1
    generated_len = new_len - state.prompt_len
    at_limit = new_len >= state.max_len
    next_live: list[_Beam] = []
    newly_finished: list[tuple[float, BeamSearchSequence]] = []
    for position, (cum, beam_index, rank, token, logprob) in enumerate(candidates):
        ends_on_eos = token in eos
        hits_stop = ends_on_eos or at_limit
        eligible = hits_stop and position < width  # HF's top_num_beam_mask
        if not (eligible or (not hits_stop and len(next_live) < width)):
            continue
        parent = state.live[beam_index]
        tokens = [*parent.tokens, token]
        logprobs = [*parent.logprobs, {token: Logprob(logprob, rank)}]
        if not hits_stop:
            next_live.append(_Beam(tokens, logprobs, cum))
            continue
        seq = BeamSearchSequence(
            tokens=tokens,
            logprobs=logprobs,
            cum_logprob=cum,
            finish_reason="stop" if ends_on_eos else "length",
            stop_reason=token if ends_on_eos else None,
        )
        newly_finished.append((beam_score(cum, generated_len, length_penalty), seq))

    if newly_finished:
        merged = state.finished + newly_finished
        merged.sort(key=lambda item: -item[0])  # stable: earlier hypotheses win ties
        state.finished = merged[:width]
    state.live = next_live

    if at_limit or not next_live:
        state.done = True
    elif len(state.finished) == width:
        # early_stopping=False: can the best live beam, scored at its current length, still
        # beat the worst finished hypothesis?
        best_possible = beam_score(next_live[0].cum_logprob, generated_len, length_penalty)
        state.done = not best_possible > state.finished[-1][0]
