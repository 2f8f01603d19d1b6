"""``ExpertLoadView``: from a recorded run of a tiny MoE model, the matrices it draws are the
events' counts (heatmaps, shares, imbalance per step and over the run, checked against
numpy on the raw events), and it renders; live it follows the engine."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from llmlab import LLM, SamplingParams
from llmlab.viz import ExpertLoadView, load

matplotlib.use("Agg")

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (11, 4, 17)]


@pytest.fixture(scope="module")
def recorded(tiny_model_factory, tmp_path_factory):
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"), dtype="float32", block_size=4,
              max_num_batched_tokens=16, record_expert_load=True)
    path = tmp_path_factory.mktemp("experts") / "run.jsonl"
    with llm.llm_engine.record(path):
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    return load(path)


def test_the_views_matrices_are_the_recorded_counts(recorded):
    view = ExpertLoadView(recorded)
    events = [e for e in recorded.events if e.expert_load is not None]
    series = view.series
    assert series.step == [e.step_index for e in events] and len(series) == len(events) > 3
    counts = np.array([e.expert_load.counts for e in events])
    assert np.array_equal(series.counts(), counts)
    assert series.layers == (0,)  # the tiny Qwen3-MoE keeps layer 1 dense
    raw = series.heatmap(0, normalize=False)
    assert np.array_equal(raw, counts[:, 0, :].T)
    shares = series.heatmap(0)
    tokens = np.array([e.num_batched_tokens for e in events])
    assert np.allclose(shares, counts[:, 0, :].T / tokens)
    assert np.allclose(shares.sum(axis=0), 2)  # each token picks top_k = 2 experts
    per_step = counts.max(axis=2) / counts.mean(axis=2)
    assert np.allclose(series.imbalance(), per_step)
    totals = counts.sum(axis=0)
    assert np.allclose(series.run_imbalance(), totals.max(axis=1) / totals.mean(axis=1))
    fig = view.figure()
    assert len(fig.axes) >= 3  # a heatmap, its colorbar, the two imbalance panels
    with pytest.raises(ValueError, match=r"layer must be one of the sparse layers \(0,\)"):
        series.heatmap(1)


def test_it_renders_one_layer_a_png_and_replays(recorded, tmp_path):
    view = ExpertLoadView(recorded, layer=0, normalize=False)
    path = view.to_png(tmp_path / "experts.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    view.seek(2)
    assert len(view.series) == sum(1 for e in recorded.events[:2] if e.expert_load)
    with pytest.raises(ValueError, match="layer must be one of the sparse layers"):
        ExpertLoadView(recorded, layer=1).figure()
    with pytest.raises(ValueError, match="layer must be a layer index"):
        ExpertLoadView(recorded, layer="0")


def test_live_it_follows_the_engine_and_without_loads_says_so(tiny_model_factory):
    llm = LLM(tiny_model_factory("MixtralForCausalLM"), dtype="float32",
              record_expert_load=True)
    view = ExpertLoadView(llm)
    view.figure()  # nothing yet: a placeholder
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(view.series) == 3 and view.series.layers == (0, 1)
    view.close()
    dense = LLM(tiny_model_factory("LlamaForCausalLM"), dtype="float32")
    quiet = ExpertLoadView(dense)
    dense.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(quiet.series) == 0 and quiet.figure() is not None
