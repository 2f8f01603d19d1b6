"""``benchmarks/kv_press.py`` and its needle model (``benchmarks/kvpress_model.py``): the
teacher-forcing processor, the synthetic data, the shipped checkpoint, and a ``--quick``
run of the whole benchmark in a subprocess."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from benchmarks import kv_press
from benchmarks import kvpress_model as needle
from tests.helpers import subprocess_env

# ---------------------------------------------------------------------------- teacher forcing


def test_teacher_forcing_scores_the_reference_then_forces_it():
    processor = kv_press.TeacherForcing((2, 0))
    logits = torch.tensor([0.0, 1.0, 3.0])
    forced = processor([], logits.clone())
    assert processor.agreed[0] is True
    assert processor.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[2].item())
    assert forced.argmax().item() == 2 and torch.isinf(forced[[0, 1]]).all()
    forced = processor([2], logits.clone())  # step 1: the reference (0) is not the argmax
    assert processor.agreed[1] is False
    assert processor.logprobs[1] == pytest.approx(torch.log_softmax(logits, -1)[0].item())
    assert forced.argmax().item() == 0


def test_quality_pools_tokens_and_skips_the_first_step():
    a, b = kv_press.TeacherForcing((1, 1, 1)), kv_press.TeacherForcing((1, 1))
    a.logprobs, a.agreed = {0: -9.0, 1: -1.0, 2: -2.0}, {0: False, 1: True, 2: False}
    b.logprobs, b.agreed = {0: -9.0, 1: -3.0}, {0: False, 1: True}
    q = kv_press.Quality.of([a, b])
    assert q.num_tokens == 3
    assert q.agreement == pytest.approx(2 / 3)
    assert q.perplexity == pytest.approx(math.exp((1.0 + 2.0 + 3.0) / 3))
    with pytest.raises(AssertionError, match="never saw steps"):
        kv_press.Quality.of([kv_press.TeacherForcing((1, 1))])


# ---------------------------------------------------------------------------- needle data


def test_needle_prompt_plants_the_answer_at_its_depth():
    rng = random.Random(0)
    for depth in (0.0, 0.3, 1.0):
        p = needle.needle_prompt(rng, 200, depth)
        ids = p.token_ids
        assert len(ids) == 200 and ids[0] == needle.BOS_ID and ids[-2] == needle.ASK_ID
        key = ids[-1]
        # The question's key appears once in the context, right after KEY, then the answer.
        spots = [i for i in range(len(ids) - 1) if ids[i] == key]
        assert spots == [p.needle_position + 1]
        assert ids[p.needle_position] == needle.KEY_ID and ids[spots[0] + 1] == p.answer_id
        assert abs(p.needle_position - 1 - depth * (200 - 6)) <= 1
        assert ids.count(needle.KEY_ID) == 4  # the needle and three distractors


def test_copy_prompt_ends_inside_a_repeat_of_an_earlier_span():
    p = needle.copy_prompt(random.Random(1), 300, span=20, depth=0.25, shown=6)
    ids, rest = p.token_ids, p.continuation
    assert len(ids) == 300 and len(rest) == 14
    shown = ids[-6:]
    starts = [i for i in range(len(ids) - 6) if ids[i : i + 6] == shown]
    assert starts and ids[starts[0] + 6 : starts[0] + 20] == rest


def test_training_targets_with_full_weight_are_predictable_from_the_context():
    """Every weight-1 target is a question's answer or a copy of an earlier span: the token
    the context determines."""
    tokens, weights = needle.training_sequence(random.Random(2), 512)
    assert len(weights) == len(tokens) - 1
    values = {}
    answered = copied = 0
    for i in range(1, len(tokens) - 1):
        if tokens[i - 1] == needle.KEY_ID:
            values[tokens[i]] = tokens[i + 1]
    for i, w in enumerate(weights):
        if w < 1.0:
            assert w == needle.FILLER_LOSS_WEIGHT
            continue
        target = i + 1
        if tokens[target - 2] == needle.ASK_ID:
            assert tokens[target] == values[tokens[target - 1]]
            answered += 1
        else:  # a copy: the same two tokens occur earlier with the target after them
            bigram = tokens[target - 1], tokens[target]
            assert any((tokens[j - 1], tokens[j]) == bigram for j in range(1, target - 1))
            copied += 1
    assert answered >= 2 and copied >= 7


def test_tokenizer_spells_the_token_ids():
    tokenizer = needle.build_tokenizer()
    assert tokenizer.encode("KEY k3 t7 ASK k3") == [
        needle.BOS_ID, needle.KEY_ID, needle.key_id(3), needle.filler_id(7), needle.ASK_ID,
        needle.key_id(3),
    ]
    assert len(tokenizer) == needle.VOCAB_SIZE


def test_needle_variants_differ_only_in_whether_the_prompt_holds_the_question():
    """``after``: the context alone, then ``ASK kI`` and the answer. ``known``: the whole
    prompt (question included), then the question again and the answer; the answer never
    appears before it is scored."""
    rng = random.Random(5)
    needles = [needle.needle_prompt(rng, 64, depth) for depth in (0.2, 0.7)]
    after_prompts, after_refs = kv_press.needle_runs(needles, "after")
    known_prompts, known_refs = kv_press.needle_runs(needles, "known")
    assert after_refs == known_refs
    for n, after, known, ref in zip(needles, after_prompts, known_prompts, after_refs):
        question = n.token_ids[-2:]
        assert question[0] == needle.ASK_ID and ref == question + [n.answer_id]
        assert known == n.token_ids and after + question == n.token_ids
        # The answer sits in the needle only: nothing in the unscored tail gives it away.
        assert (known + ref[:-1]).count(n.answer_id) == n.token_ids.count(n.answer_id)
    with pytest.raises(ValueError, match="variant"):
        kv_press.needle_runs(needles, "before")


# ---------------------------------------------------------------------------- the checkpoint


def test_shipped_needle_model_retrieves_at_long_context():
    """The committed checkpoint is small, and transformers' forward pass answers needles at
    the longest trained context (the accuracy its training.json claims, within noise)."""
    from transformers import AutoModelForCausalLM

    path = needle.DEFAULT_OUT
    assert (path / "model.safetensors").stat().st_size < 2 << 20
    model = AutoModelForCausalLM.from_pretrained(path)
    accuracy = needle.retrieval_accuracy(model, 1024, num_prompts=16, seed=7, batch_size=8)
    assert accuracy >= 0.9  # training.json: 1.0 at 1,024 tokens on 64 other prompts


def test_llmlab_answers_needles_as_transformers_does():
    """llmlab loads the checkpoint (float32) and its greedy answer to each question is the
    needle's value and transformers' argmax."""
    from transformers import AutoModelForCausalLM

    from llmlab import LLM, SamplingParams

    rng = random.Random(11)
    prompts = [needle.needle_prompt(rng, 512, depth) for depth in (0.0, 0.4, 0.8)]
    model = AutoModelForCausalLM.from_pretrained(needle.DEFAULT_OUT)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p.token_ids for p in prompts])).logits
    llm = LLM(str(needle.DEFAULT_OUT), dtype="float32", seed=0, num_gpu_blocks_override=128)
    outputs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts],
                           SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    answers = [o.outputs[0].token_ids[0] for o in outputs]
    assert answers == logits[:, -1].argmax(-1).tolist()
    assert answers == [p.answer_id for p in prompts]


# ---------------------------------------------------------------------------- the benchmark


def test_arguments_default_to_every_press_and_ratio():
    args = kv_press.parse_args([])
    assert args.presses == list(kv_press.PRESSES) and args.ratios == [0.25, 0.5, 0.75]
    quick = kv_press.parse_args(["--quick", "--press-config", 'streaming_llm={"window": 8}'])
    assert quick.presses == list(kv_press.QUICK_PRESSES) and quick.ratios == [0.5]
    assert quick.press_config == {"streaming_llm": {"window": 8}}
    assert kv_press.budget_of(0.25) == 0.75


@pytest.mark.slow
def test_quick_run_reports_every_press_and_ratio_zero_changes_nothing(tmp_path):
    out, png = tmp_path / "kv_press.json", tmp_path / "kv_press.png"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.kv_press", "--quick", "--threads", "1",
         "--json", str(out), "--plot", str(png)],
        env=subprocess_env(), check=True, capture_output=True, text=True, timeout=600,
    )
    results = json.loads(out.read_text())
    presses, ratios = results["presses"], results["ratios"]
    assert presses == list(kv_press.QUICK_PRESSES) and ratios == [0.0, 0.5]
    assert png.stat().st_size > 0

    for model in ("stories", "needle"):
        rows = {(r["press"], r["compression_ratio"]): r
                for r in results["quality"] if r["model"] == model}
        assert set(rows) == {(p, r) for p in presses for r in ratios}
        for press in presses:
            # Ratio 0 keeps every token: token-identical to no press.
            assert rows[press, 0.0]["agreement"] == 1.0
            assert rows[press, 0.0]["perplexity_ratio"] == pytest.approx(1.0, abs=1e-4)
            assert 0.0 <= rows[press, 0.5]["agreement"] <= 1.0
    for base in results["baselines"]:
        assert base["agreement"] == 1.0  # its own greedy continuation

    variants = list(kv_press.VARIANTS)
    needles = {(r["variant"], r["press"], r["compression_ratio"]): r["accuracy"]
               for r in results["needle"]}
    assert set(needles) == {(v, p, r) for v in variants for p in presses for r in ratios}
    assert set(results["needle_baseline"]) == set(variants)
    for variant in variants:
        for press in presses:
            # Ratio 0: the compacted cache is the full one, so the same answers.
            assert needles[variant, press, 0.0] == results["needle_baseline"][variant]
            assert 0.0 <= needles[variant, press, 0.5] <= 1.0
    # snapkv keeps what its window's queries attend to: with the question in that window it
    # keeps the needle, which it cannot know to keep when the question comes after.
    assert needles["known", "snapkv", 0.5] > needles["after", "snapkv", 0.5]

    pool = {(r["press"], r["compression_ratio"]): r for r in results["pool"]}
    assert set(pool) == {("none", 0.0)} | {(p, 0.5) for p in presses}
    assert pool["none", 0.0]["compactions"] == 0
    # The engine's default step budget (2,048 on CPU): several prompts per step.
    assert pool["none", 0.0]["max_num_batched_tokens"] > results["settings"]["pool_prompt_len"]
    for press in presses:
        row = pool[press, 0.5]
        assert row["compactions"] >= results["settings"]["pool_requests"]  # each, once or more
        assert row["blocks_freed_by_compaction"] > 0 and row["output_tok_s"] > 0
        assert row["press_errors"] == 0
        # Compaction frees blocks in the full pool, so more requests run at once.
        assert row["peak_running"] > pool["none", 0.0]["peak_running"]
