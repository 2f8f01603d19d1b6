"""The prompts a load test sends (random text of so many tokens, or a JSON / ShareGPT file)
and when each arrives."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Protocol

import attrs
import numpy as np

from llmlab.loadtest.config import BenchConfig

# What a JSON prompt without a length of its own asks for (vLLM's custom dataset uses 256).
DEFAULT_JSON_OUTPUT_LEN = 128
_HUMAN_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "model")

# Common short English words: most are a single token in GPT-2 and Llama vocabularies, so a
# prompt of N words is roughly N tokens.
_WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form great think say help low line turn cause much mean before move right boy old
too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off
need house picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together
"""
WORDS = tuple(_WORD_TEXT.split())


@attrs.frozen
class BenchRequest:
    """One prompt to send: its text, its ``max_tokens``, and its length (tokens of a random
    prompt made with a tokenizer, else words: the input-token estimate when the server
    reports no usage)."""

    prompt: str
    output_len: int
    prompt_len: int


def _uniform_lens(rng: np.random.Generator, length: int, ratio: float, size: int) -> np.ndarray:
    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return rng.integers(low, high, size=size, endpoint=True)


class Tokenizer(Protocol):
    """What the random dataset needs of a tokenizer: text to ids without special tokens,
    and back (:class:`~llmlab.loadtest.client.RemoteTokenizer` asks the server)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> list[BenchRequest]:
    """Random prompts: a shared prefix of ``prefix_len``, then about ``input_len`` more,
    each asking for about ``output_len`` tokens.

    With a ``tokenizer`` the lengths are tokens, as in ``vllm bench serve``: random
    :data:`WORDS`, tokenized, cut to the length and decoded (re-cut until the text
    tokenizes back to exactly that many tokens, the server's BOS not counted), and
    ``prompt_len`` is that count. Without one they are words (about one token each)."""
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lens(rng, input_len, range_ratio, num_prompts)
    output_lens = _uniform_lens(rng, output_len, range_ratio, num_prompts)
    prefix = list(rng.choice(WORDS, size=prefix_len))
    requests = []
    if tokenizer is not None:
        prefix_text = _token_text(tokenizer, prefix, prefix_len) if prefix_len else ""
        for num_tokens, num_out in zip(input_lens, output_lens):
            words = list(rng.choice(WORDS, size=int(num_tokens)))
            body = _token_text(tokenizer, words, int(num_tokens))
            text = f"{prefix_text} {body}" if prefix_text else body
            # the joined text is counted whole: a prefix may merge with the first word
            requests.append(BenchRequest(text, int(num_out), len(tokenizer.encode(text))))
        return requests
    for num_words, num_out in zip(input_lens, output_lens):
        words = prefix + list(rng.choice(WORDS, size=int(num_words)))
        requests.append(BenchRequest(" ".join(words), int(num_out), len(words)))
    return requests


def _token_text(tokenizer: Tokenizer, words: list[str], num_tokens: int) -> str:
    """Text of ``words`` that tokenizes to ``num_tokens`` tokens (every word is at least
    one token, so ``words`` holds enough; a decode that tokenizes back differently, at the
    cut, is re-cut a few times)."""
    pool = tokenizer.encode(" ".join(words))
    keep = num_tokens
    text = tokenizer.decode(pool[:keep])
    for _ in range(4):
        got = len(tokenizer.encode(text))
        if got == num_tokens or not 0 < keep + num_tokens - got <= len(pool):
            break
        keep += num_tokens - got
        text = tokenizer.decode(pool[:keep])
    return text


def _read_entries(path: Path) -> list:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        entries = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            f"{path}: expected a non-empty JSON list of prompts, got {_brief(entries)}"
        )
    return entries


def _brief(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sharegpt_turns(where: str, turns: object) -> tuple[str | None, int | None]:
    """The first human turn, and the word count of the first assistant turn."""
    # ValueError throughout (TRY004): one error kind for every malformed dataset file.
    if not isinstance(turns, list):
        raise ValueError(  # noqa: TRY004
            f"{where}: \"conversations\" must be a list, got {_brief(turns)}"
        )
    prompt = output_len = None
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(  # noqa: TRY004
                f"{where}: each conversation turn must be an object, got {_brief(turn)}"
            )
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            raise ValueError(  # noqa: TRY004
                f"{where}: a turn's \"value\"/\"content\" must be a string, got {_brief(text)}"
            )
        if role in _HUMAN_ROLES and prompt is None:
            prompt = text
        elif role in _ASSISTANT_ROLES and output_len is None:
            output_len = max(1, len(text.split()))
    return prompt or None, output_len


def _entry_request(where: str, entry: object, override: int | None) -> BenchRequest | None:
    """One dataset entry as a request; None for a ShareGPT entry without a human turn."""
    own = None
    if isinstance(entry, str):
        prompt = entry
    elif isinstance(entry, dict) and "prompt" in entry:
        prompt = entry["prompt"]
        own = entry.get("max_tokens", entry.get("output_len"))
        if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own < 1):
            raise ValueError(f"{where}: max_tokens/output_len must be an int >= 1, got {own!r}")
    elif isinstance(entry, dict) and "conversations" in entry:
        prompt, own = _sharegpt_turns(where, entry["conversations"])
        if prompt is None:
            return None  # ShareGPT dumps hold such entries; vLLM skips them too
    else:
        raise ValueError(
            f"{where}: expected a string, an object with \"prompt\", or a ShareGPT object "
            f"with \"conversations\", got {_brief(entry)}"
        )
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: the prompt must be a non-empty string, got {_brief(prompt)}")
    return BenchRequest(prompt, override or own or DEFAULT_JSON_OUTPUT_LEN, len(prompt.split()))


def load_json_requests(
    path: str | os.PathLike, num_prompts: int, output_len: int | None = None
) -> list[BenchRequest]:
    """The first ``num_prompts`` prompts of a JSON file (cycling if it holds fewer).

    The file holds a list (``.jsonl``: one entry a line) of strings; or of objects with
    ``"prompt"`` and optional ``"max_tokens"`` or ``"output_len"``; or of ShareGPT objects,
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` (``role`` /
    ``content`` also read), whose first human turn is the prompt and whose first assistant
    turn's word count is the output length. ``output_len`` overrides every entry's length;
    entries without one ask for :data:`DEFAULT_JSON_OUTPUT_LEN` tokens.
    """
    path = Path(path)
    requests = []
    for i, entry in enumerate(_read_entries(path)):
        request = _entry_request(f"{path}: entry {i}", entry, output_len)
        if request is not None:
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no entry has a prompt (ShareGPT entries need a human turn)")
    return [requests[i % len(requests)] for i in range(num_prompts)]


def sample_requests(
    config: BenchConfig, tokenizer: Tokenizer | None = None
) -> list[BenchRequest]:
    """The requests ``config`` describes (random lengths in tokens of ``tokenizer``, else
    in words)."""
    if config.dataset_name == "json":
        return load_json_requests(config.dataset_path, config.num_prompts, config.json_output_len)
    return random_requests(
        config.num_prompts, config.random_input_len, config.random_output_len,
        config.random_range_ratio, config.random_prefix_len, config.seed, tokenizer,
    )


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """When each request arrives, in seconds after the first (which arrives at 0).

    At rate ``inf`` all arrive at once. Otherwise the gaps are gamma-distributed with mean
    ``1 / request_rate`` and shape ``burstiness`` (vLLM's arrival process): shape 1 gives
    exponential gaps, i.e. a Poisson process.
    """
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=scale, size=max(num_requests - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]
