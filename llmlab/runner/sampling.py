"""The runner's sampling step: from a forward pass's hidden states to each entry's tokens.

A mixin of :class:`~llmlab.runner.model_runner.ModelRunner` (kept in its own file so the
execution path reads on its own). Logits are computed only at the positions entries score;
a decode step samples every row at once. Parallel samples fork from their leader's logits,
prompt logprobs are scored in chunks, speculative drafts are verified by the runner's
speculator. Each sampled token joins its row's history and grammar.

When the sampler fails for a batch, every row is sampled alone to find whose request it
was: rows that fail alone fail their own request if it brought something of its own into
sampling (a logits processor, a grammar, bad words); otherwise the step fails.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.errors import ComponentError
from llmlab.sampling.logprobs import gather_logprobs
from llmlab.sampling.metadata import GrammarFactory, SamplingMetadata, SamplingRow
from llmlab.sampling.sampler import SamplerOutput
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch, ScheduledRequest
from llmlab.scheduler.columns import columns_of

logger = logging.getLogger(__name__)

# Prompt positions scored at once for prompt_logprobs (bounds a [rows, vocab] tensor).
_PROMPT_LOGPROBS_CHUNK = 256


class Sampling:
    """Sampling of :class:`~llmlab.runner.model_runner.ModelRunner` (see the module)."""

    def _grammars(self) -> GrammarFactory:
        if self.grammars is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True)")
        return self.grammars

    def _sample(
        self, batch: ScheduledBatch, hidden: torch.Tensor, drafts: list | None = None
    ) -> BatchOutput:
        entries = batch.entries
        columns = columns_of(batch)
        if drafts is None and hidden.shape[0] == len(entries) and columns.plain:
            # One scored token per entry (a decode step): every hidden row is sampled, in
            # order, and each entry gets one token.
            rows = self.rows
            row_ids = columns.rows.tolist()
            sampled, failed = self._draw(
                self.model.compute_logits(hidden), [rows[r] for r in row_ids], row_ids
            )
            if failed is None:
                tops = getattr(sampled, "top", None)
                wants_top = tops is not None and any(t is not None for t in tops)
                return BatchOutput(
                    tuple((t,) for t in sampled.token_ids),
                    tuple((lp,) for lp in sampled.logprobs),
                    top_logprobs=tuple((t,) for t in tops) if wants_top else None,
                )
            return self._output(batch, sampled, failed, {})
        # Rows of ``hidden`` to sample from: each scoring entry's last position, once for
        # the request and once more for each parallel sample it forks into.
        scored_rows: list[int] = []
        sample_rows: list[SamplingRow] = []
        row_ids: list[int] = []
        prompt_scores: list[Any] = [None] * len(batch.entries)
        prompt_starts: list[int] = [0] * len(batch.entries)
        rows = self.rows
        drafted = {d.index for d in drafts} if drafts else ()
        ends: list[int] = []
        offset = 0
        for i, entry in enumerate(batch.entries):
            base, offset = offset, offset + len(entry.token_ids)
            ends.append(offset)
            if i in drafted:
                continue  # verified below
            k = entry.num_scored
            if entry.prompt_logprobs_from >= 0:
                scores = self._prompt_logprobs(entry, hidden, base)
                if scores is not None:
                    prompt_starts[i], prompt_scores[i] = scores
            if k:
                scored_rows.extend([offset - 1] * (1 + len(entry.forks)))
                leader = rows[entry.row]
                sample_rows.append(leader)
                row_ids.append(entry.row)
                for fork in entry.forks:
                    for plugin in self.plugins:
                        plugin.fork_row(entry.row, fork.row)
                    sample_rows.append(self._fork_row(leader, fork))
                    row_ids.append(fork.row)
        any_prompt = any(p is not None for p in prompt_scores)
        # BatchOutput's optional per-entry fields this step fills.
        fields = {
            "prompt_logprobs": tuple(prompt_scores) if any_prompt else None,
            "prompt_logprobs_start": tuple(prompt_starts) if any_prompt else None,
        }
        verified = {}
        if drafts:
            verified = self.speculator.verify(
                batch, drafts, rows, hidden, ends, self.model.compute_logits, self.sampler,
                self.generator,
            )
            fields["num_drafted"] = tuple(
                len(e.token_ids) - 1 if i in verified else 0
                for i, e in enumerate(batch.entries)
            )
        if not scored_rows and not verified:
            empty = BatchOutput.empty(len(batch.entries))
            return attrs.evolve(empty, **fields) if any_prompt else empty
        sampled, failed = None, None
        if scored_rows:
            sampled, failed = self._draw(
                self.model.compute_logits(hidden[scored_rows]), sample_rows, row_ids
            )
        return self._output(batch, sampled, failed, fields, verified)

    def _output(
        self, batch: ScheduledBatch, sampled, failed, fields, verified=None
    ) -> BatchOutput:
        """Per entry, its token (and its forks' samples) from the sampled rows, in order;
        an entry whose row, or one of whose forks' rows, failed gets no tokens and its
        failure. ``verified``: entries whose drafts were verified, with their tokens."""
        if sampled is None:
            sampled = SamplerOutput([], [], [])
        tops = getattr(sampled, "top", None) or [None] * len(sampled.token_ids)
        verified = verified or {}
        any_top = any(t is not None for t in tops) or any(
            v[2] is not None for v in verified.values()
        )
        token_ids, logprobs, top_logprobs, forks, reasons, j = [], [], [], [], [], 0
        for i, entry in enumerate(batch.entries):
            if i in verified:
                tokens, lps, top = verified[i]
                token_ids.append(tokens)
                logprobs.append(lps)
                top_logprobs.append(top if top is not None else (None,) * len(tokens))
                forks.append(())
                reasons.append(None)
                continue
            if not entry.num_scored:
                token_ids.append(())
                logprobs.append(())
                top_logprobs.append(())
                forks.append(())
                reasons.append(None)
                continue
            first, j = j, j + 1 + len(entry.forks)
            reason = None if failed is None else next(
                (failed[k] for k in range(first, j) if failed[k] is not None), None
            )
            reasons.append(reason)
            if reason is not None:
                token_ids.append(())
                logprobs.append(())
                top_logprobs.append(())
                forks.append(())
                continue
            token_ids.append((sampled.token_ids[first],))
            logprobs.append((sampled.logprobs[first],))
            top_logprobs.append((tops[first],))
            forks.append(tuple(
                (sampled.token_ids[k], sampled.logprobs[k], tops[k]) for k in range(first + 1, j)
            ))
        return BatchOutput(
            tuple(token_ids),
            tuple(logprobs),
            top_logprobs=tuple(top_logprobs) if any_top else None,
            forks=tuple(forks) if any(forks) else None,
            failed=tuple(reasons) if failed is not None else None,
            **fields,
        )

    def _draw(self, logits: torch.Tensor, sample_rows: list[SamplingRow], row_ids: list[int]):
        """Sample one token per row; each joins its row's history (and grammar). Returns
        ``(sampled, failed)``: ``failed`` is None, or per row why the sampler failed for
        that row alone (:meth:`_isolate`)."""
        try:
            sampled = self._sample_rows(logits, sample_rows, row_ids)
        except Exception as err:
            sampled, failed = self._isolate(logits, sample_rows, row_ids, err)
        else:
            failed = None
        if failed is None:  # what a PLACEHOLDER in the next batch stands for
            self.last_tokens[row_ids] = sampled.token_ids
        for k, (row, token_id) in enumerate(zip(sample_rows, sampled.token_ids)):
            if failed is not None and failed[k] is not None:
                continue
            if failed is not None:
                self.last_tokens[row_ids[k]] = token_id
            row.output_token_ids.append(token_id)
            grammar = row.grammar
            if grammar is not None and not grammar.is_terminated and not grammar.accept(token_id):
                logger.warning(
                    "request %r: structured-output grammar rejected token %d",
                    row.request_id, token_id,
                )
        return sampled, failed

    def _sample_rows(self, logits: torch.Tensor, sample_rows: list[SamplingRow],
                     row_ids: list[int]):
        metadata = SamplingMetadata(
            sample_rows, logits.shape[-1], logits.device, generator=self.generator,
            columns=self.param_columns, row_ids=np.asarray(row_ids, dtype=np.int64),
        )
        try:
            sampled = self.sampler(logits, metadata)
        except Exception as err:
            raise ComponentError.wrap("sampler", self.sampler, "__call__", err) from err
        if len(sampled.token_ids) != len(sample_rows):
            raise ComponentError(
                "sampler", self.sampler, "__call__",
                f"returned {len(sampled.token_ids)} tokens for {len(sample_rows)} rows",
            )
        return sampled

    def _isolate(self, logits, sample_rows, row_ids, err: Exception):
        """The sampler failed for the batch: sample each row alone, to find whose request
        it was (a per-request logits processor, a grammar). Rows that fail alone fail their
        request only, if the request brought something of its own into sampling; when a row
        with nothing of its own fails too, the failure is the sampler's, and the step
        fails."""
        if not any(_is_per_request(row) for row in sample_rows):
            raise err
        token_ids, logprobs, tops, failed = [], [], [], []
        for k, row in enumerate(sample_rows):
            try:
                one = self._sample_rows(logits[k : k + 1], [row], row_ids[k : k + 1])
            except Exception as row_err:  # noqa: BLE001 - attributed to this request
                cause = row_err.__cause__ or row_err
                failed.append(f"{type(cause).__name__}: {cause}")
                token_ids.append(0)
                logprobs.append(float("nan"))
                tops.append(None)
                continue
            failed.append(None)
            token_ids.append(one.token_ids[0])
            logprobs.append(one.logprobs[0])
            tops.append((getattr(one, "top", None) or [None])[0])
        if any(f is not None and not _is_per_request(row)
               for f, row in zip(failed, sample_rows, strict=True)):
            raise err  # a row with nothing of its own failed too: the sampler's failure
        logger.warning(
            "the sampler failed for %d of %d rows; those requests fail, the rest go on: %s",
            sum(f is not None for f in failed), len(failed), err,
        )
        return SamplerOutput(token_ids, logprobs, tops), failed

    def _fork_row(self, leader: SamplingRow, fork) -> SamplingRow:
        """A parallel sample's row state, started at its first draw from the leader's."""
        grammar = None
        if fork.params.structured_outputs is not None:
            grammar = self._grammars().new_state(fork.params.structured_outputs)
        row = SamplingRow(
            fork.request_id, fork.params, leader.prompt_token_ids,
            list(leader.output_token_ids), leader.eos_token_ids, grammar,
        )
        self.rows[fork.row] = row
        self._started[fork.row] = True
        self.param_columns.set(fork.row, fork.params)
        return row

    def _prompt_logprobs(self, entry: ScheduledRequest, hidden: torch.Tensor, base: int):
        """Logprobs of the prompt tokens this entry's span predicts, not recorded before:
        ``(first prompt position scored, [TokenLogprobs, ...])`` or None."""
        row = self.rows[entry.row]
        prompt = row.prompt_token_ids
        # Position p predicts prompt token p + 1.
        lo = max(entry.start, entry.prompt_logprobs_from)
        hi = min(entry.start + len(entry.token_ids), len(prompt) - 1)
        if hi <= lo:
            return None
        k = row.sampling_params.prompt_logprobs
        scores = []
        # Chunks bound the [rows, vocab] logits of a long prompt.
        for a in range(lo, hi, _PROMPT_LOGPROBS_CHUNK):
            b = min(hi, a + _PROMPT_LOGPROBS_CHUNK)
            rows = hidden[base + a - entry.start : base + b - entry.start]
            lp = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = torch.tensor(prompt[a + 1 : b + 1], device=lp.device)
            scores.extend(gather_logprobs(lp, targets, [k] * (b - a)))
        return lo + 1, scores


def _is_per_request(row: SamplingRow) -> bool:
    """Whether the request brings code or constraints of its own into sampling (custom
    logits processors, a grammar, bad words): what a failure can be blamed on."""
    params = row.sampling_params
    return bool(params.logits_processors or row.grammar is not None or params.bad_words)
