"""Modules that moved (Core v4's rooms) still import from their old paths, as the same
module objects, so code written against the old paths (and patches of them) keeps working."""

from __future__ import annotations

import importlib

import pytest

from llmlab import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_module_at_its_new_path(old):
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


def test_names_below_an_old_package_move_with_it():
    from llmlab.server.app import build_app  # noqa: F401 - the old spelling imports
    import llmlab.entrypoints.server.app as new
    import llmlab.server.app as old

    assert old is new
    assert _moved.new_name("llmlab.server.app") == "llmlab.entrypoints.server.app"
    assert _moved.new_name("llmlab.serverless") is None  # a prefix, not a package, is not moved
    assert _moved.new_name("llmlab.engine.engine") is None


def test_vllm_style_paths_of_the_public_api():
    from llmlab.engine.arg_utils import EngineArgs
    from llmlab.llm import LLM
    import llmlab

    assert LLM is llmlab.LLM and EngineArgs is llmlab.EngineArgs
