"""A request whose text is due only when it ends (``FINAL_ONLY``, no stop strings) is not
detokenized step by step: its tokens are decoded once, at the end, to the same text."""

from __future__ import annotations

import pytest

from llmlab import LLM, SamplingParams
from llmlab.engine.detokenizer import IncrementalDetokenizer
from llmlab.sampling.params import RequestOutputKind

PROMPTS = ["the cat sat on", "hello world, this is", "one two three four five six"]
NEVER = "\u2042\u2042\u2042"  # a stop string the tiny model's text never holds


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", seed=0)


def _texts(llm, kind, **extra):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, n=2, output_kind=kind,
                            **extra)
    texts: dict[tuple[str, int], str] = {}
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        for c in out.outputs:  # DELTA outputs come one step at a time: add them up
            texts[out.request_id, c.index] = texts.get((out.request_id, c.index), "") + c.text
    return sorted(texts.values())


def test_final_only_text_is_decoded_once_and_equals_the_streamed_text(llm, monkeypatch):
    finals = []
    update = IncrementalDetokenizer.update

    def spy(self, ids, num, *, stop_terminated=False, final=False):
        finals.append(final)
        return update(self, ids, num, stop_terminated=stop_terminated, final=final)

    monkeypatch.setattr(IncrementalDetokenizer, "update", spy)
    deferred = _texts(llm, RequestOutputKind.FINAL_ONLY)
    assert finals and all(finals)  # fed once per sample, at its end
    assert len(finals) == 2 * len(PROMPTS)
    finals.clear()
    # A stop string that never matches keeps step-by-step decoding (LLM.generate reports
    # FINAL_ONLY whatever the params say): the same tokens, the same text.
    stepped = _texts(llm, RequestOutputKind.FINAL_ONLY, stop=[NEVER])
    assert finals and not any(finals)
    assert deferred == stepped and any(deferred)

