"""Greedy sampling's argmax and its logprob in one pass per row (a C++ kernel on CPU).

The sampler's all-greedy fast path; the kernel comes from :mod:`llmlab.kernels.cpu_kernels`
(the loader of ``kernels/csrc/cpu_kernels.cpp``), and plain torch runs everywhere else.
"""

from __future__ import annotations

import torch

from llmlab.kernels import cpu_kernels


def argmax_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of ``[rows, vocab]`` float32 logits (the first maximum of each row, as
    ``argmax``) and their logprobs (``log_softmax`` at that token), in one pass per row."""
    kernels = (
        cpu_kernels.load()
        if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    )
    if kernels is not None and logits.dim() == 2 and logits.is_contiguous() and logits.shape[1] > 0:
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.long)
        logprobs = torch.empty(rows, dtype=torch.float32)
        kernels.argmax_logprob(
            logits.data_ptr(), rows, vocab, tokens.data_ptr(), logprobs.data_ptr(),
            torch.get_num_threads(),
        )
        return tokens, logprobs
    tokens = logits.argmax(dim=-1)
    return tokens, logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
