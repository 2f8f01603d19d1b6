"""Train the built-in story models from scratch: ``python -m llmlab.builtin.train --out DIR``.

Builds the corpus (:mod:`llmlab.builtin.stories`), trains a byte-level BPE on it, then
trains the main model and the draft model with plain torch (AdamW, warmup then cosine,
packed 256-token sequences, fixed seeds) on one CPU thread by default, and writes each as a
Hugging Face checkpoint (fp16 safetensors, fp32 config) with the tokenizer beside it.
Finally it checks that transformers and llmlab load each one and decode the same greedy text.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from llmlab.builtin import DRAFT_MODEL_NAME, MAIN_MODEL_NAME
from llmlab.builtin.stories import stories, story
from llmlab.testing.tiny import hf_tokenizer, save_tokenizer, train_bpe_tokenizer

VOCAB_SIZE = 1536
MAX_POSITIONS = 512
TRAIN_SEED, HELDOUT_SEED = 0, 1
TOKENIZER_STORIES = 20_000


@attrs.frozen
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int = 4
    num_key_value_heads: int = 2


@attrs.frozen
class TrainSettings:
    steps: int
    peak_lr: float
    batch_size: int = 16
    seq_len: int = 256
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0


MAIN_SHAPE = ModelShape(hidden_size=256, intermediate_size=688, num_hidden_layers=4)
DRAFT_SHAPE = ModelShape(hidden_size=128, intermediate_size=344, num_hidden_layers=2)
# Sized for the budget on one thread of a shared CPU: ~1.5 s per main step, ~0.3 s per draft.
MAIN_TRAINING = TrainSettings(steps=800, peak_lr=3e-3)
DRAFT_TRAINING = TrainSettings(steps=1200, peak_lr=4e-3)


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """The story tokenizer: BPE over the first stories of the training seed."""
    tokenizer_json = train_bpe_tokenizer(stories(TOKENIZER_STORIES, TRAIN_SEED), vocab_size)
    tokenizer = hf_tokenizer(tokenizer_json, MAX_POSITIONS)
    if (tokenizer.bos_token_id, tokenizer.eos_token_id) != (0, 1):
        raise AssertionError("the special tokens must be ids 0 and 1")
    return tokenizer


def encode_story(tokenizer, text: str) -> list[int]:
    """``<s>`` story ``</s>``: the tokenizer adds ``<s>``; ``</s>`` teaches the model to stop."""
    return tokenizer.encode(text) + [tokenizer.eos_token_id]


def token_stream(tokenizer, num_tokens: int, seed: int = TRAIN_SEED) -> torch.Tensor:
    """Stories from ``seed``, encoded and concatenated until there are ``num_tokens``."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        batch = [story(rng) for _ in range(1000)]
        for encoded in tokenizer(batch)["input_ids"]:
            ids += encoded + [tokenizer.eos_token_id]
    return torch.tensor(ids[:num_tokens])


def make_model(shape: ModelShape, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        **attrs.asdict(shape),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def adamw(model, settings) -> torch.optim.AdamW:
    """AdamW at ``settings.peak_lr`` with ``settings.weight_decay`` on the matrices; norm
    scales and the embedding stay out of weight decay."""
    decayed = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    kept = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    return torch.optim.AdamW(
        [{"params": decayed, "weight_decay": settings.weight_decay},
         {"params": kept, "weight_decay": 0.0}],
        lr=settings.peak_lr, betas=(0.9, 0.95), eps=1e-8,
    )


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine down to ``final_lr_fraction`` of the peak."""
    if step < settings.warmup_steps:
        return settings.peak_lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    floor = settings.final_lr_fraction
    return settings.peak_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model, stream: torch.Tensor, settings: TrainSettings, log: Callable[[str], None] = print
) -> list[float]:
    """Train in place on non-overlapping ``seq_len`` chunks of ``stream``; the loss per step."""
    chunks = stream[: stream.numel() // settings.seq_len * settings.seq_len]
    chunks = chunks.view(-1, settings.seq_len)
    needed = settings.steps * settings.batch_size
    if chunks.shape[0] < needed:
        raise ValueError(f"stream has {chunks.shape[0]} chunks; training needs {needed}")
    order = torch.randperm(chunks.shape[0], generator=torch.Generator().manual_seed(settings.seed))
    optimizer = adamw(model, settings)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        batch = chunks[order[step * settings.batch_size : (step + 1) * settings.batch_size]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step == 0:
            elapsed_s = time.perf_counter() - start
            recent = sum(losses[-25:]) / len(losses[-25:])
            tokens_per_s = (step + 1) * batch.numel() / elapsed_s
            log(f"  step {step + 1:5d}/{settings.steps}  loss {recent:.3f}  "
                f"lr {learning_rate(step, settings):.2e}  {elapsed_s:6.0f} s  "
                f"{tokens_per_s:.0f} tok/s")
    model.eval()
    return losses


@torch.no_grad()
def story_perplexity(model, tokenizer, texts: Sequence[str], batch_size: int = 32) -> float:
    """Perplexity over every token after ``<s>`` (``</s>`` included), each story on its own."""
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(texts), batch_size):
        encoded = [encode_story(tokenizer, t) for t in texts[i : i + batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), tokenizer.eos_token_id)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none"
        )
        counted = mask[:, 1:].bool()
        total_nll += nll[counted].sum().item()
        total_tokens += int(counted.sum())
    return math.exp(total_nll / total_tokens)


def save_checkpoint(model, tokenizer, out: pathlib.Path, record: dict) -> None:
    """fp16 weights (half the bytes) under a float32 config, so CPUs run it in fp32."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model.half().save_pretrained(out, safe_serialization=True)
    model.float()
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tokenizer, out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def check_checkpoint(path: pathlib.Path, prompts: Sequence[str], max_tokens: int = 48) -> list[str]:
    """Load ``path`` with transformers and with llmlab; their greedy tokens must agree.
    Returns llmlab's completions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmlab import LLM, SamplingParams

    hf_model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = LLM(str(path), dtype="float32", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        input_ids = torch.tensor([tokenizer.encode(prompt)])
        expected = hf_model.generate(input_ids, max_new_tokens=max_tokens, do_sample=False)
        expected_ids = expected[0, input_ids.shape[1] :].tolist()
        if list(output.outputs[0].token_ids) != expected_ids:
            raise AssertionError(f"llmlab and transformers disagree on {prompt!r}")
    return [output.outputs[0].text for output in outputs]


def train_one(
    name: str, shape: ModelShape, settings: TrainSettings, tokenizer, stream: torch.Tensor,
    heldout: Sequence[str], out: pathlib.Path, threads: int,
) -> None:
    model = make_model(shape, len(tokenizer), seed=settings.seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {num_params:,} parameters, {settings.steps} steps of "
          f"{settings.batch_size} x {settings.seq_len} tokens", flush=True)
    start = time.perf_counter()
    losses = train(model, stream, settings, log=lambda line: print(line, flush=True))
    train_s = time.perf_counter() - start
    final_loss = sum(losses[-50:]) / len(losses[-50:])
    model.half().float()  # measure what ships: the fp16-rounded weights
    perplexity = story_perplexity(model, tokenizer, heldout)
    print(f"{name}: trained in {train_s / 60:.1f} min; final train loss "
          f"{final_loss:.3f}; held-out perplexity {perplexity:.3f} "
          f"({len(heldout)} stories, seed {HELDOUT_SEED})", flush=True)
    record = {
        "shape": attrs.asdict(shape),
        "training": attrs.asdict(settings),
        "num_parameters": num_params,
        "torch_threads": threads,
        "train_minutes": round(train_s / 60, 1),
        "final_train_loss": round(final_loss, 4),
        "heldout_perplexity": round(perplexity, 4),
        "heldout": {"stories": len(heldout), "seed": HELDOUT_SEED},
        "corpus": f"llmlab.builtin.stories, seed {TRAIN_SEED}",
    }
    save_checkpoint(model, tokenizer, out / name, record)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path,
                        help="folder to write the checkpoints into")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the machine may be shared)")
    parser.add_argument("--only", choices=("main", "draft"), default=None)
    parser.add_argument("--main-steps", type=int, default=MAIN_TRAINING.steps)
    parser.add_argument("--draft-steps", type=int, default=DRAFT_TRAINING.steps)
    parser.add_argument("--heldout-stories", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    tokenizer = build_tokenizer()
    runs = {
        "main": (MAIN_MODEL_NAME, MAIN_SHAPE, attrs.evolve(MAIN_TRAINING, steps=args.main_steps)),
        "draft": (
            DRAFT_MODEL_NAME, DRAFT_SHAPE, attrs.evolve(DRAFT_TRAINING, steps=args.draft_steps)
        ),
    }
    if args.only is not None:
        runs = {args.only: runs[args.only]}
    needed = max(s.steps * s.batch_size * s.seq_len for _, _, s in runs.values())
    stream = token_stream(tokenizer, needed)
    heldout = stories(args.heldout_stories, HELDOUT_SEED)
    print(f"corpus: {stream.numel():,} tokens of stories (seed {TRAIN_SEED}); tokenizer: "
          f"{len(tokenizer)} entries; ready in {time.perf_counter() - start:.0f} s", flush=True)
    for name, shape, settings in runs.values():
        train_one(name, shape, settings, tokenizer, stream, heldout, args.out, args.threads)

    prompts = ["Once upon a time", "One day, a little dog named Max", "Lily was afraid of"]
    for name, _, _ in runs.values():
        completions = check_checkpoint(args.out / name, prompts)
        print(f"{name}: transformers and llmlab agree on greedy decoding")
        for prompt, text in zip(prompts, completions):
            print(f"  {prompt!r} -> {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
