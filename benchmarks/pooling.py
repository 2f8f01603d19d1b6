"""Embeddings per second: llmlab's pooling runner against Hugging Face, in one process.

Both embed the same texts with the built-in model (``llmlab.builtin.ensure_builtin_model``,
a small Llama) in float32, last-token pooling and L2 normalization (a decoder embedder's
default, and llmlab's ``runner="pooling"`` default):

* ``llmlab``: ``LLM(model, runner="pooling").embed(texts)``: continuous batching over the
  paged KV cache, no padding (the prompts are packed into steps of
  ``max_num_batched_tokens``), prefix caching off (every text is distinct anyway, and this
  measures the forward, not cache hits);
* ``hf``: ``transformers.AutoModel`` forward over batches of ``--hf-batch`` texts, right
  padded with an attention mask, then the last non-pad token's hidden state normalized by
  hand: what a notebook does without an embedding library.

The texts are ``--num-texts`` lines of the built-in story corpus. Both produce the same
embeddings (checked: max |difference| printed, the run fails above 1e-4). Timing: one
warm-up pass each, then ``--rounds`` passes alternating the two (so load drift hits both);
the median is reported, as texts per second and the ratio llmlab / hf (higher: llmlab
faster). Threads are set explicitly (``--threads``, default 2) for both.

Run: ``python -m benchmarks.pooling [--num-texts 512] [--hf-batch 32] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    import transformers

    from llmlab import LLM
    from llmlab.builtin import ensure_builtin_model
    from llmlab.testing.tiny_corpus import corpus_lines

    torch.set_num_threads(args.threads)
    path = str(ensure_builtin_model())
    lines = [line for line in corpus_lines() if line.strip()]
    texts = [lines[i % len(lines)] + f" ({i})" for i in range(args.num_texts)]

    llm = LLM(path, runner="pooling", dtype="float32", cpu_threads=args.threads,
              enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)

    def run_llmlab() -> torch.Tensor:
        outs = llm.embed(texts, use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outs])

    @torch.inference_mode()
    def run_hf() -> torch.Tensor:
        vectors = []
        for start in range(0, len(texts), args.hf_batch):
            batch = tokenizer(texts[start : start + args.hf_batch], padding=True,
                              return_tensors="pt")
            hidden = hf(**batch).last_hidden_state
            last = batch["attention_mask"].sum(dim=1) - 1  # right padding
            pooled = hidden[torch.arange(hidden.shape[0]), last]
            vectors.append(F.normalize(pooled, dim=-1))
        return torch.cat(vectors)

    ours, theirs = run_llmlab(), run_hf()  # warm-up, and the correctness check
    max_diff = (ours - theirs).abs().max().item()
    times: dict[str, list[float]] = {"llmlab": [], "hf": []}
    for _ in range(args.rounds):
        for name, run in (("llmlab", run_llmlab), ("hf", run_hf)):
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)

    median = {name: statistics.median(ts) for name, ts in times.items()}
    rate = {name: len(texts) / t for name, t in median.items()}
    print(f"model: {path} (hidden {hf.config.hidden_size}, {hf.config.num_hidden_layers} "
          f"layers), float32, last-token pooling + normalize")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
          f"visible, torch {torch.__version__}, {args.threads} threads")
    print(f"texts: {len(texts)} ({num_tokens} tokens, {num_tokens / len(texts):.1f} per "
          f"text); hf batch {args.hf_batch}; llmlab max_num_batched_tokens "
          f"{args.max_num_batched_tokens}; median of {args.rounds} rounds")
    print(f"max |llmlab - hf| = {max_diff:.2e}")
    print(f"{'':8} {'s':>8} {'texts/s':>9} {'tokens/s':>9}")
    for name in ("llmlab", "hf"):
        print(f"{name:8} {median[name]:8.3f} {rate[name]:9.1f} "
              f"{num_tokens / median[name]:9.0f}")
    print(f"ratio llmlab / hf (texts/s): {rate['llmlab'] / rate['hf']:.2f}x")
    if max_diff > 1e-4:
        raise SystemExit(f"embeddings differ by {max_diff:.2e} (> 1e-4)")


if __name__ == "__main__":
    main()
