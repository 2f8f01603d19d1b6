"""Speculative decoding: output tokens/s with and without each proposer, in one process.

Two workloads over the built-in story model (``llmlab-stories``; its draft partner
``llmlab-stories-draft`` for ``draft_model``):

* ``copy``: the output copies from the prompt, as in rewrite and edit tasks: each prompt is
  a story's opening, a draft of the text, a blank line and the opening again; greedy. The
  draft is a text the model writes again when the prompt holds it (found by iterating:
  the model's story, then what it writes with that in the prompt, a few rounds), so the
  output copies the prompt and n-gram and suffix lookups find long matches there. (A
  prompt holding just any story does not work: the 3.3M-parameter model starts a new
  story rather than copying.)
* ``free``: the output does not copy: a story's first sentence, sampled at temperature 1.0
  (seeded per request): drafts are poor, the workload where speculation usually loses.

At each concurrency (1, 8, 64: ``max_num_seqs`` = concurrency, with 4 requests per slot
queued at once so the slots stay busy) every method runs the same requests: ``off`` (the
baseline) and each proposer with the default adaptive length (``--length fixed`` to draft
every step), in shuffled order.
Each engine first runs a warm-up of the same shape (another seed; ``--cold``: four
requests only), so the adaptive length has learned what pays, as in a serving engine.
Reported per run: output tokens/s, the ratio to ``off`` in the same run, mean acceptance
length (1 + accepted / drafts: tokens per verification step, bonus included), acceptance
rate, and the unconditional acceptance rate of positions 1..k (``docs/speculative.md``).
Each run is repeated ``--repeats`` times, alternating methods, and the fastest kept (a
shared, noisy machine).

    python -m benchmarks.speculative
    python -m benchmarks.speculative --concurrency 1 --methods off,ngram,draft_model
"""

from __future__ import annotations

import argparse
import random
import time

from llmlab import LLM, SamplingParams
from llmlab.builtin import DRAFT_MODEL_NAME, builtin_model_path
from llmlab.builtin.stories import stories

METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
    "draft_model": {"model": DRAFT_MODEL_NAME},
}


_DRAFTS: dict[tuple[int, int], list[str]] = {}


def _fixed_point_drafts(firsts: list[str], rounds: int = 6) -> list[str]:
    """Per opening, a text the model writes again when the prompt holds it: start from the
    model's story, then replace each draft by what the model writes with it in the
    prompt, until nothing changes (most openings settle within a few rounds)."""
    plain = LLM(str(builtin_model_path()), max_model_len=512, seed=0)
    greedy = SamplingParams(max_tokens=96, temperature=0.0)
    drafts = [o.outputs[0].text for o in plain.generate(firsts, greedy, use_tqdm=False)]
    for _ in range(rounds):
        prompts = [f"{f}{d}\n\n{f}" for f, d in zip(firsts, drafts, strict=True)]
        again = [o.outputs[0].text for o in plain.generate(prompts, greedy, use_tqdm=False)]
        if again == drafts:
            break
        drafts = again
    return drafts


def workload(kind: str, n: int, seed: int = 0) -> tuple[list[str], list[SamplingParams]]:
    firsts = [t.split(". ")[0] + "." for t in stories(n, seed=seed)]
    if kind == "copy":
        # An edit task: the prompt holds a draft of the text (here the model's own story
        # from this opening) and asks for it again from the same opening.
        key = (n, seed)
        if key not in _DRAFTS:
            _DRAFTS[key] = _fixed_point_drafts(firsts)
        prompts = [f"{f}{d}\n\n{f}" for f, d in zip(firsts, _DRAFTS[key], strict=True)]
        params = [SamplingParams(max_tokens=96, temperature=0.0) for _ in firsts]
    else:
        prompts = firsts
        params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i) for i in range(n)]
    return prompts, params


def run(method: str, kind: str, concurrency: int, length: str, k: int, per_slot: int,
        cold: bool = False) -> dict:
    config = METHODS[method]
    if config is not None:
        config = config | {"num_speculative_tokens": k, "speculation_length": length}
    llm = LLM(str(builtin_model_path()), max_num_seqs=concurrency, speculative_config=config,
              max_model_len=512, seed=0)
    # Warm-up on requests of the same shape from another seed: one-time costs are not
    # timed, and the adaptive length starts from what it learned there, as a serving
    # engine would after its first minutes (``--cold`` times a fresh engine instead).
    warm_prompts, warm_params = workload(kind, 4 if cold else concurrency * per_slot, seed=99)
    llm.generate(warm_prompts, warm_params, use_tqdm=False)
    prompts, params = workload(kind, concurrency * per_slot, seed=1)
    events = []
    llm.llm_engine.subscribe(events.append)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts = [(d, a) for e in events for _, d, a in e.speculated]
    num_drafts = len(drafts)
    drafted = sum(d for d, _ in drafts)
    accepted = sum(a for _, a in drafts)
    per_pos = []
    for j in range(1, k + 1):
        reached = sum(1 for d, _ in drafts if d >= j)
        per_pos.append(sum(1 for d, a in drafts if d >= j and a >= j) / reached if reached else 0)
    return {
        "tok_s": tokens / elapsed,
        "tokens": tokens,
        "mean_len": 1 + accepted / num_drafts if num_drafts else float("nan"),
        "rate": accepted / drafted if drafted else float("nan"),
        "per_pos": per_pos,
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="copy,free")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--length", default="adaptive", choices=("adaptive", "fixed"))
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cold", action="store_true",
                        help="warm up on 4 short requests only: the adaptive length starts "
                        "from nothing in the timed run")
    parser.add_argument("--requests-per-slot", type=int, default=4,
                        help="requests queued per concurrent slot (the queue keeps every "
                        "slot busy, so one slow request does not decide the time)")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if methods[0] != "off":
        methods = ["off", *[m for m in methods if m != "off"]]
    print(f"length={args.length} k={args.k} repeats={args.repeats}")
    print(f"{'workload':8} {'conc':>4} {'method':12} {'tok/s':>8} {'vs off':>7} "
          f"{'mean len':>8} {'accept':>6}  per-position")
    order = random.Random(0)
    for kind in args.workloads.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                shuffled = methods[:]
                order.shuffle(shuffled)
                for method in shuffled:
                    result = run(method, kind, concurrency, args.length, args.k,
                                 args.requests_per_slot, args.cold)
                    if method not in best or result["tok_s"] > best[method]["tok_s"]:
                        best[method] = result
            base = best["off"]
            for method in methods:
                r = best[method]
                same = "" if kind == "free" or r["outputs"] == base["outputs"] else "  DIFFERS"
                pos = " ".join(f"{p:.2f}" for p in r["per_pos"]) if method != "off" else ""
                print(f"{kind:8} {concurrency:4d} {method:12} {r['tok_s']:8.1f} "
                      f"{r['tok_s'] / base['tok_s']:6.2f}x {r['mean_len']:8.2f} "
                      f"{r['rate']:6.2f}  {pos}{same}", flush=True)


if __name__ == "__main__":
    main()
