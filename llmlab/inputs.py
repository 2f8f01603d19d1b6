"""vLLM's ``vllm.inputs`` prompt types: what ``LLM.generate``, ``Engine.add_request`` and
``AsyncEngine.generate`` accept besides a plain string.

They are ``TypedDict``\\ s, i.e. plain dicts at run time: ``TokensPrompt(prompt_token_ids=[1,
2, 3])`` is ``{"prompt_token_ids": [1, 2, 3]}``. Only the keys below are accepted (vLLM's
multi-modal and cache-salt keys are refused with a ``ValueError`` naming them).
"""

from __future__ import annotations

from typing import TypedDict, Union

try:
    from typing import NotRequired
except ImportError:  # Python 3.10: typing_extensions (a dependency of torch)
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids (``prompt``: its text, if known, reported back in
    ``RequestOutput.prompt``)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


# What a single prompt may be (vLLM's ``PromptType``).
PromptType = Union[str, TextPrompt, TokensPrompt]  # noqa: UP007 (a runtime alias)

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
