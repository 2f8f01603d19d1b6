"""docs/components.md runs: every ```python block, in order, as one session (the page says
so: its first block sets ``model``, the built-in story model, and ``greedy``), and the page
covers every component kind, with its failure rule."""

from __future__ import annotations

import pathlib
import re

import pytest

from llmlab import registry

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "components.md"
KINDS = [kind for kind in registry.KINDS if kind != "model"]  # a model is not swapped in


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def restored_registry():
    """The examples register names process-wide; other tests expect only the built-ins."""
    for kind in registry.KINDS:
        registry.available(kind)  # load the built-ins first, so they are kept
    saved = {kind: dict(registry.table(kind)) for kind in registry.KINDS}
    # Names other tests' examples left registered (docs/tool_calling.md's parser, say) would
    # collide with this page's: the page runs against the built-ins alone.
    for kind in registry.KINDS:
        table = registry.table(kind)
        for name in [n for n, f in table.items()
                     if not getattr(f, "__module__", "llmlab").startswith("llmlab")]:
            del table[name]
    yield
    for kind, entries in saved.items():
        table = registry.table(kind)
        table.clear()
        table.update(entries)


def test_every_python_block_runs_in_order(restored_registry):
    blocks = _blocks()
    assert len(blocks) >= len(KINDS)
    namespace: dict = {"__name__": "components_doc"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/components.md block {i + 1}", "exec"), namespace)  # noqa: S102
        except Exception as err:
            raise AssertionError(f"docs/components.md block {i + 1} failed:\n{block}") from err
    # What the examples promise.
    assert namespace["backend"].calls > 0
    assert len(namespace["vector"]) > 0
    assert namespace["calls"][0].name == "weather"


def test_the_page_covers_every_kind_with_an_example_and_its_failure_rule():
    text = DOC.read_text()
    kind_table = text.split("## One way to plug in any kind")[0]
    failures = text.split("## When a component fails")[1].split("\n## ")[0]
    spellings = text.split("Each kind's spelling")[1].split("\n## ")[0]
    for kind in KINDS:
        assert f"| `{kind}` |" in kind_table, kind
        assert f"| `{kind}` |" in spellings, kind
        assert f"| `{kind}` |" in failures, kind
    code = "\n".join(_blocks())
    examples = {
        "scheduling_policy": "scheduling_policy=", "eviction_policy": "eviction_policy=",
        "attention_backend": "attention_backend=", "sampler": "sampler=",
        "proposer": "proposer=", "kv_press": "kv_press=", "router": "router=",
        "pooler": "pooler=", "tool_parser": '"tool_parser"', "plugin": "plugins=",
    }
    assert set(examples) == set(KINDS)
    for kind, used in examples.items():
        assert used in code, kind
    assert "def bind(self, view)" in code and "def attach(" not in code
