"""llmlab's built-in models: small Llamas trained on synthetic children's stories.

``llmlab generate "Once upon a time"`` with no ``--model`` runs ``llmlab-stories``, shipped in
this folder, so the command writes readable text offline. Both models are genuine Hugging
Face ``LlamaForCausalLM`` checkpoints (``transformers.AutoModelForCausalLM`` loads them too).

Provenance
    Corpus: short stories that llmlab tells itself from a seeded grammar
    (:mod:`~llmlab.builtin.stories`, word tables in
    :mod:`~llmlab.builtin.lexicon`), written for llmlab; no dataset is used or copied.
    About 1,250 distinct words, nine plots, each story ending in ``</s>``.
    Tokenizer: byte-level BPE (``tokenizers``), 1,536 entries, ``<s>`` = 0 and ``</s>`` = 1,
    trained on the first 20,000 stories of seed 0; the same chat template as the tiny models
    (:mod:`llmlab.testing.tiny`).

Models (fp16 safetensors under a float32 config, so CPUs run them in fp32)
    ``llmlab-stories``: hidden 256, 4 layers, 4 heads with 2 KV heads, MLP 688, tied
    embeddings, 512 positions; 3,295,488 parameters; 6.6 MB on disk. 800 AdamW steps of
    16 x 256 packed tokens (3.3M tokens), peak LR 3e-3, warmup 50 then cosine to 10%.
    ``llmlab-stories-draft`` (for speculative decoding): hidden 128, 2 layers, MLP 344, same
    tokenizer; 559,744 parameters; 1.2 MB. 1,200 steps (4.9M tokens), peak LR 4e-3.

Held-out perplexity (256 stories of seed 1, each scored on its own, fp16-rounded weights)
    main 1.470, draft 1.520 (an untrained model: about 1,650). Perplexity is low because the
    grammar is: most words follow from the plot, and the model has to learn which.

Rebuild (one CPU thread; 23 min for the main model and 6 min for the draft on a shared
2-core machine; each folder's ``training.json`` records its run)::

    python -m llmlab.builtin.train --out llmlab/builtin

The script also checks that transformers and llmlab decode the same greedy tokens.
"""

from __future__ import annotations

import pathlib

MAIN_MODEL_NAME = "llmlab-stories"
DRAFT_MODEL_NAME = "llmlab-stories-draft"


def builtin_model_path(draft: bool = False) -> pathlib.Path:
    """The folder of the shipped main model (or, with ``draft=True``, its draft model)."""
    path = pathlib.Path(__file__).parent / (DRAFT_MODEL_NAME if draft else MAIN_MODEL_NAME)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the built-in model is missing from {path}; rebuild it with "
            f"`python -m llmlab.builtin.train --out {path.parent}`"
        )
    return path


def ensure_builtin_model() -> pathlib.Path:
    """The built-in demo model: a small Llama trained on synthetic stories, shipped in the
    package (see :mod:`llmlab.builtin`). Nothing is built or downloaded."""
    return builtin_model_path()
