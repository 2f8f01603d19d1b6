"""Per-step host cost of the batched sampler and of incremental detokenization.

Sampler: one ``Sampler()(logits, requests, generator)`` call on random float32 logits
``[batch, vocab]``, for five parameter mixes:

  a  all greedy
  b  all temperature 0.8, top_p 0.9, top_k 50
  c  b + repetition 1.1, frequency 0.5, presence 0.5 (512 prompt + 256 output tokens each)
  d  b + logprobs=5
  e  heterogeneous: every request draws its own parameters (greedy or not, temperature,
     top_k, top_p, min_p, penalties, logprobs); every other request is seeded

Baselines, in the same process, on the same logits:

* ``hf``: Hugging Face ``LogitsProcessorList`` of RepetitionPenaltyLogitsProcessor,
  TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, then ``torch.multinomial``
  of the softmax (greedy: argmax; mix d adds ``log_softmax`` and a top-5). It applies ONE
  parameter set to the whole batch, so it cannot serve mix e (``n/a``), and HF has no
  frequency or presence penalty, so in mix c it does less work than llmlab. Its
  ``input_ids`` tensor (prompt + output) is built before timing, as ``generate`` keeps it.
  llmlab also always computes the raw ``log_softmax`` (the chosen token's logprob); the
  hf baseline does not, except in mix d.
* ``loop``: the same llmlab sampler called once per request (``logits[i:i+1]``,
  ``[request]``): the per-request Python loop that batching avoids.

Each cell is timed with the methods interleaved (one call of each per round, so load drift
hits all alike) after one warm-up call each; the median of the rounds is reported, with at
least 3 rounds and more while the cell's time budget lasts. ``x_hf`` and ``x_loop`` are
baseline time / llmlab time (higher: llmlab is faster). A second table splits llmlab's step
by processor (each wrapped in a timer) at batch 64 x the largest vocabulary.

Detokenizer: streaming a 2,000-token output (the tiny Llama tokenizer, byte-level BPE, on
its corpus text) one token per step, reporting the new text each step, with
:class:`~llmlab.engine.detokenizer.IncrementalDetokenizer` against re-decoding the whole
output every step (``tokenizer.decode(output_ids)``, what the engine did before) and
``tokenizers.decoders.DecodeStream``; with no stop strings and with two (which never
match, so all 2,000 tokens stream). All three must produce the same text.

Run: ``python -m benchmarks.sampling [--quick] [--batch-sizes 1 16 64 256]
[--vocabs 32000 151936] [--mixes a b c d e]``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import pathlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from llmlab.engine.detokenizer import IncrementalDetokenizer
from llmlab.request import Request
from llmlab.sampling.params import SamplingParams
from llmlab.sampling.sampler import Sampler

PROMPT_LEN = 512
OUTPUT_LEN = 256
MIXES = {
    "a": "greedy",
    "b": "t0.8 p0.9 k50",
    "c": "b + rep/freq/pres",
    "d": "b + logprobs=5",
    "e": "heterogeneous",
}
STOP_STRINGS = ("\n\n", "User:")


# -- sampler ---------------------------------------------------------------------------------


def mix_params(mix: str, i: int) -> dict:
    """Sampling parameters of request ``i`` in ``mix``."""
    b = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}
    if mix == "a":
        return {"temperature": 0.0}
    if mix == "b":
        return b
    if mix == "c":
        return dict(b, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
    if mix == "d":
        return dict(b, logprobs=5)
    rng = random.Random(i)
    return {
        "temperature": rng.choice([0.0, 0.5, 0.7, 0.8, 1.0, 1.2]),
        "top_p": rng.choice([1.0, 0.8, 0.9, 0.95]),
        "top_k": rng.choice([0, 20, 50, 200]),
        "min_p": rng.choice([0.0, 0.0, 0.05]),
        "repetition_penalty": rng.choice([1.0, 1.0, 1.1, 1.2]),
        "frequency_penalty": rng.choice([0.0, 0.0, 0.3]),
        "presence_penalty": rng.choice([0.0, 0.0, 0.5]),
        "logprobs": rng.choice([None, None, 1, 5]),
        "seed": i if i % 2 == 0 else None,
    }


def make_requests(mix: str, batch: int, vocab: int, seed: int = 0) -> list[Request]:
    """``batch`` requests with 512 prompt and 256 output tokens of history each."""
    rng = random.Random(seed)
    requests = []
    for i in range(batch):
        requests.append(
            Request(
                request_id=f"{mix}{i}",
                prompt_token_ids=[rng.randrange(2, vocab) for _ in range(PROMPT_LEN)],
                sampling_params=SamplingParams(max_tokens=4096, **mix_params(mix, i)),
                arrival_time=0.0,
                output_token_ids=[rng.randrange(2, vocab) for _ in range(OUTPUT_LEN)],
            )
        )
    return requests


def hf_step(mix: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Generator], list[int]] | None:
    """The Hugging Face baseline for a homogeneous mix (None for the heterogeneous one)."""
    from transformers.generation import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if mix == "e":
        return None
    if mix == "a":
        return lambda input_ids, logits, generator: logits.argmax(dim=-1).tolist()
    processors = LogitsProcessorList(
        ([RepetitionPenaltyLogitsProcessor(1.1)] if mix == "c" else [])
        + [TemperatureLogitsWarper(0.8), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]
    )

    def step(input_ids: torch.Tensor, logits: torch.Tensor, generator: torch.Generator):
        scores = processors(input_ids, logits)
        probs = torch.softmax(scores, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator)
        if mix == "d":
            raw = torch.log_softmax(logits, dim=-1)
            top = raw.topk(5, dim=-1)
            chosen = raw.gather(1, tokens)
            _ = top.values.tolist(), top.indices.tolist(), chosen.tolist()
        return tokens[:, 0].tolist()

    return step


def time_interleaved(
    fns: dict[str, Callable[[], object]], min_rounds: int, max_rounds: int, budget_s: float
) -> dict[str, float]:
    """Median seconds per call of each function, the functions called in turn each round."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (
        rounds < min_rounds or time.perf_counter() - start < budget_s
    ):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


def bench_sampler(args: argparse.Namespace) -> None:
    print(f"sampler: ms per step, float32 random logits, {PROMPT_LEN}+{OUTPUT_LEN} tokens of "
          "history per request;")
    print("x_hf = hf / llmlab, x_loop = loop / llmlab (higher: llmlab is faster)\n")
    header = (f"{'mix':>3} {'params':>18} {'batch':>5} {'vocab':>7} {'llmlab':>9} "
              f"{'hf':>9} {'x_hf':>5} {'loop':>9} {'x_loop':>6}")
    print(header)
    sampler = Sampler()
    for mix in args.mixes:
        hf = hf_step(mix)
        for vocab in args.vocabs:
            for batch in args.batch_sizes:
                t = measure_cell(sampler, hf, mix, batch, vocab, args)
                ms = {k: v * 1e3 for k, v in t.items()}
                hf_cells = (f"{ms['hf']:>9.2f} {t['hf'] / t['llmlab']:>5.2f}" if "hf" in t
                            else f"{'n/a':>9} {'':>5}")
                print(f"{mix:>3} {MIXES[mix]:>18} {batch:>5} {vocab:>7} {ms['llmlab']:>9.2f} "
                      f"{hf_cells} {ms['loop']:>9.2f} {t['loop'] / t['llmlab']:>6.2f}",
                      flush=True)


def measure_cell(
    sampler: Sampler, hf, mix: str, batch: int, vocab: int, args: argparse.Namespace
) -> dict[str, float]:
    """Median seconds per step of llmlab, the per-request loop and (if any) hf."""
    requests = make_requests(mix, batch, vocab)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1))
    input_ids = torch.tensor([r.prompt_token_ids + r.output_token_ids for r in requests])
    gen_llmlab = torch.Generator().manual_seed(0)
    gen_hf = torch.Generator().manual_seed(0)

    def loop() -> None:
        for i, r in enumerate(requests):
            sampler(logits[i : i + 1], [r], gen_llmlab)

    fns: dict[str, Callable[[], object]] = {
        "llmlab": lambda: sampler(logits, requests, gen_llmlab),
        "loop": loop,
    }
    if hf is not None:
        fns["hf"] = lambda: hf(input_ids, logits, gen_hf)
    return time_interleaved(fns, args.min_rounds, args.max_rounds, args.cell_budget)


class _Timed:
    """A processor wrapper that adds its call time to ``totals[name]``."""

    def __init__(self, processor, totals: dict[str, float]) -> None:
        self.processor, self.totals = processor, totals
        self.name = type(processor).__name__

    def __call__(self, logits, batch):
        t0 = time.perf_counter()
        out = self.processor(logits, batch)
        self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - t0
        return out


class _TimedSampler(Sampler):
    totals: dict[str, float]

    def _draw(self, logits, batch, generator):
        t0 = time.perf_counter()
        out = super()._draw(logits, batch, generator)
        self.totals["draw"] = self.totals.get("draw", 0.0) + time.perf_counter() - t0
        return out


def bench_breakdown(args: argparse.Namespace) -> None:
    """Where llmlab's step goes, per stage, at one shape (mean over a few calls)."""
    batch = 64 if 64 in args.batch_sizes else max(args.batch_sizes)
    vocab = max(args.vocabs)
    calls = args.breakdown_calls
    print(f"\nllmlab sampler breakdown at batch {batch} x vocab {vocab}: ms per step "
          f"(mean of {calls} calls); other = raw log_softmax, copy, logprobs, .tolist()\n")
    rows = []
    for mix in args.mixes:
        totals: dict[str, float] = {}
        sampler = _TimedSampler()
        sampler.totals = totals
        sampler.processors = [_Timed(p, totals) for p in sampler.processors]
        requests = make_requests(mix, batch, vocab)
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1))
        gen = torch.Generator().manual_seed(0)
        sampler(logits, requests, gen)
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            sampler(logits, requests, gen)
        total = (time.perf_counter() - t0) / calls
        stages = {k: v / calls for k, v in totals.items()}
        stages["other"] = total - sum(stages.values())
        rows.append((mix, total, stages))
    names = ["Penalties", "Temperature", "TopK", "TopP", "MinP", "draw", "other"]
    print(f"{'mix':>3} {'total':>8} " + " ".join(f"{n:>11}" for n in names))
    for mix, total, stages in rows:
        print(f"{mix:>3} {total * 1e3:>8.2f} "
              + " ".join(f"{stages.get(n, 0.0) * 1e3:>11.2f}" for n in names))


# -- detokenizer -------------------------------------------------------------------------------


def tiny_tokenizer(tmp: pathlib.Path):
    import transformers

    from llmlab.testing.tiny import build_tiny_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = build_tiny_model(tmp, "LlamaForCausalLM", seed=0)
    return transformers.AutoTokenizer.from_pretrained(path)


def _find_stop(text: str, before: int, stops: tuple[str, ...]) -> bool:
    return any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in stops)


def stream_incremental(tokenizer, prompt, output, stops) -> str:
    det = IncrementalDetokenizer(tokenizer, prompt, stop=stops)
    pieces = []
    for i, token in enumerate(output):
        if det.update([token], i + 1) is not None:
            break
        pieces.append(det.delta(finished=False))
    pieces.append(det.delta(finished=True))
    return "".join(pieces)


def stream_redecode(tokenizer, prompt, output, stops) -> str:
    ids: list[int] = []
    text = ""
    pieces = []
    for token in output:
        ids.append(token)
        before = len(text)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if stops and _find_stop(text, before, stops):
            break
        pieces.append(text[before:])  # the step's delta
    return "".join(pieces)


def stream_decode_stream(tokenizer, prompt, output, stops) -> str:
    from tokenizers.decoders import DecodeStream

    backend = tokenizer.backend_tokenizer
    stream = DecodeStream(ids=list(prompt[-5:]), skip_special_tokens=True)
    text = ""
    for token in output:
        piece = stream.step(backend, token)
        if piece:
            before = len(text)
            text += piece
            if stops and _find_stop(text, before, stops):
                break
    return text


def bench_detokenizer(args: argparse.Namespace) -> None:
    from llmlab.testing.tiny_corpus import corpus_lines

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tiny_tokenizer(pathlib.Path(tmp))
    ids = tokenizer.encode("\n".join(corpus_lines()), add_special_tokens=False)
    prompt, output = ids[:32], ids[32 : 32 + args.output_len]
    expected = tokenizer.decode(output, skip_special_tokens=True)
    assert not any(s in expected for s in STOP_STRINGS), "a stop string would match"
    methods = {"incremental": stream_incremental, "redecode": stream_redecode}
    try:
        import tokenizers.decoders

        if hasattr(tokenizers.decoders, "DecodeStream"):
            methods["DecodeStream"] = stream_decode_stream
    except ImportError:
        pass
    print(f"\ndetokenizer: streaming a {len(output)}-token output one token per step "
          f"(tiny Llama byte-level BPE, vocab {len(tokenizer)}, "
          f"{len(expected) / len(output):.1f} chars/token); us per token;")
    print("ratio = method / incremental (higher: incremental is faster)\n")
    print(f"{'stops':>5} " + " ".join(f"{m:>12} {'ratio':>6}" for m in methods))
    for stops in ((), STOP_STRINGS):
        fns = {}
        for name, method in methods.items():
            text = method(tokenizer, prompt, output, stops)
            if text != expected:
                raise AssertionError(f"{name} produced different text")
            fns[name] = functools.partial(method, tokenizer, prompt, output, stops)
        t = time_interleaved(fns, args.min_rounds, args.max_rounds, args.detok_budget)
        base = t["incremental"]
        cells = " ".join(f"{t[m] / len(output) * 1e6:>12.2f} {t[m] / base:>6.2f}" for m in t)
        print(f"{len(stops):>5} {cells}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--vocabs", nargs="+", type=int, default=[32000, 151936])
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=30)
    parser.add_argument("--cell-budget", type=float, default=0.3,
                        help="seconds of timed rounds per cell beyond the minimum")
    parser.add_argument("--detok-budget", type=float, default=2.0)
    parser.add_argument("--breakdown-calls", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=2000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["sampler", "detokenizer"])
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.vocabs = [1, 16], [32000]
        args.min_rounds, args.max_rounds, args.cell_budget = 1, 3, 0.0
        args.detok_budget, args.breakdown_calls, args.output_len = 0.0, 1, 200

    print(f"{datetime.date.today()}  torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}\n")
    start = time.perf_counter()
    if "sampler" not in args.skip:
        bench_sampler(args)
        bench_breakdown(args)
    if "detokenizer" not in args.skip:
        bench_detokenizer(args)
    print(f"\n{time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
