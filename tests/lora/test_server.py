"""Serving LoRA adapters: ``--lora-modules``, ``/v1/models``, runtime load and unload, and a
completion through the official ``openai`` client naming an adapter as its model."""

from __future__ import annotations

import json

import httpx
import pytest

from llmlab import LLM, LoRARequest, SamplingParams
from llmlab.entrypoints.server.lora import LoRAAdapters, LoRAModulePath, parse_lora_modules

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

PROMPT = [5, 17, 33, 9, 41, 12, 7]


@pytest.fixture(scope="module")
def paths(tiny_llama, adapter_factory):
    return {
        "a": adapter_factory(tiny_llama, "server-a", r=8, seed=21),
        "b": adapter_factory(tiny_llama, "server-b", r=4, seed=22),
        "c": adapter_factory(tiny_llama, "server-c", r=8, seed=23),
        "big": adapter_factory(tiny_llama, "server-big", r=16, seed=24),
    }


@pytest.fixture(scope="module")
def server(tiny_llama, paths):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app
    from tests.server.conftest import running

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32", seed=0, enable_lora=True,
                                       max_loras=2, max_lora_rank=8)
    b = json.dumps({"name": "b", "path": paths["b"], "base_model_name": "tiny"})
    app = build_app(engine, served_model_names=["tiny"], model_path=tiny_llama,
                    lora_modules=[f"a={paths['a']}", b])
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, dtype="float32", seed=0, enable_lora=True, max_lora_rank=8)


def offline_text(offline: LLM, lora: LoRARequest | None) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = offline.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False,
                           lora_request=lora)
    return out[0].outputs[0].text


def complete(client, model: str) -> str:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert got.model == model
    return got.choices[0].text


def test_lora_modules_are_listed_with_their_parent_and_no_path(server, client, paths):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == ["tiny", "a", "b"]
    assert cards["a"].parent == "tiny" and cards["a"].root == "a"
    assert cards["b"].root == "b"
    listing = httpx.get(f"{server}/v1/models").text
    assert paths["a"] not in listing and paths["b"] not in listing


def test_a_completion_naming_an_adapter_equals_the_offline_llm(client, offline, paths):
    for name in ("a", "b"):
        want = offline_text(offline, LoRARequest(name, 1 if name == "a" else 2, paths[name]))
        assert complete(client, name) == want
    assert complete(client, "tiny") == offline_text(offline, None) != complete(client, "a")
    with pytest.raises(openai.NotFoundError):
        complete(client, "no-such-adapter")


def test_adapters_load_and_unload_at_runtime(server, client, offline, paths):
    load = f"{server}/v1/load_lora_adapter"
    unload = f"{server}/v1/unload_lora_adapter"
    ok = httpx.post(load, json={"lora_name": "c", "lora_path": paths["c"]})
    assert ok.status_code == 200 and "added successfully" in ok.text
    assert "c" in [m.id for m in client.models.list().data]
    assert complete(client, "c") == offline_text(offline, LoRARequest("c", 3, paths["c"]))
    again = httpx.post(load, json={"lora_name": "c", "lora_path": paths["c"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = httpx.post(load, json={"lora_name": "d", "lora_path": "/no/such/dir"})
    assert missing.status_code == 404
    big = httpx.post(load, json={"lora_name": "big", "lora_path": paths["big"]})
    assert big.status_code == 400 and "max_lora_rank=8" in big.json()["error"]["message"]
    no_path = httpx.post(load, json={"lora_name": "e"})
    assert no_path.status_code == 400
    gone = httpx.post(unload, json={"lora_name": "c"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert httpx.post(unload, json={"lora_name": "c"}).status_code == 404
    assert "c" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        complete(client, "c")


def test_a_path_with_no_adapter_is_one_404_whatever_is_there(server, paths, tmp_path):
    load = f"{server}/v1/load_lora_adapter"
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    answers = []
    for i, path in enumerate([tmp_path / "missing", tmp_path / "file", tmp_path / "empty"]):
        got = httpx.post(load, json={"lora_name": f"nope{i}", "lora_path": str(path)})
        assert got.status_code == 404 and got.json()["error"]["param"] == "lora_path"
        answers.append(got.json()["error"]["message"].replace(repr(str(path)), "PATH")
                       .replace(f"nope{i}", "NAME"))
    assert len(set(answers)) == 1, answers
    assert "not a readable PEFT adapter directory" in answers[0]


@pytest.mark.parametrize("name", ["x" * 257, "bad\ud800name"], ids=["too-long", "surrogate"])
def test_an_adapter_name_that_is_not_one_is_a_400_naming_the_field(server, paths, name):
    for route, body in [
        ("load_lora_adapter", {"lora_name": name, "lora_path": paths["c"]}),
        ("unload_lora_adapter", {"lora_name": name}),
    ]:
        # JSON's \u escape carries the lone surrogate (httpx's json= would refuse it).
        got = httpx.post(f"{server}/v1/{route}", content=json.dumps(body),
                         headers={"content-type": "application/json"})
        assert got.status_code == 400, (route, got.text)
        assert got.json()["error"]["param"] == "lora_name"
        assert "lora_name" in got.json()["error"]["message"]
    listing = httpx.get(f"{server}/v1/models")
    assert listing.status_code == 200 and len(listing.json()["data"]) == 3  # tiny, a, b
    ok = httpx.post(f"{server}/v1/load_lora_adapter",
                    json={"lora_name": "x" * 256, "lora_path": paths["c"]})
    assert ok.status_code == 200  # the longest name allowed
    assert httpx.post(f"{server}/v1/unload_lora_adapter",
                      json={"lora_name": "x" * 256}).status_code == 200


def test_lora_modules_names_must_be_short_valid_unicode():
    for bad in ["\ud800=/p/x", '{"name": "a\\ud800", "path": "/p/y"}', "x" * 257 + "=/p/z"]:
        with pytest.raises(ValueError, match="--lora-modules.*name"):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="JSON object"):
        parse_lora_modules(['["name", "path"]'])


def test_adapter_paths_are_listed_only_when_asked_for():
    class Store:  # checks nothing: the listing is what is tested
        def get(self, lora):
            return None

    for list_paths, root in [(False, "a"), (True, "/adapters/a")]:
        adapters = LoRAAdapters(Store(), "tiny", list_paths=list_paths)
        adapters.load("a", "/adapters/a")
        [card] = adapters.cards(created=0, max_model_len=128)
        assert (card.id, card.root, card.parent) == ("a", root, "tiny")


def test_lora_modules_parse_both_forms():
    got = parse_lora_modules(["x=/p/x", '{"name": "y", "path": "/p/y", "base_model_name": "m"}'])
    assert got == [LoRAModulePath("x", "/p/x"), LoRAModulePath("y", "/p/y", "m")]
    for bad in ("x", "=/p", '{"name": "y"}', "{bad json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["x=/a", "x=/b"])


def test_lora_modules_need_enable_lora(tiny_llama, paths):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            build_app(engine, served_model_names=["tiny"], lora_modules=[f"a={paths['a']}"])
    finally:
        engine.shutdown()
