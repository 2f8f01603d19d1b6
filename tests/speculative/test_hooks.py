"""The proposer's optional hooks: what was accepted, the target's hidden states, rows
released, and the whole state reset after a failed step."""

from __future__ import annotations

from llmlab import LLM, SamplingParams


class Watching:
    """Repeats the last token; records every hook call."""

    wants_hidden_states = True

    def __init__(self):
        self.verified, self.released, self.resets = [], [], 0

    def propose(self, requests, k):
        return [[int(r.token_ids[-1])] * k for r in requests]

    def on_verified(self, results):
        self.verified.extend(results)

    def release(self, rows):
        self.released.extend(rows)

    def reset(self):
        self.resets += 1


def test_hooks_hear_acceptance_hidden_states_and_releases(tiny_llama):
    proposer = Watching()
    llm = LLM(tiny_llama, max_model_len=64, speculative_config={
        "proposer": proposer, "num_speculative_tokens": 3, "speculation_length": "fixed"})
    events = []
    llm.llm_engine.subscribe(events.append)
    prompts = ["the cat sat on the mat and the cat sat on the", "a b a b a b a"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    speculated = [(rid, d, a) for e in events for rid, d, a in e.speculated]
    assert [(v.request_id, len(v.draft), v.num_accepted) for v in proposer.verified] == speculated
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(tiny_llama).hidden_size
    for v in proposer.verified:
        assert tuple(v.hidden_states.shape) == (len(v.draft) + 1, hidden)
        assert v.token_ids[:-1] == v.draft[: v.num_accepted]
    # Every token a request got came from a verification or a plain step, in order.
    emitted = {}
    for v in proposer.verified:
        emitted.setdefault(v.request_id, []).extend(v.token_ids)
    for out in outs:
        assert all(t in out.outputs[0].token_ids for t in emitted.get(out.request_id, []))
    # Both rows were released when their requests finished (reported at the next step).
    llm.llm_engine.step()
    assert sorted(set(proposer.released)) == [0, 1]
