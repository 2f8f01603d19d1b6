"""Expert load per step (``record_expert_load``): the counts in ``StepEvent.expert_load``
equal independent counts (transformers' router logits for a prefill; the router's own
logits, hooked, for every step of a run with chunked prefill, decodes and preemption),
off by default with no counting at all, refused where it cannot be, in recordings, and
through the tensor-parallel executor."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.config import EngineConfig
from llmlab.entrypoints.arg_utils import EngineArgs
from llmlab.models.expert_load import ExpertLoad
from llmlab.models.moe import SparseMoeBlock
from llmlab.observe.recording import event_from_json, event_to_json, load

MOE = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"]
PROMPTS = [list(range(3, 3 + n)) for n in (13, 5, 21, 2)]
# Small pool and budget: chunked prefill (21 > 16 tokens), decodes beside prefills, and a
# preemption (10 blocks of 4 hold 40 tokens; the four requests need 21).
TIGHT = dict(dtype="float32", block_size=4, num_gpu_blocks_override=10, max_model_len=40,
             max_num_batched_tokens=16, max_num_seqs=4, seed=0)


def _blocks(llm: LLM) -> list[tuple[int, SparseMoeBlock]]:
    executor = llm.llm_engine.executor
    model = getattr(executor, "runner", executor).model  # tensor parallel: rank 0's
    return [(i, layer.mlp) for i, layer in enumerate(model.layers)
            if isinstance(layer.mlp, SparseMoeBlock)]


class GateCounts:
    """An independent count: a forward hook on every sparse layer's router (``gate``) takes
    the top-k of its logits and counts them per expert; :meth:`take` returns what was
    counted since the last call. Also records whether the block held a counter while its
    router ran."""

    def __init__(self, llm: LLM) -> None:
        self.blocks = _blocks(llm)
        self.counts = {i: torch.zeros(b.gate.out_features, dtype=torch.int64)
                       for i, b in self.blocks}
        self.counter_seen: list[bool] = []
        self.handles = [b.gate.register_forward_hook(self._hook(i, b)) for i, b in self.blocks]

    def _hook(self, index, block):
        def hook(module, args, logits):
            chosen = torch.topk(logits.float(), block.top_k, dim=-1).indices
            self.counts[index] += torch.bincount(chosen.reshape(-1).cpu(),
                                                 minlength=module.out_features)
            self.counter_seen.append(block.count_into is not None)
        return hook

    def take(self) -> tuple[tuple[int, ...], ...]:
        rows = tuple(tuple(self.counts[i].tolist()) for i, _ in self.blocks)
        for counts in self.counts.values():
            counts.zero_()
        return rows

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _run_checking(llm: LLM, prompts, params) -> list:
    """Step the engine by hand; after each step compare its event's load with the hooked
    count of that step. Returns the events."""
    engine = llm.llm_engine
    reference = GateCounts(llm)
    events = []
    engine.subscribe(events.append)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            before = len(events)
            engine.step()
            stepped = [e for e in events[before:] if e.scheduled]
            want = reference.take()
            if not stepped:
                assert want == tuple((0,) * len(r) for r in want)
                continue
            (event,) = stepped
            load = event.expert_load
            assert load is not None and load.counts == want, event.step_index
            # Every token the step ran picked top_k experts in every sparse layer.
            assert all(sum(row) == event.num_batched_tokens * load.top_k for row in load.counts)
    finally:
        reference.remove()
    return events


@pytest.mark.parametrize("arch", MOE)
def test_a_prefills_counts_are_transformers_router_picks(tiny_model_factory, arch):
    import transformers

    path = tiny_model_factory(arch)
    prompt = list(range(3, 40))
    llm = LLM(path, dtype="float32", record_expert_load=True)
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    load = events[0].expert_load
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    top_k = hf.config.num_experts_per_tok
    want = tuple(
        tuple(torch.bincount(torch.topk(layer, top_k, dim=-1).indices.reshape(-1),
                             minlength=layer.shape[-1]).tolist())
        for layer in logits
    )
    assert load.counts == want
    assert load.top_k == top_k and load.num_tokens == len(prompt)
    assert load.layers == tuple(i for i, _ in _blocks(llm))
    assert sum(load.counts[0]) == len(prompt) * top_k


@pytest.mark.parametrize("arch", MOE)
def test_every_steps_counts_are_the_routers_own_picks(tiny_model_factory, arch):
    """Chunked prefill, decodes next to prefills and a preemption, step by step."""
    llm = LLM(tiny_model_factory(arch), record_expert_load=True, **TIGHT)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    events = _run_checking(llm, PROMPTS, params)
    assert any(e.preempted for e in events)
    assert any(e.num_prefill_tokens and e.num_prefill_tokens < e.num_batched_tokens
               for e in events)  # a step mixing prefill and decodes


def test_it_is_off_by_default_and_counts_nothing_then(tiny_model_factory):
    llm = LLM(tiny_model_factory("MixtralForCausalLM"), **TIGHT)
    assert not any(p.name == "expert_load" for p in llm.llm_engine.executor.plugins)
    assert llm.llm_engine.config.record_expert_load is False
    reference = GateCounts(llm)
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    reference.remove()
    assert events and all(e.expert_load is None for e in events)
    # No block ever held a counter: the routers did no counting.
    assert reference.counter_seen and not any(reference.counter_seen)
    assert all(b.count_into is None for _, b in _blocks(llm))


def test_on_the_counter_is_held_only_during_a_steps_forward(tiny_model_factory):
    llm = LLM(tiny_model_factory("MixtralForCausalLM"), record_expert_load=True, **TIGHT)
    reference = GateCounts(llm)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    assert reference.counter_seen and all(reference.counter_seen)
    assert all(b.count_into is None for _, b in _blocks(llm))  # dropped after the step
    # A forward outside a step (a user's, a profiling pass) counts nothing.
    block = _blocks(llm)[0][1]
    with torch.no_grad():
        block.route(torch.randn(5, block.gate.in_features))
    reference.remove()


def test_speculative_steps_count_the_verified_drafts_too(tiny_model_factory):
    """The target verifies drafts by running them through its layers: they count. The
    drafter (the same MoE model, loaded again) runs its own blocks, which count nothing."""
    path = tiny_model_factory("MixtralForCausalLM")
    llm = LLM(path, record_expert_load=True, dtype="float32", seed=0,
              speculative_config={"method": "draft_model", "model": path,
                                  "num_speculative_tokens": 3})
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                 SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    drafted = 0
    for event in events:
        if not event.scheduled:
            continue
        tokens = event.num_batched_tokens + sum(d for _, d, _ in event.speculated)
        drafted += sum(d for _, d, _ in event.speculated)
        assert event.expert_load.num_tokens == tokens
    assert drafted > 0


def test_overlapped_scheduling_reports_each_steps_own_load(tiny_model_factory, monkeypatch):
    """With async_scheduling the next batch is planned while one runs: each event still
    carries the load of the batch it committed (the plugin plans ahead: overlap stays on)."""
    llm = LLM(tiny_model_factory("OlmoeForCausalLM"), record_expert_load=True,
              async_scheduling=True, **TIGHT)
    overlap = llm.llm_engine.overlap
    assert overlap is not None
    planned_ahead = []
    schedule = type(overlap)._schedule

    def spy(self, now, ahead_of=None):
        planned_ahead.append(ahead_of is not None)
        return schedule(self, now, ahead_of)

    monkeypatch.setattr(type(overlap), "_schedule", spy)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert sum(planned_ahead) > 3  # batches really were planned while one ran
    ran = [e for e in events if e.scheduled]
    assert ran and all(sum(e.expert_load.counts[0]) == e.num_batched_tokens * 2 for e in ran)


def test_a_dense_model_is_refused_naming_the_setting(tiny_llama):
    with pytest.raises(ValueError, match=r"record_expert_load=True needs a mixture-of-experts"
                                         r".*LlamaForCausalLM"):
        LLM(tiny_llama, record_expert_load=True)


def test_the_setting_is_a_checked_engine_arg_and_a_cli_flag(tiny_model_factory):
    with pytest.raises(TypeError, match="record_expert_load.*'yes'"):
        EngineConfig(model="m", record_expert_load="yes")
    assert EngineConfig(model="m").record_expert_load is False
    assert EngineArgs(model="m", record_expert_load=True).create_engine_config().record_expert_load
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--record-expert-load"]).record_expert_load is True
    assert parser.parse_args([]).record_expert_load is False


def test_recordings_keep_the_load(tiny_model_factory, tmp_path):
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"), record_expert_load=True, **TIGHT)
    events = []
    llm.llm_engine.subscribe(events.append)
    path = tmp_path / "run.jsonl.gz"
    with llm.llm_engine.record(path):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                     SamplingParams(max_tokens=3), use_tqdm=False)
    recording = load(path)
    assert [e.expert_load for e in recording.events] == [e.expert_load for e in events]
    loads = [e.expert_load for e in recording.events if e.scheduled]
    assert loads and all(isinstance(x, ExpertLoad) and x.layers == (0,) for x in loads)
    assert recording.config["record_expert_load"] is True
    # Malformed loads are refused naming the field.
    data = event_to_json(events[0])
    assert event_from_json(json.loads(json.dumps(data))) == events[0]
    for bad, message in (
        ({"layers": [0], "counts": [[1, 2]]}, "fields"),
        ({"layers": [0, 1], "counts": [[1, 2]], "top_k": 2}, "names 2 layers but has 1 rows"),
        ({"layers": [0], "counts": [[1.5, 2]], "top_k": 2}, r"counts must be ints, got \[1.5, 2\]"),
        ({"layers": [0], "counts": [[1, 2]], "top_k": 0}, "top_k must be >= 1, got 0"),
        ([1, 2], "JSON object"),
    ):
        with pytest.raises(ValueError, match=f"field 'expert_load': .*{message}"):
            event_from_json({**data, "expert_load": bad})


def test_expert_load_arithmetic():
    a = ExpertLoad((1, 3), ((3, 1, 0, 0), (1, 1, 1, 1)), top_k=2)
    b = ExpertLoad((1, 3), ((0, 0, 2, 2), (2, 0, 1, 1)), top_k=2)
    assert a.num_tokens == 2 and a.num_experts == 4
    assert a.imbalance() == (3.0, 1.0)
    total = ExpertLoad.total([a, b])
    assert total.counts == ((3, 1, 2, 2), (3, 1, 2, 2)) and total.num_tokens == 4
    with pytest.raises(ValueError, match="cannot add"):
        ExpertLoad.total([a, ExpertLoad((0,), ((1, 1),), top_k=2)])
    with pytest.raises(ValueError, match=">= 0"):
        ExpertLoad((0,), ((1, -1),), top_k=1)


def test_two_tensor_parallel_ranks_report_rank_zeros_counts(tiny_model_factory):
    """TP=2 on gloo (worker processes; about 8 s on 2 cores): rank 0 (this process) counts;
    the step's events carry its counts, equal to its own router's picks."""
    llm = LLM(tiny_model_factory("MixtralForCausalLM"), tensor_parallel_size=2,
              device="cpu", cpu_threads=1, record_expert_load=True, **TIGHT)
    try:
        events = _run_checking(llm, PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
        assert any(e.preempted for e in events)
    finally:
        llm.llm_engine.executor.shutdown()


@pytest.mark.slow
def test_data_parallel_replicas_each_report_their_own_load(tiny_model_factory):
    """Each replica (a process of its own) counts its steps; the events cross the pipe."""
    llm = LLM(tiny_model_factory("MixtralForCausalLM"), data_parallel_size=2, device="cpu",
              cpu_threads=1, dtype="float32", record_expert_load=True)
    try:
        seen = []
        llm.llm_engine.subscribe(lambda replica, event: seen.append((replica, event)),
                                 replica=True)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                     SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        ran = [(r, e) for r, e in seen if e.scheduled]
        assert {r for r, _ in ran} == {0, 1}
        assert all(e.expert_load.num_tokens == e.num_batched_tokens for _, e in ran)
    finally:
        llm.llm_engine.shutdown()
