"""Teacher-forced agreement between a float engine and a quantized one.

The float engine decodes greedily; the quantized engine then scores the float sequence in
one prefill with ``prompt_logprobs=1`` (vLLM's: each prompt position's token plus the
most likely one, rank 1), and each continuation position counts as agreeing when the
quantized model's most likely token there is the float model's choice. So one early
disagreement does not derail the rest of the comparison, as free-running decoding would.
"""

from __future__ import annotations

from llmlab import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [17, 3, 99, 42], list(range(20, 44)), [11] * 9]
CONTINUATION_TOKENS = 16


def greedy_continuations(llm: LLM, prompts=PROMPTS, max_tokens=CONTINUATION_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def argmax_under(llm: LLM, prompts, continuations) -> list[list[int]]:
    """The model's most likely token at each continuation position, given the true prefix."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    sequences = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
    outputs = llm.generate(sequences, params, use_tqdm=False)
    found = []
    for prompt, out in zip(prompts, outputs):
        positions = out.prompt_logprobs[len(prompt):]
        # The entry with the highest logprob, not the one marked rank 1: when the scored
        # token ties with another for the top (bf16 on CUDA does tie), its rank is 2 (vLLM's
        # "at least as likely" count) and the top-1 entry for the same id is merged into
        # it, so no entry says rank 1 (seen on the H200, 2026-11-26). A tie counts as
        # agreement: the scored token comes first and max keeps the first of equals.
        found.append([
            max(position.items(), key=lambda item: item[1].logprob)[0]
            for position in positions
        ])
    return found


def agreement(reference: LLM, candidate: LLM, prompts=PROMPTS) -> float:
    """Fraction of the reference's greedy continuation positions where ``candidate``'s
    argmax, teacher-forced on the reference's prefix, is the same token."""
    continuations = greedy_continuations(reference, prompts)
    chosen = argmax_under(candidate, prompts, continuations)
    pairs = [(a, b) for c, q in zip(continuations, chosen) for a, b in zip(c, q)]
    return sum(a == b for a, b in pairs) / len(pairs)
