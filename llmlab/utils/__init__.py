"""Small helpers with vLLM's import paths (``vllm.utils``); standard library only.

``llmlab.utils.FlexibleArgumentParser`` and ``llmlab.utils.argparse_utils.
FlexibleArgumentParser`` are the same class, as both paths work in vLLM.
"""

from llmlab.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
