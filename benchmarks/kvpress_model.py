"""A tiny long-context Llama that retrieves needles: the KV-press benchmark's second model.

The built-in ``llmlab-stories`` has 512 positions and no reason to look far back, so a press
that drops the wrong tokens barely hurts it. This model is trained (on CPU, in minutes) on
synthetic sequences where the right answer sits far back in the context:

* filler: tokens ``t0`` .. ``t511`` drawn uniformly (unpredictable, so nothing to learn);
* needles: ``KEY kI tJ`` planted anywhere, with keys ``k0`` .. ``k63`` distinct within a
  sequence; later ``ASK kI`` must be answered ``tJ`` (the value of that key's needle);
* induction: spans of filler repeated later, whose copy (after its first token) is
  predictable from the original.

The loss counts the predictable tokens (answers and copies) fully and the filler lightly, so
the model spends its capacity on retrieval while still predicting filler as uniform.
Training starts on short sequences that are one random span repeated (the induction heads
form there, in a few hundred steps); then needles and copies at 256, 1,024 and 2,048 tokens,
so retrieval holds at every distance the benchmark uses (2,048 positions).

Checkpoint: ``LlamaForCausalLM``, 2 layers, hidden 128, 4 heads with 2 KV heads (GQA), rope,
tied embeddings, float32 safetensors (1.3 MB), with a ``tokenizers`` WordLevel tokenizer
(``<s>`` = 0, ``</s>`` = 1, ``KEY``, ``ASK``, ``k*``, ``t*``). Rebuild (about 5 min on 2 idle
CPU threads; ``training.json`` records the run)::

    python -m benchmarks.kvpress_model --out benchmarks/assets/needle-llama

The script reports retrieval and copy accuracy at 256, 1,024 and 2,048 tokens, then checks
that transformers and llmlab load the checkpoint and answer needles alike.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time
from collections.abc import Callable, Sequence

import attrs
import torch

# The built-in model's schedule (linear warmup, cosine down to final_lr_fraction of the peak),
# read from any settings with peak_lr, warmup_steps, steps and final_lr_fraction.
from llmlab.builtin.train import adamw, learning_rate

BOS_ID, EOS_ID, KEY_ID, ASK_ID = 0, 1, 2, 3
NUM_KEYS = 64
NUM_FILLER = 512
MAX_POSITIONS = 2048
DEFAULT_OUT = pathlib.Path(__file__).parent / "assets" / "needle-llama"

# Loss weight of unpredictable filler tokens (the answers and copies weigh 1): enough to keep
# the model's filler prediction near uniform, small enough not to drown the signal.
FILLER_LOSS_WEIGHT = 0.02


def key_id(index: int) -> int:
    """Token id of key ``k{index}``."""
    return 4 + index


def filler_id(index: int) -> int:
    """Token id of filler ``t{index}``."""
    return 4 + NUM_KEYS + index


FIRST_FILLER_ID = filler_id(0)
VOCAB_SIZE = filler_id(NUM_FILLER)


def token_names() -> list[str]:
    """Every token's text, in id order."""
    return (
        ["<s>", "</s>", "KEY", "ASK"]
        + [f"k{i}" for i in range(NUM_KEYS)]
        + [f"t{i}" for i in range(NUM_FILLER)]
    )


# ---------------------------------------------------------------------------- data


@attrs.frozen
class NeedlePrompt:
    """A prompt ending in a question (``... ASK kI``) and the token that answers it.

    ``needle_position`` is the index of the answered needle's ``KEY`` token.
    """

    token_ids: list[int]
    answer_id: int
    needle_position: int


@attrs.frozen
class CopyPrompt:
    """A prompt ending partway into a repeat of an earlier span, and the rest of the span
    (what a model that copies continues with)."""

    token_ids: list[int]
    continuation: list[int]


def _filler(rng: random.Random, length: int) -> list[int]:
    return [FIRST_FILLER_ID + rng.randrange(NUM_FILLER) for _ in range(length)]


def needle_prompt(
    rng: random.Random, length: int, depth: float, num_distractors: int = 3
) -> NeedlePrompt:
    """``length`` tokens: ``<s>``, filler with ``1 + num_distractors`` needles of distinct
    keys, and the question ``ASK kI`` as the last two tokens. The answered needle starts at
    ``depth`` (a fraction of the prompt, 0 = first token after ``<s>``); distractors go
    anywhere before the question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    body = length - 3  # <s> ... ASK kI
    if body < 3 * (num_distractors + 1) + 1:
        raise ValueError(f"length {length} is too short for {num_distractors + 1} needles")
    tokens = _filler(rng, body)
    keys = rng.sample(range(NUM_KEYS), num_distractors + 1)
    values = [FIRST_FILLER_ID + rng.randrange(NUM_FILLER) for _ in keys]
    starts = [min(round(depth * (body - 3)), body - 3)]
    while len(starts) < len(keys):
        start = rng.randrange(body - 3)
        if all(abs(start - s) >= 3 for s in starts):
            starts.append(start)
    for start, key, value in zip(starts, keys, values):
        tokens[start : start + 3] = [KEY_ID, key_id(key), value]
    prompt = [BOS_ID] + tokens + [ASK_ID, key_id(keys[0])]
    return NeedlePrompt(token_ids=prompt, answer_id=values[0], needle_position=1 + starts[0])


def copy_prompt(
    rng: random.Random, length: int, span: int, depth: float = 0.1, shown: int = 8
) -> CopyPrompt:
    """``length`` tokens of ``<s>`` and filler in which a ``span``-token run of filler that
    starts at ``depth`` reappears at the end: the prompt holds its first ``shown`` tokens
    again, and ``continuation`` is the remaining ``span - shown``."""
    if not 0 < shown < span:
        raise ValueError(f"shown must be in (0, span), got shown={shown}, span={span}")
    body = length - 1 - shown
    if body < span + 1:
        raise ValueError(f"length {length} is too short for a {span}-token span")
    tokens = _filler(rng, body)
    start = min(round(depth * (body - span)), body - span)
    original = tokens[start : start + span]
    return CopyPrompt(token_ids=[BOS_ID] + tokens + original[:shown],
                      continuation=original[shown:])


def training_sequence(rng: random.Random, length: int) -> tuple[list[int], list[float]]:
    """One training sequence and its per-target loss weights (weight ``w[i]`` scores the
    prediction of token ``i + 1``): needles answered by later questions, and repeated
    spans, on a filler background."""
    tokens = [BOS_ID] + _filler(rng, length - 1)
    weights = [FILLER_LOSS_WEIGHT] * (length - 1)
    taken = [True] + [False] * (length - 1)

    def place(size: int, low: int = 1, high: int | None = None) -> int | None:
        high = length - size if high is None else min(high, length - size)
        for _ in range(20):
            if high < low:
                return None
            start = rng.randint(low, high)
            if not any(taken[start : start + size]):
                taken[start : start + size] = [True] * size
                return start
        return None

    num_needles = max(2, length // 128)
    for key in rng.sample(range(NUM_KEYS), min(num_needles, NUM_KEYS)):
        value = FIRST_FILLER_ID + rng.randrange(NUM_FILLER)
        start = place(3, high=length - 6)
        if start is None:
            continue
        tokens[start : start + 3] = [KEY_ID, key_id(key), value]
        # Answered once or twice, anywhere later: long and short distances both occur.
        for _ in range(rng.choice((1, 1, 2))):
            ask = place(3, low=start + 3)
            if ask is None:
                continue
            tokens[ask : ask + 3] = [ASK_ID, key_id(key), value]
            weights[ask + 1] = 1.0  # predicting the value from "ASK kI"
    for _ in range(max(1, length // 256)):
        span = rng.randint(8, 32)
        source = place(span, high=length - 2 * span)
        if source is None:
            continue
        copy = place(span, low=source + span)
        if copy is None:
            continue
        tokens[copy : copy + span] = tokens[source : source + span]
        for i in range(copy + 1, copy + span):
            weights[i - 1] = 1.0  # the copy's first token is not predictable; the rest are
    return tokens, weights


def repeat_sequence(rng: random.Random, length: int) -> tuple[list[int], list[float]]:
    """``<s>`` then one random filler span (8 to 48 tokens) repeated to fill ``length``;
    every token after the first copy is predictable. The span length varies so that no
    fixed offset answers it: the model has to match content (an induction head)."""
    span = _filler(rng, rng.randint(8, 48))
    tokens = [BOS_ID] + (span * (length // len(span) + 1))[: length - 1]
    weights = [FILLER_LOSS_WEIGHT] * len(span) + [1.0] * (length - 1 - len(span))
    return tokens, weights


def training_batch(
    rng: random.Random, batch_size: int, length: int, repeat_fraction: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [batch, length], weights [batch, length - 1])``."""
    rows = [
        repeat_sequence(rng, length) if rng.random() < repeat_fraction
        else training_sequence(rng, length)
        for _ in range(batch_size)
    ]
    return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


# ---------------------------------------------------------------------------- model


@attrs.frozen
class Phase:
    """``steps`` optimizer steps on ``batch_size`` sequences of ``length`` tokens, of which
    a ``repeat_fraction`` are :func:`repeat_sequence` and the rest
    :func:`training_sequence`."""

    steps: int
    length: int
    batch_size: int
    repeat_fraction: float = 0.0


@attrs.frozen
class TrainSettings:
    # Dense repeats first: with nothing but sparse needles and copies the model sat on the
    # loss plateau for over 1,000 steps, while repeats made its induction heads form in a few
    # hundred (the needle question is the same circuit: find the key, copy what followed).
    phases: tuple[Phase, ...] = (
        Phase(steps=400, length=128, batch_size=32, repeat_fraction=1.0),
        Phase(steps=300, length=256, batch_size=16, repeat_fraction=0.25),
        Phase(steps=400, length=1024, batch_size=4, repeat_fraction=0.1),
        Phase(steps=400, length=2048, batch_size=2, repeat_fraction=0.1),
    )
    peak_lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.05
    seed: int = 0

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.phases)


MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def make_model(seed: int):
    """A fresh ``LlamaForCausalLM`` of :data:`MODEL_SHAPE` (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        **MODEL_SHAPE,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def weighted_loss(model, input_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), input_ids[:, 1:], reduction="none"
    )
    return (nll * weights).sum() / weights.sum()


def train(model, settings: TrainSettings, log: Callable[[str], None] = print) -> list[float]:
    """Train in place through the phases; the loss of each step."""
    rng = random.Random(settings.seed)
    optimizer = adamw(model, settings)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    step = 0
    for phase in settings.phases:
        for _ in range(phase.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings)
            input_ids, weights = training_batch(
                rng, phase.batch_size, phase.length, phase.repeat_fraction
            )
            loss = weighted_loss(model, input_ids, weights)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            if step % 50 == 0 or step == 1:
                recent = sum(losses[-50:]) / len(losses[-50:])
                log(f"  step {step:4d}/{settings.steps}  len {phase.length:4d}  "
                    f"loss {recent:.3f}  lr {learning_rate(step - 1, settings):.2e}  "
                    f"{time.perf_counter() - start:5.0f} s")
    model.eval()
    return losses


# ---------------------------------------------------------------------------- evaluation


@torch.no_grad()
def retrieval_accuracy(
    model, length: int, num_prompts: int = 64, seed: int = 1, batch_size: int = 16
) -> float:
    """Fraction of needle questions at ``length`` tokens (depths spread over the prompt)
    whose greedy next token is the needle's value."""
    rng = random.Random(seed)
    prompts = [needle_prompt(rng, length, depth=i / max(1, num_prompts - 1))
               for i in range(num_prompts)]
    correct = 0
    for i in range(0, num_prompts, batch_size):
        chunk = prompts[i : i + batch_size]
        logits = model(input_ids=torch.tensor([p.token_ids for p in chunk])).logits[:, -1]
        correct += sum(int(t) == p.answer_id for t, p in zip(logits.argmax(-1), chunk))
    return correct / num_prompts


@torch.no_grad()
def copy_accuracy(
    model, length: int, span: int = 24, num_prompts: int = 32, seed: int = 2
) -> float:
    """Teacher-forced fraction of a repeated span's remaining tokens predicted correctly."""
    rng = random.Random(seed)
    prompts = [copy_prompt(rng, length, span, depth=i / max(1, num_prompts - 1))
               for i in range(num_prompts)]
    full = torch.tensor([p.token_ids + p.continuation for p in prompts])
    predicted = model(input_ids=full[:, :-1]).logits.argmax(-1)
    tail = len(prompts[0].continuation)
    return (predicted[:, -tail:] == full[:, -tail:]).float().mean().item()


# ---------------------------------------------------------------------------- checkpoint


def build_tokenizer():
    """WordLevel over :func:`token_names` (whitespace-separated), adding ``<s>`` in front."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from llmlab.testing.tiny import hf_tokenizer

    vocab = {name: i for i, name in enumerate(token_names())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    wrapped = hf_tokenizer(tokenizer.to_str(), MAX_POSITIONS)
    if (wrapped.bos_token_id, wrapped.eos_token_id) != (BOS_ID, EOS_ID):
        raise AssertionError("the special tokens must be ids 0 and 1")
    return wrapped


def save_checkpoint(model, out: pathlib.Path, record: dict) -> None:
    from transformers import GenerationConfig

    from llmlab.testing.tiny import save_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(build_tokenizer(), out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "README.md").write_text(
        "# needle-llama\n\n"
        "A 2-layer Llama (hidden 128, 4 heads / 2 KV heads, 2,048 positions, float32) trained "
        "from scratch on synthetic needle-retrieval and induction sequences by "
        "`python -m benchmarks.kvpress_model --out benchmarks/assets/needle-llama` "
        f"(seed {record['training']['seed']}, {record['training_steps']} steps, "
        f"{record['train_minutes']} min on {record['torch_threads']} CPU threads); "
        "`training.json` records the run and its accuracies. Used by `benchmarks/kv_press.py`; "
        "see `benchmarks/kvpress_model.py` for the data format.\n"
    )


def check_checkpoint(path: pathlib.Path, length: int, num_prompts: int = 16) -> float:
    """Load ``path`` with transformers and with llmlab; both must give the same greedy answer
    to needle questions at ``length`` tokens. Returns llmlab's retrieval accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmlab import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.encode("KEY k3 t7") != [BOS_ID, KEY_ID, key_id(3), filler_id(7)]:
        raise AssertionError("the saved tokenizer does not round-trip the token names")
    hf_model = AutoModelForCausalLM.from_pretrained(path)
    rng = random.Random(3)
    prompts = [needle_prompt(rng, length, depth=i / (num_prompts - 1)) for i in range(num_prompts)]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([p.token_ids for p in prompts])).logits
    hf_answers = logits[:, -1].argmax(-1).tolist()
    llm = LLM(str(path), dtype="float32", seed=0)
    outputs = llm.generate(
        [{"prompt_token_ids": p.token_ids} for p in prompts],
        SamplingParams(max_tokens=1, temperature=0),
        use_tqdm=False,
    )
    llmlab_answers = [o.outputs[0].token_ids[0] for o in outputs]
    if llmlab_answers != hf_answers:
        raise AssertionError(f"llmlab and transformers disagree: {llmlab_answers} vs {hf_answers}")
    return sum(a == p.answer_id for a, p in zip(llmlab_answers, prompts)) / num_prompts


EVAL_LENGTHS = (256, 1024, MAX_POSITIONS - 1)  # the last leaves a position for the answer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = TrainSettings(seed=args.seed)
    model = make_model(settings.seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"needle-llama: {num_params:,} parameters, vocab {VOCAB_SIZE}, {settings.steps} steps",
          flush=True)
    start = time.perf_counter()
    losses = train(model, settings, log=lambda line: print(line, flush=True))
    train_s = time.perf_counter() - start
    retrieval = {n: retrieval_accuracy(model, n) for n in EVAL_LENGTHS}
    copying = {n: copy_accuracy(model, n) for n in EVAL_LENGTHS}
    for n in EVAL_LENGTHS:
        print(f"  {n:5d} tokens: needle retrieval {retrieval[n]:.3f}, "
              f"span copy {copying[n]:.3f}", flush=True)
    record = {
        "shape": MODEL_SHAPE,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "num_parameters": num_params,
        "training": attrs.asdict(settings),
        "training_steps": settings.steps,
        "torch_threads": args.threads,
        "train_minutes": round(train_s / 60, 1),
        "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "retrieval_accuracy": {str(n): v for n, v in retrieval.items()},
        "copy_accuracy": {str(n): round(v, 4) for n, v in copying.items()},
    }
    save_checkpoint(model, args.out, record)
    llmlab_accuracy = check_checkpoint(args.out, EVAL_LENGTHS[-1])
    print(f"saved to {args.out}; transformers and llmlab agree on every answer; llmlab "
          f"retrieval at {EVAL_LENGTHS[-1]} tokens: {llmlab_accuracy:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
