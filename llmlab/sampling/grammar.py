"""Compiled grammars, grammar states and the batched mask (the per-sequence half of
structured outputs).

A :class:`GrammarVocabulary` holds what a mask needs to know of one vocabulary (its size,
its EOS ids, the ids never allowed, the EOS-only bitmask row); a :class:`CompiledGrammar`
is one compiled constraint; a :class:`GrammarState` is one sequence's matcher (where in its
grammar the output is); :func:`apply_grammar_masks` masks a whole batch's logits in place
from the rows' states. All of them come from
:class:`~llmlab.sampling.structured.StructuredOutputBackend` (a ``GrammarVocabulary`` that
also compiles); see :mod:`llmlab.sampling.structured` for what the mask guarantees.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

logger = logging.getLogger("llmlab.sampling.structured")

# Dtypes xgrammar's CPU kernel handles; anything else (float64, ...) goes through its
# plain-torch kernel.
_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GrammarVocabulary:
    """What a grammar's mask needs to know of one vocabulary, computed once.

    Args:
        xgr: the xgrammar module (its mask kernel applies the bitmask).
        vocab_size: the model's vocabulary (the logits' last dimension).
        eos_token_ids: the ids that end a sequence, each below ``vocab_size``.
        never_token_ids: ids xgrammar never accepts (special tokens other than EOS):
            :meth:`GrammarState.accept` refuses them before xgrammar logs a warning.
    """

    def __init__(self, xgr: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 never_token_ids: Iterable[int]) -> None:
        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self._never = frozenset(never_token_ids)
        self.bitmask_width = (self.vocab_size + 31) // 32
        eos_row = torch.zeros(self.bitmask_width, dtype=torch.int64)
        for t in self.eos_token_ids:
            eos_row[t // 32] |= 1 << (t % 32)
        # int32 with the same bits (bit 31 makes a word negative).
        self._eos_row = torch.where(eos_row >= 2**31, eos_row - 2**32, eos_row).to(torch.int32)
        tail = self.vocab_size % 32
        self._last_word_bits = -1 if tail == 0 else (1 << tail) - 1

    def _rows_nonempty(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Per row of a filled CPU bitmask: does it allow any token below vocab_size?"""
        any_full = (bitmask[:, :-1] != 0).any(dim=1)
        return any_full | ((bitmask[:, -1] & self._last_word_bits) != 0)


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A compiled constraint, shared by every sequence that uses it (read-only).

    Attributes:
        key: the cache key: the kind and a canonical form of the constraint.
        xgr_grammar: xgrammar's ``CompiledGrammar``.
    """

    key: tuple
    xgr_grammar: Any = attrs.field(repr=False)
    # The backend that compiled it: its states need that backend's vocabulary.
    _owner: GrammarVocabulary = attrs.field(repr=False, alias="owner")

    @property
    def kind(self) -> str:
        """``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return self.key[0]


class GrammarState:
    """Where one sequence is in its grammar. Not thread-safe.

    Build with :meth:`~llmlab.sampling.structured.StructuredOutputBackend.new_state`.
    """

    __slots__ = ("_backend", "_extra_eos", "_matcher", "_warned", "compiled")

    def __init__(self, backend: GrammarVocabulary, matcher: Any, compiled: CompiledGrammar):
        self._backend = backend
        self._matcher = matcher
        self._extra_eos = 0  # EOS tokens accepted after termination (each a no-op)
        self._warned = False
        self.compiled = compiled

    def __repr__(self) -> str:
        return f"GrammarState({self.compiled.key[0]}, terminated={self.is_terminated})"

    @property
    def is_terminated(self) -> bool:
        """True once EOS was accepted: the output is complete and only EOS is allowed."""
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and the state unchanged) if the grammar forbids it.

        A terminated state accepts EOS again (what its mask allows) and nothing else.
        """
        token_id = int(token_id)
        backend = self._backend
        if self._matcher.is_terminated():
            if token_id in backend.eos_token_ids:
                self._extra_eos += 1
                return True
            return False
        if not 0 <= token_id < backend.vocab_size or token_id in backend._never:
            return False
        return bool(self._matcher.accept_token(token_id))

    def accept_many(self, token_ids: Iterable[int]) -> int:
        """Accept tokens in order until one is forbidden; the number accepted."""
        n = 0
        for token_id in token_ids:
            if not self.accept(token_id):
                break
            n += 1
        return n

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted tokens (e.g. rejected speculative ones)."""
        num_tokens = int(num_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        undo_eos = min(num_tokens, self._extra_eos)
        self._extra_eos -= undo_eos
        if num_tokens - undo_eos:
            self._matcher.rollback(num_tokens - undo_eos)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask`` (CPU, int32,
        ``[rows, ceil(vocab_size / 32)]``; bit ``t % 32`` of word ``t // 32`` is token t)."""
        self._fill(bitmask, index)
        if not bool(self._backend._rows_nonempty(bitmask[index : index + 1])[0]):
            self._dead_end(bitmask, index)

    def _fill(self, bitmask: torch.Tensor, index: int) -> None:
        """fill_bitmask without the dead-end check (the batch does it once for all rows)."""
        if self._matcher.is_terminated():
            bitmask[index] = self._backend._eos_row
        else:
            self._matcher.fill_next_token_bitmask(bitmask, index)

    def _dead_end(self, bitmask: torch.Tensor, index: int) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "structured output (%s) reached a point where its grammar allows no token; "
                "allowing only EOS (the output is incomplete)",
                self.compiled.kind,
            )
        bitmask[index] = self._backend._eos_row


def apply_grammar_masks(
    logits: torch.Tensor, states: Sequence[GrammarState | None]
) -> None:
    """In place: ``-inf`` on every token row ``i``'s grammar forbids now, for each row whose
    ``states[i]`` is not None; the other rows are left untouched (bit for bit).

    ``logits`` is ``[len(states), V]`` on any device, float32 / bfloat16 / float16 (other
    float dtypes take a slower path). ``V`` is at least the backend's ``vocab_size``; columns
    beyond it are forbidden in constrained rows. One bitmask for the batch is filled on the
    CPU (one xgrammar call per constrained row), copied to the logits' device (pinned,
    non-blocking, on CUDA) and applied by one xgrammar kernel call.
    """
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(
            f"logits must be [len(states), vocab] = [{len(states)}, V], got {tuple(logits.shape)}"
        )
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    backend = states[rows[0]]._backend
    vocab = backend.vocab_size
    for i in rows:
        if states[i]._backend.vocab_size != vocab:
            raise ValueError("grammar states of one batch must share a vocabulary size")
    if logits.shape[1] < vocab:
        raise ValueError(
            f"logits have {logits.shape[1]} columns, fewer than the grammar's vocabulary {vocab}"
        )
    on_cuda = logits.device.type == "cuda"
    # Row i of the bitmask goes with row i of the logits (xgrammar's kernels index both by
    # the same row id); rows without a grammar are never read.
    bitmask = torch.empty(
        (logits.shape[0], backend.bitmask_width), dtype=torch.int32, pin_memory=on_cuda
    )
    for i in rows:
        states[i]._fill(bitmask, i)
    indices = None if len(rows) == logits.shape[0] else rows
    filled = bitmask if indices is None else bitmask[rows]
    nonempty = backend._rows_nonempty(filled)
    if not bool(nonempty.all()):
        for k in (~nonempty).nonzero().flatten().tolist():
            states[rows[k]]._dead_end(bitmask, rows[k])
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    backend._xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=vocab, indices=indices, backend=_kernel(logits)
    )
    if logits.shape[1] > vocab:
        tail = logits[:, vocab:]
        if indices is None:
            tail.fill_(float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
            tail.index_fill_(0, index, float("-inf"))


def _kernel(logits: torch.Tensor) -> str:
    """Which xgrammar kernel applies the bitmask to these logits."""
    if logits.device.type == "cpu":
        return "cpu" if logits.dtype in _CPU_KERNEL_DTYPES else "torch_native"
    if logits.device.type == "cuda" and logits.stride(-1) == 1 and _has_triton():
        return "triton"
    return "torch_native"


_TRITON: bool | None = None


def _has_triton() -> bool:
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _TRITON = False
        else:
            _TRITON = True
    return _TRITON
