"""The engine side of LoRA: the prefix cache keys blocks by adapter, the scheduler holds at
most ``max_loras`` adapters per step, host memory keeps ``max_cpu_loras`` adapters (LRU),
and an adapter that cannot be read back fails its own requests only."""

from __future__ import annotations

import pickle
import random
import shutil

import pytest

from llmlab import LLM, LoRARequest, SamplingParams
from llmlab.errors import RequestFailedError
from llmlab.lora.slots import LoRASlots
from llmlab.scheduler.batch import ScheduledBatch

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(n: int = 40, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]}


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def adapters(tiny_llama, adapter_factory) -> list[LoRARequest]:
    return [
        LoRARequest(f"a{i}", i, adapter_factory(tiny_llama, f"engine-a{i}", r=8, seed=i))
        for i in range(1, 5)
    ]


def test_same_prompt_different_adapters_never_share_kv_blocks(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, block_size=16)
    p = prompt(48)
    first = llm.generate([p], PARAMS, use_tqdm=False, lora_request=adapters[0])[0]
    assert first.num_cached_tokens == 0
    other = llm.generate([p], PARAMS, use_tqdm=False, lora_request=adapters[1])[0]
    base = llm.generate([p], PARAMS, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    again = llm.generate([p], PARAMS, use_tqdm=False, lora_request=adapters[0])[0]
    assert again.num_cached_tokens == 32  # the full blocks before the last token
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    base_again = llm.generate([p], PARAMS, use_tqdm=False)[0]
    assert base_again.num_cached_tokens == 32


def test_running_at_once_never_shares_blocks_across_adapters(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, block_size=16)
    engine = llm.llm_engine
    p = prompt(48, seed=1)
    engine.add_request("x", p, PARAMS, lora_request=adapters[0])
    engine.add_request("y", p, PARAMS, lora_request=adapters[1])
    engine.add_request("z", p, PARAMS)
    engine.step()
    tables = [set(engine.kv_cache.block_table(r)) for r in ("x", "y", "z")]
    assert not (tables[0] & tables[1]) and not (tables[0] & tables[2])
    assert not (tables[1] & tables[2])
    while engine.has_unfinished_requests():
        engine.step()


def test_a_step_never_holds_more_than_max_loras_adapters(tiny_llama, adapters, monkeypatch):
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_cpu_loras=4)
    seen: list[set[int]] = []
    activate = LoRASlots.activate

    def spy(self, entries):
        loras = (self.adapter_of(e.row) for e in entries)
        seen.append({lora.lora_int_id for lora in loras if lora is not None})
        return activate(self, entries)

    monkeypatch.setattr(LoRASlots, "activate", spy)
    prompts = [prompt(10 + i, seed=i) for i in range(12)]
    loras = [adapters[i % 4] if i % 3 else None for i in range(12)]
    mixed = tokens(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras))
    assert max(len(s) for s in seen) == 2
    assert set().union(*seen) == {1, 2, 3, 4}
    monkeypatch.undo()
    for p, lora, got in zip(prompts, loras, mixed, strict=True):
        assert tokens(llm.generate([p], PARAMS, use_tqdm=False, lora_request=lora)) == [got]


def test_host_memory_keeps_max_cpu_loras_adapters_least_recently_used(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=2)
    store = llm.llm_engine.lora
    p = prompt(8)
    outs = {}
    for lora in adapters[:3]:
        outs[lora.lora_int_id] = tokens(
            llm.generate([p], PARAMS, use_tqdm=False, lora_request=lora))
    assert store.loaded_ids() == [2, 3]  # 1 was the least recently used
    assert store.loads == 3
    again = tokens(llm.generate([p], PARAMS, use_tqdm=False, lora_request=adapters[0]))
    assert again == outs[1]
    assert store.loads == 4 and store.loaded_ids() == [3, 1]
    assert llm.llm_engine.executor.plugin("lora").slots == {1: 0}  # one device slot, reused


def test_an_adapter_that_cannot_be_read_back_fails_only_its_requests(
        tiny_llama, adapter_factory, tmp_path):
    llm = LLM(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.llm_engine
    doomed = LoRARequest("doomed", 7, shutil.copytree(
        adapter_factory(tiny_llama, "engine-a1", r=8, seed=1), tmp_path / "doomed"))
    other = LoRARequest("other", 8, adapter_factory(tiny_llama, "engine-a2", r=8, seed=2))
    engine.add_request("base", prompt(8), PARAMS)
    engine.add_request("doomed", prompt(8), PARAMS, lora_request=doomed)  # checked: fine
    engine.add_request("other", prompt(8), PARAMS, lora_request=other)  # evicts doomed
    shutil.rmtree(doomed.lora_path)
    finished, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RequestFailedError as err:  # raised after the step; its outputs come next
            errors.append(str(err))
            continue
        finished.update((out.request_id, out) for out in outs if out.finished)
    assert len(errors) == 1 and "'doomed'" in errors[0] and "adapter_config.json" in errors[0]
    assert len(finished["base"].outputs[0].token_ids) == 6
    assert len(finished["other"].outputs[0].token_ids) == 6
    engine.kv_cache.check()


class Recording:
    """An executor that records the batches it runs."""

    def __init__(self, execute, batches):
        self._execute, self.batches = execute, batches

    def execute(self, batch):
        self.batches.append(batch)
        return self._execute(batch)


def test_the_adapter_travels_in_the_batch_as_plain_data(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2)
    runner = llm.llm_engine.executor
    batches: list[ScheduledBatch] = []
    execute = runner.execute
    llm.llm_engine.executor = Recording(execute, batches)
    llm.generate([prompt(5), prompt(6)], PARAMS, use_tqdm=False,
                 lora_request=[adapters[0], None])
    # A row's first entry carries its adapter in the lora plugin's side map.
    setups = [(b.side("lora") or {}).get(e.request_id)
              for b in batches for e in b.entries if e.setup is not None]
    assert setups == [adapters[0], None]
    for batch in batches:
        assert pickle.loads(pickle.dumps(batch)) == batch
