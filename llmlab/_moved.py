"""Old module paths of moved modules, still importable.

Core v4 gave the engine rooms that match its layers (``runner/``, ``observe/``,
``entrypoints/``). Code written against the old paths (``llmlab.llm``,
``llmlab.server.app``, ``llmlab.engine.arg_utils``, ...) keeps working: this finder answers
an old name with the module now at the new one (the same module object, so patching either
name patches both). No file stays behind at the old path, so the layer table has no
exceptions.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

# old prefix -> new prefix; a name under an old prefix moves with it.
MOVED: dict[str, str] = {
    "llmlab.llm": "llmlab.entrypoints.llm",
    "llmlab.cli": "llmlab.entrypoints.cli",
    "llmlab.server": "llmlab.entrypoints.server",
    "llmlab.engine.async_engine": "llmlab.entrypoints.async_engine",
    "llmlab.engine.arg_utils": "llmlab.entrypoints.arg_utils",
    "llmlab.engine.model_runner": "llmlab.runner.model_runner",
    "llmlab.engine.cuda_graphs": "llmlab.runner.cuda_graphs",
    "llmlab.engine.host_kv": "llmlab.runner.host_kv",
    "llmlab.engine.pooling_rows": "llmlab.runner.pooling_rows",
    "llmlab.engine.pooling_setup": "llmlab.runner.pooling_setup",
    "llmlab.engine.executor": "llmlab.runner.executor",
    "llmlab.engine.events": "llmlab.observe.events",
    "llmlab.engine.recording": "llmlab.observe.recording",
    "llmlab.engine.metrics_reader": "llmlab.observe.metrics_reader",
}


def new_name(name: str) -> str | None:
    """Where the module once called ``name`` lives now (None: it did not move)."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass  # the target ran when it was imported


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path (see :data:`MOVED`) as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(target_name))


def install() -> None:
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
