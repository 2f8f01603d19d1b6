"""KV presses: what compressing a request's KV cache costs in quality and buys in memory.

After a request's prompt is computed, an engine built with ``kv_press=...`` keeps only a
fraction of its cached tokens per layer and KV head (chosen by the press) and frees the
blocks (:mod:`llmlab.kvpress`). For every press and compression ratio (the fraction
dropped: 0.25, 0.5, 0.75, i.e. ``kv_budget`` 0.75, 0.5, 0.25 per request; ratio 0 too, which
must change nothing) this measures, against the uncompressed engine on the same model and
prompts, in the same process:

1. Quality, teacher-forced. The uncompressed engine's greedy continuation is the reference;
   the compressed engine is run with a per-request logits processor that records
   ``log_softmax(logits)[reference]`` and whether the argmax is the reference, then forces
   the reference token. Reported: agreement (fraction of argmaxes equal to the reference)
   and the perplexity of the reference over the uncompressed engine's own. The first output
   token is left out of both: it is sampled from the prompt's forward pass, before the
   compaction, so no press can change it. Two models:

   * ``stories``: llmlab's built-in ``llmlab-stories`` (512 positions), prompts of a few
     hundred tokens of its own stories;
   * ``needle``: the tiny long-context model of ``benchmarks/assets/needle-llama``
     (:mod:`benchmarks.kvpress_model`), long prompts whose end repeats the start of a span
     from early in the context: the reference continues the copy, so it needs that span.

2. Needle retrieval (needle model): a long context with four ``KEY kI tJ`` needles at
   spread depths; the answer is the needle's value ``tJ``, scored as the argmax after the
   question ``ASK kI``, teacher-forced. Two variants:

   * *question after compression* (``after``): the prompt is the context alone; after its
     compaction the question is forced token by token and the next token is scored. The
     press never sees the question (query-agnostic, as when a cached document serves later
     questions).
   * *question known at compression* (``known``): the prompt ends with the question, so a
     query-aware press (snapkv, tova, h2o) chooses what to keep with the question's queries
     in its window. The first output comes from the uncompressed prefill and is not scored:
     it is forced to ``ASK``, the question asked again token by token, and the token after
     ``ASK kI``, predicted from the compressed cache, is scored. The forced tokens are the
     same as in ``after``; only the prompt differs. (Forcing the answer first would leave a
     copy of it in the uncompressed tail: with the needle masked out of the context,
     transformers still answers 78% of the repeated question. A filler token there instead
     becomes a second value of ``kI`` to copy: knorm, which does not read queries, fell from
     0.28 to 0.09 at ratio 0.25.)

3. Memory and throughput at a fixed KV pool (needle model): N long-prompt requests with
   moderate outputs in a pool that holds a few of them uncompressed, at the engine's default
   step budget (2,048 new tokens on CPU: two prompts a step). Reported per press and ratio:
   peak concurrently running requests and peak KV usage (``StepEvent``), compactions and the
   blocks they freed (``StepEvent.kv_compacted``), preemptions, output tokens/s (the fastest
   of ``pool_repeats`` rounds over every configuration, with the slowest / fastest spread)
   and the ratios over no press. This part used to need one prompt per step, or the
   admissions took every free block and no compaction found fresh ones; now a running
   request's compaction reserves its blocks before the step's admissions, and in a full
   pool a request alone on its blocks compacts in place (:mod:`llmlab.kvpress.schedule`).
   Run both ways, the default budget and ``--pool-batched-tokens 1024`` compact every
   request and free the same blocks, with the same peak running (1.25x to 3.25x no
   press's), so the default is kept.

``--plot out.png`` draws agreement (both models) and needle accuracy (both variants)
against the compression ratio, one line per press. ``--json out.json`` writes every number.
``--quick`` (two presses, one ratio, few and shorter prompts) is the smoke run the tests use.

Run: ``python -m benchmarks.kv_press [--quick] [--presses snapkv,knorm] [--ratios 0.5]
[--press-config streaming_llm='{"window": 64}'] [--parts stories,needle,pool]
[--pool-batched-tokens 1024] [--plot out.png] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import random
import time
from collections.abc import Sequence

import attrs
import torch

from benchmarks import kvpress_model as needle
from llmlab import LLM, SamplingParams

PRESSES = ("streaming_llm", "h2o", "snapkv", "tova", "knorm", "random", "pyramid")
RATIOS = (0.25, 0.5, 0.75)
QUICK_PRESSES = ("streaming_llm", "snapkv")
QUICK_RATIOS = (0.5,)
BLOCK_SIZE = 16


@attrs.frozen
class Settings:
    """Workload sizes (the defaults are the full run; :data:`QUICK` the smoke run)."""

    story_prompts: int = 32
    story_prompt_len: int = 320
    story_tokens: int = 64  # reference tokens per story prompt
    copy_prompts: int = 24
    copy_prompt_len: int = 1536
    copy_span: int = 48
    copy_shown: int = 8  # span tokens the prompt repeats; the reference copies the rest
    needle_prompts: int = 64
    needle_prompt_len: int = 1536
    pool_requests: int = 16
    pool_prompt_len: int = 1024
    pool_output_len: int = 64
    pool_room: int = 4  # the pool holds this many uncompressed requests
    pool_repeats: int = 3  # timed rounds over every press and ratio (the fastest counts)


QUICK = Settings(
    story_prompts=2, story_prompt_len=128, story_tokens=16,
    copy_prompts=2, copy_prompt_len=384, copy_span=24,
    needle_prompts=4, needle_prompt_len=384,
    pool_requests=6, pool_prompt_len=256, pool_output_len=16, pool_room=2, pool_repeats=1,
)


# ---------------------------------------------------------------------------- teacher forcing


@attrs.define(eq=False)
class TeacherForcing:
    """A logits processor that scores the model against ``reference`` and forces it.

    At output step ``i`` it records the log-probability of ``reference[i]`` and whether it
    is the argmax, then masks every other token, so the request continues exactly as the
    reference did. Records are keyed by step, so a step computed again (after a preemption)
    overwrites rather than duplicates.
    """

    reference: tuple[int, ...]
    logprobs: dict[int, float] = attrs.field(factory=dict)
    agreed: dict[int, bool] = attrs.field(factory=dict)

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(output_token_ids)
        target = self.reference[step]
        logits = logits.float()
        self.logprobs[step] = float(torch.log_softmax(logits, dim=-1)[target])
        self.agreed[step] = int(torch.argmax(logits)) == target
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0.0
        return forced

    def scored(self, first: int) -> list[int]:
        """The steps from ``first`` on, checked complete."""
        steps = list(range(first, len(self.reference)))
        missing = [s for s in steps if s not in self.logprobs]
        if missing:
            raise AssertionError(f"the logits processor never saw steps {missing}")
        return steps


def forced_run(
    llm: LLM, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
    budgets: Sequence[float | None],
) -> list[TeacherForcing]:
    """Run every (prompt, reference, kept fraction) once, in one batch; their processors."""
    processors, params = [], []
    for reference, budget in zip(references, budgets, strict=True):
        processor = TeacherForcing(tuple(reference))
        processors.append(processor)
        params.append(SamplingParams(
            temperature=0.0, max_tokens=len(reference), ignore_eos=True,
            logits_processors=[processor],
            extra_args=None if budget is None else {"kv_budget": budget},
        ))
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    for output, reference in zip(outputs, references, strict=True):
        if list(output.outputs[0].token_ids) != list(reference):
            raise AssertionError("a forced run left its reference")
    return processors


def greedy(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@attrs.frozen
class Quality:
    agreement: float
    perplexity: float
    num_tokens: int

    @classmethod
    def of(cls, processors: Sequence[TeacherForcing], first: int = 1) -> Quality:
        """Pooled over every scored token of ``processors`` (steps ``first`` on)."""
        nll, agreed, n = 0.0, 0, 0
        for p in processors:
            for step in p.scored(first):
                nll -= p.logprobs[step]
                agreed += p.agreed[step]
                n += 1
        return cls(agreement=agreed / n, perplexity=math.exp(nll / n), num_tokens=n)


# ---------------------------------------------------------------------------- workloads


def story_prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens of built-in stories (``<s> story </s>`` ...,
    as the model was trained), each from its own seed, cut mid-story."""
    from llmlab.builtin.stories import story

    prompts = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(story(rng)) + [tokenizer.eos_token_id]
        prompts.append(ids[:length])
    return prompts


def copy_prompts(settings: Settings, seed: int = 10) -> list[list[int]]:
    """Needle-model prompts ending in the start of a repeat of a span at spread depths."""
    rng = random.Random(seed)
    n = settings.copy_prompts
    return [
        needle.copy_prompt(rng, settings.copy_prompt_len, settings.copy_span,
                           depth=0.05 + 0.5 * i / max(1, n - 1),
                           shown=settings.copy_shown).token_ids
        for i in range(n)
    ]


def needle_questions(settings: Settings, seed: int = 20) -> list[needle.NeedlePrompt]:
    rng = random.Random(seed)
    n = settings.needle_prompts
    return [needle.needle_prompt(rng, settings.needle_prompt_len, depth=(i + 0.5) / n)
            for i in range(n)]


# The needle variants (module docstring, part 2), in report order.
VARIANTS = {
    "after": "question after compression",
    "known": "question known at compression",
}


def needle_runs(
    needles: Sequence[needle.NeedlePrompt], variant: str
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, references) of one variant. The references are the same in both: the
    question ``ASK kI`` (forced; its first token is the unscored first output), then the
    answer, scored. Only the prompt differs: the context alone, or the context and the
    question (asked again after the compaction)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    cut = -2 if variant == "after" else None
    return ([n.token_ids[:cut] for n in needles],
            [n.token_ids[-2:] + [n.answer_id] for n in needles])


# ---------------------------------------------------------------------------- engines


def engine_kwargs(args, num_blocks: int, max_model_len: int, max_num_seqs: int) -> dict:
    """A fixed pool (``num_gpu_blocks_override``) so CPU and GPU runs hold the same cache and
    several engines fit a device together."""
    return dict(
        dtype="float32", device=args.device, seed=0, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=num_blocks, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, cpu_threads=args.threads,
    )


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def press_engine(model: str, press: str | None, args, **kwargs) -> LLM:
    if press is None:
        return LLM(model, **kwargs)
    config = dict(args.press_config.get(press, {}))
    return LLM(model, kv_press=press, kv_press_config=config or None, **kwargs)


def free_memory() -> None:
    """Collect a dropped engine now, so the next one's pool does not sit beside it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def budget_of(ratio: float) -> float:
    """The per-request kept fraction of a compression ratio."""
    return round(1.0 - ratio, 6)


# ---------------------------------------------------------------------------- part 1 and 2


def quality_sweep(
    name: str, model: str, prompts: list[list[int]], num_tokens: int, args,
    needles: list[needle.NeedlePrompt] | None = None,
) -> tuple[dict, list[dict], list[dict]]:
    """Baseline, then every press at every ratio (one engine per press, the ratios as
    per-request budgets in one batch). Returns (baseline, quality rows, needle rows: one
    per press, ratio and variant)."""
    # Each run is the quality prompts, then each needle variant's prompts, in that order.
    groups: list[tuple[str, list[list[int]], list[list[int]]]] = []
    for variant in VARIANTS if needles else ():
        groups.append((variant, *needle_runs(needles, variant)))
    run_prompts = prompts + [p for _, ps, _ in groups for p in ps]
    rows_per_run = len(run_prompts)
    longest_ref = max([num_tokens] + [len(r) for _, _, refs in groups for r in refs])
    max_len = max(len(p) for p in run_prompts) + longest_ref
    # Room for every request of the largest batch at once, plus the compaction targets.
    num_blocks = 2 * (len(args.ratios) + 1) * rows_per_run * blocks_for(max_len) + 8
    kwargs = engine_kwargs(args, num_blocks, max_len, (len(args.ratios) + 1) * rows_per_run)

    llm = press_engine(model, None, args, **kwargs)
    references = greedy(llm, prompts, num_tokens)
    run_refs = references + [r for _, _, refs in groups for r in refs]
    base_processors = forced_run(llm, run_prompts, run_refs, [None] * rows_per_run)
    del llm
    free_memory()

    def split(chunk: list[TeacherForcing]) -> dict[str, list[TeacherForcing]]:
        """One run's processors by group: ``"quality"``, then each variant."""
        parts, at = {"quality": chunk[: len(prompts)]}, len(prompts)
        for variant, ps, _ in groups:
            parts[variant], at = chunk[at : at + len(ps)], at + len(ps)
        return parts

    base_parts = split(base_processors)
    base = Quality.of(base_parts["quality"])
    baseline = {"model": name, "agreement": base.agreement, "perplexity": base.perplexity,
                "num_tokens": base.num_tokens}
    if needles:
        baseline["needle_accuracy"] = {v: needle_accuracy(base_parts[v]) for v, _, _ in groups}
    print(f"  {name}: baseline perplexity {base.perplexity:.4f} over {base.num_tokens} "
          f"tokens, self-agreement {base.agreement:.3f}"
          + "".join(f", needle accuracy ({v}) {a:.3f}"
                    for v, a in baseline.get("needle_accuracy", {}).items()),
          flush=True)

    ratios = [0.0, *args.ratios]
    quality_rows, needle_rows = [], []
    for press in args.presses:
        start = time.perf_counter()
        llm = press_engine(model, press, args, **kwargs)
        budgets = [budget_of(r) for r in ratios for _ in range(rows_per_run)]
        processors = forced_run(llm, run_prompts * len(ratios), run_refs * len(ratios), budgets)
        del llm
        free_memory()
        for k, ratio in enumerate(ratios):
            parts = split(processors[k * rows_per_run : (k + 1) * rows_per_run])
            q = Quality.of(parts["quality"])
            quality_rows.append({
                "model": name, "press": press, "compression_ratio": ratio,
                "kv_budget": budget_of(ratio), "agreement": q.agreement,
                "perplexity": q.perplexity, "perplexity_ratio": q.perplexity / base.perplexity,
                "num_tokens": q.num_tokens,
            })
            for variant, _, _ in groups:
                needle_rows.append({
                    "variant": variant, "press": press, "compression_ratio": ratio,
                    "kv_budget": budget_of(ratio), "accuracy": needle_accuracy(parts[variant]),
                })
        print(f"  {name}: {press} done in {time.perf_counter() - start:.1f} s", flush=True)
    return baseline, quality_rows, needle_rows


def needle_accuracy(processors: Sequence[TeacherForcing]) -> float:
    """Fraction of questions whose answer (the last forced step) was the argmax."""
    hits = [p.agreed[len(p.reference) - 1] for p in processors]
    return sum(hits) / len(hits)


# ---------------------------------------------------------------------------- part 3


def pool_prompts(settings: Settings, seed: int) -> list[list[int]]:
    """``pool_requests`` prompts of ``<s>`` and random filler (no shared prefix)."""
    rng = random.Random(seed)
    return [[needle.BOS_ID] + [needle.FIRST_FILLER_ID + rng.randrange(needle.NUM_FILLER)
                               for _ in range(settings.pool_prompt_len - 1)]
            for _ in range(settings.pool_requests)]


def pool_engine(model: str, press: str | None, ratio: float, args) -> tuple[LLM, SamplingParams]:
    """An engine whose pool holds ``pool_room`` uncompressed requests, warmed up, and the
    sampling parameters of its requests."""
    s = args.settings
    per_request = blocks_for(s.pool_prompt_len + s.pool_output_len)
    kwargs = engine_kwargs(args, s.pool_room * per_request + 2,
                           s.pool_prompt_len + s.pool_output_len, s.pool_requests)
    # The engine's default step budget unless asked (see the module docstring, part 3).
    if args.pool_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.pool_batched_tokens
    llm = press_engine(model, press, args, **kwargs)
    extra = None if press is None else {"kv_budget": budget_of(ratio)}
    # Warm-up outside the measurement (first-call costs), on other prompts.
    llm.generate([{"prompt_token_ids": p[::-1]} for p in pool_prompts(s, 29)[:2]],
                 SamplingParams(max_tokens=2, extra_args=extra), use_tqdm=False)
    return llm, SamplingParams(temperature=0.0, max_tokens=s.pool_output_len, ignore_eos=True,
                               extra_args=extra)


def timed_pool_run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, int, dict]:
    """(seconds, output tokens, what the step events said) of one run of ``prompts``."""
    seen = {"peak_running": 0, "peak_kv_usage": 0.0, "compactions": 0, "press_errors": 0,
            "blocks_freed_by_compaction": 0, "tokens_dropped": 0, "preemptions": 0}

    def observe(event) -> None:
        seen["peak_running"] = max(seen["peak_running"], event.num_running)
        seen["peak_kv_usage"] = max(seen["peak_kv_usage"], event.kv_usage)
        seen["preemptions"] += len(event.preempted)
        for c in getattr(event, "kv_compacted", ()):
            if c.error is not None:
                seen["press_errors"] += 1
                continue
            seen["compactions"] += 1
            seen["tokens_dropped"] += c.tokens_dropped
            seen["blocks_freed_by_compaction"] += (
                blocks_for(max(c.before, default=0)) - blocks_for(max(c.kept, default=0))
            )

    engine = llm.llm_engine
    engine.subscribe(observe)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    engine.unsubscribe(observe)
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), seen


def pool_part(model: str, runs: Sequence[tuple[str | None, float]], args) -> list[dict]:
    """N long-prompt requests through a pool that holds ``pool_room`` of them uncompressed,
    per (press, ratio) of ``runs``; what the step events say about each.

    Timed ``pool_repeats`` times on fresh prompts (no prefix hits), the fastest kept, and in
    rounds (every engine once, then again), so that a busy spell on a shared machine slows
    one sample of each configuration rather than every sample of one: a run lasts seconds.
    """
    s = args.settings
    engines = [pool_engine(model, press, ratio, args) for press, ratio in runs]
    timings: list[list[float]] = [[] for _ in runs]
    counters: list[dict] = [{} for _ in runs]
    num_out = [0] * len(runs)
    for repeat in range(s.pool_repeats):
        prompts = pool_prompts(s, 30 + repeat)
        for i, (llm, params) in enumerate(engines):
            seconds, num_out[i], seen = timed_pool_run(llm, prompts, params)
            timings[i].append(seconds)
            # Every repeat has the same lengths, so the same schedule: the first's counts.
            counters[i] = counters[i] or seen
    rows = []
    for (press, ratio), (llm, _), times, num, seen in zip(
        runs, engines, timings, num_out, counters, strict=True
    ):
        rows.append({
            "press": press or "none", "compression_ratio": ratio if press else 0.0,
            "num_blocks": llm.llm_engine.config.num_gpu_blocks_override,
            "max_num_batched_tokens": llm.llm_engine.config.max_num_batched_tokens,
            "seconds": min(times), "seconds_per_repeat": times,
            "output_tok_s": num / min(times), **seen,
        })
    del engines, llm
    free_memory()
    return rows


# ---------------------------------------------------------------------------- report


def print_quality(rows: list[dict], baselines: list[dict], ratios: Sequence[float]) -> None:
    for base in baselines:
        name = base["model"]
        print(f"\nquality on {name}: agreement with the uncompressed greedy continuation / "
              f"perplexity ratio (baseline perplexity {base['perplexity']:.4f}, "
              f"{base['num_tokens']} scored tokens)")
        head = "".join(f" {'agree@' + str(r):>11}" for r in ratios)
        head += "".join(f" {'ppl x@' + str(r):>11}" for r in ratios)
        print(f"{'press':<14}{head}")
        for press in dict.fromkeys(r["press"] for r in rows if r["model"] == name):
            cells = {r["compression_ratio"]: r for r in rows
                     if r["model"] == name and r["press"] == press}
            line = "".join(f" {cells[r]['agreement']:>11.3f}" for r in ratios)
            line += "".join(f" {cells[r]['perplexity_ratio']:>10.3f}x" for r in ratios)
            print(f"{press:<14}{line}")


def print_needles(rows: list[dict], baselines: dict[str, float], ratios: Sequence[float]) -> None:
    for variant, title in VARIANTS.items():
        chosen = [r for r in rows if r["variant"] == variant]
        if not chosen:
            continue
        print(f"\nneedle retrieval ({title}; uncompressed: {baselines[variant]:.3f})")
        print(f"{'press':<14}" + "".join(f" {'acc@' + str(r):>9}" for r in ratios))
        for press in dict.fromkeys(r["press"] for r in chosen):
            cells = {r["compression_ratio"]: r["accuracy"] for r in chosen
                     if r["press"] == press}
            print(f"{press:<14}" + "".join(f" {cells[r]:>9.3f}" for r in ratios))


def print_pool(rows: list[dict]) -> None:
    base = rows[0]
    print(f"\nfixed pool of {base['num_blocks']} blocks, {base['max_num_batched_tokens']} new "
          "tokens per step: output tok/s (the fastest round; spread: slowest / fastest) and "
          "peak running vs no press")
    print(f"{'press':<14} {'ratio':>5} {'tok/s':>8} {'x':>6} {'peak run':>8} {'x':>6} "
          f"{'peak kv':>7} {'compact':>7} {'freed blk':>9} {'preempt':>7} {'errors':>6} "
          f"{'spread':>6}")
    for r in rows:
        print(f"{r['press']:<14} {r['compression_ratio']:>5} {r['output_tok_s']:>8.1f} "
              f"{r['output_tok_s'] / base['output_tok_s']:>5.2f}x {r['peak_running']:>8} "
              f"{r['peak_running'] / base['peak_running']:>5.2f}x {r['peak_kv_usage']:>7.2f} "
              f"{r['compactions']:>7} {r['blocks_freed_by_compaction']:>9} "
              f"{r['preemptions']:>7} {r['press_errors']:>6} "
              f"{max(r['seconds_per_repeat']) / r['seconds']:>5.2f}x")


PANEL_TITLES = {
    "stories": "llmlab-stories: story continuation",
    "needle": "needle-llama: span copy",
    **{variant: f"needle retrieval: {title}" for variant, title in VARIANTS.items()},
}


def plot(path: pathlib.Path, rows: list[dict], needle_rows: list[dict], baselines: list[dict],
         needle_base: dict[str, float] | None) -> None:
    """Agreement per model, then needle accuracy per variant, against the compression ratio;
    one line per press (a small PNG: 100 dpi)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(b["model"], "agreement", [r for r in rows if r["model"] == b["model"]])
              for b in baselines]
    panels += [(v, "accuracy", [r for r in needle_rows if r["variant"] == v])
               for v in VARIANTS if any(r["variant"] == v for r in needle_rows)]
    columns = min(2, len(panels))
    lines = -(-len(panels) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.6 * lines), squeeze=False)
    for ax, (title, metric, source) in zip(axes.flat, panels):
        for press in dict.fromkeys(r["press"] for r in source):
            points = sorted((r["compression_ratio"], r[metric]) for r in source
                            if r["press"] == press)
            ax.plot(*zip(*points), marker="o", markersize=3, label=press)
        if metric == "accuracy" and needle_base:
            ax.axhline(needle_base[title], color="grey", linestyle=":", label="no press")
        ax.set_title(PANEL_TITLES.get(title, title), fontsize=10)
        ax.set_xlabel("compression ratio (fraction of the KV dropped)", fontsize=9)
        ax.set_ylabel(metric, fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def _press_config(values: Sequence[str]) -> dict[str, dict]:
    configs = {}
    for value in values:
        press, sep, text = value.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--press-config wants PRESS=JSON, got {value!r}")
        configs[press] = json.loads(text)
    return configs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_PRESSES)} at ratio {QUICK_RATIOS[0]}, few and "
                             "shorter prompts (the test's smoke run)")
    parser.add_argument("--presses", default=None, help="comma-separated (default: all)")
    parser.add_argument("--ratios", default=None,
                        help="compression ratios, comma-separated (default 0.25,0.5,0.75; "
                             "ratio 0 always runs as the identity check)")
    parser.add_argument("--press-config", action="append", default=[], metavar="PRESS=JSON",
                        help="keyword arguments for one press, e.g. "
                             "streaming_llm='{\"window\": 64}'")
    parser.add_argument("--parts", default="stories,needle,pool",
                        help="which parts to run (comma-separated)")
    parser.add_argument("--needle-model", default=str(needle.DEFAULT_OUT))
    parser.add_argument("--pool-batched-tokens", type=int, default=None, metavar="N",
                        help="max_num_batched_tokens of the pool part (default: the "
                             "engine's; the pool prompt length admits one prompt per step)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--plot", type=pathlib.Path, help="write the quality plot (PNG) here")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.settings = QUICK if args.quick else Settings()
    default_presses, default_ratios = (QUICK_PRESSES, QUICK_RATIOS) if args.quick else (
        PRESSES, RATIOS)
    args.presses = args.presses.split(",") if args.presses else list(default_presses)
    args.ratios = ([float(r) for r in args.ratios.split(",")] if args.ratios
                   else list(default_ratios))
    args.ratios = [r for r in args.ratios if r != 0.0]
    args.parts = set(args.parts.split(","))
    args.press_config = _press_config(args.press_config)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from llmlab.builtin import ensure_builtin_model

    s = args.settings
    stories_model = str(ensure_builtin_model())
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs; presses "
          f"{', '.join(args.presses)}; compression ratios {args.ratios} (and 0)", flush=True)
    start = time.perf_counter()
    results: dict = {"settings": attrs.asdict(s), "presses": args.presses,
                     "ratios": [0.0, *args.ratios], "press_config": args.press_config,
                     "needle_variants": VARIANTS, "baselines": [], "quality": [], "needle": [],
                     "pool": []}
    if "stories" in args.parts:
        tokenizer = AutoTokenizer.from_pretrained(stories_model)
        prompts = story_prompts(tokenizer, s.story_prompts, s.story_prompt_len)
        base, rows, _ = quality_sweep("stories", stories_model, prompts, s.story_tokens, args)
        results["baselines"].append(base)
        results["quality"] += rows
    if "needle" in args.parts:
        base, rows, needle_rows = quality_sweep(
            "needle", args.needle_model, copy_prompts(s), s.copy_span - s.copy_shown, args,
            needles=needle_questions(s),
        )
        results["baselines"].append(base)
        results["quality"] += rows
        results["needle"] = needle_rows  # both variants (each row's "variant")
        results["needle_baseline"] = base["needle_accuracy"]  # per variant
    if "pool" in args.parts:
        runs = [(None, 0.0)] + [(p, r) for p in args.presses for r in args.ratios]
        results["pool"] = pool_part(args.needle_model, runs, args)
        print(f"  pool runs done ({len(runs)} configurations, {s.pool_repeats} rounds)",
              flush=True)

    ratios = results["ratios"]
    if results["quality"]:
        print_quality(results["quality"], results["baselines"], ratios)
    if results["needle"]:
        print_needles(results["needle"], results["needle_baseline"], ratios)
    if results["pool"]:
        print_pool(results["pool"])
    results["seconds"] = time.perf_counter() - start
    print(f"\ntotal {results['seconds']:.0f} s")
    if args.plot is not None and results["quality"]:
        plot(args.plot, results["quality"], results["needle"], results["baselines"],
             results.get("needle_baseline"))
        print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
