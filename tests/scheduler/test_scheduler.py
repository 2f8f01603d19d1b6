"""Continuous batching, chunked prefill, preemption and policies, with no model attached."""


from llmlab.cache import KVCacheManager
from llmlab.request import RequestStatus
from llmlab.scheduler import FCFS, BatchOutput, Scheduler
from tests.helpers import make_request


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   policy=None):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(kv=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, policy=policy or FCFS())


def run_step(sched, token=1):
    batch = sched.schedule(now=0.0)
    output = BatchOutput.from_lists(
        [[token] * e.num_scored for e in batch.entries],
        [[-0.5] * e.num_scored for e in batch.entries],
    )
    finished = sched.update(batch, output)
    assert sched.take_errors() == []
    return batch, finished


def test_budget_and_max_num_seqs_bound_each_step():
    sched = make_scheduler(max_num_seqs=3, budget=20)
    reqs = [make_request(range(8)) for _ in range(5)]
    for r in reqs:
        sched.add(r)
    batch, _ = run_step(sched)
    assert len(batch) == 3
    assert batch.num_batched_tokens == 20  # 8 + 8 + a 4-token chunk of the third
    assert [e.num_new_tokens for e in batch.entries] == [8, 8, 4]
    assert [e.samples for e in batch.entries] == [True, True, False]


def test_chunked_prefill_mixes_with_decodes():
    sched = make_scheduler(budget=10)
    short = make_request(range(5), max_tokens=10)
    long = make_request(range(100, 130), max_tokens=10)
    sched.add(short)
    sched.add(long)
    batch, _ = run_step(sched)
    assert [(e.request_id == short.request_id, e.num_new_tokens) for e in batch.entries] == [
        (True, 5), (False, 5)
    ]
    batch, _ = run_step(sched)  # short decodes (1 token) while long continues its prefill (9)
    assert [(e.num_computed_tokens, e.num_new_tokens) for e in batch.entries] == [(5, 1), (5, 9)]
    while long.num_output_tokens == 0:
        run_step(sched)
    assert long.num_computed_tokens == 30


def test_preemption_by_recompute_when_blocks_run_out():
    # Each request alone needs 7 blocks at full length; together they need 14 of 8.
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    a = make_request(range(8), max_tokens=20, arrival=0)
    b = make_request(range(50, 58), max_tokens=20, arrival=1)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(60):
        batch, _ = run_step(sched)
        preempted += batch.preempted
        if not sched.num_unfinished:
            break
    assert preempted and preempted[0] == b.request_id  # FCFS preempts the later arrival
    assert b.num_preemptions >= 1
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 20 and b.num_output_tokens == 20
    assert sched.kv.snapshot().block_tables == {}


def test_preempted_request_keeps_its_tokens_and_recomputes_them():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)
    a = make_request(range(8), max_tokens=12, arrival=0)
    b = make_request(range(50, 58), max_tokens=12, arrival=1)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:
        run_step(sched)
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    generated = list(b.output_token_ids)
    assert generated
    while b.status is RequestStatus.WAITING:
        run_step(sched)
    assert b.output_token_ids[: len(generated)] == generated


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request([3, 4], max_tokens=5)
    eos.eos_token_ids = frozenset({1})
    ignore = make_request([3, 4], max_tokens=5, ignore_eos=True)
    ignore.eos_token_ids = frozenset({1})
    stop_tok = make_request([3, 4], max_tokens=5, stop_token_ids=[1])
    min_tok = make_request([3, 4], max_tokens=5, min_tokens=3)
    min_tok.eos_token_ids = frozenset({1})
    for r in (eos, ignore, stop_tok, min_tok):
        sched.add(r)
    while sched.num_unfinished:
        run_step(sched, token=1)
    assert (eos.finish_reason, eos.num_output_tokens) == ("stop", 1)
    assert (ignore.finish_reason, ignore.num_output_tokens) == ("length", 5)
    assert (stop_tok.finish_reason, stop_tok.stop_reason) == ("stop", 1)
    assert (min_tok.finish_reason, min_tok.num_output_tokens) == ("stop", 3)


def test_max_model_len_ends_generation():
    sched = make_scheduler(max_model_len=10)
    r = make_request(range(7), max_tokens=100)
    sched.add(r)
    while sched.num_unfinished:
        run_step(sched)
    assert r.num_tokens == 10 and r.finish_reason == "length"


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_request(range(9)), make_request(range(9))
    sched.add(running)
    sched.add(waiting)
    run_step(sched)
    aborted = sched.abort({running.request_id, waiting.request_id})
    assert {r.request_id for r in aborted} == {running.request_id, waiting.request_id}
    assert running.finish_reason == "abort"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.num_unfinished == 0


def test_a_custom_policy_decides_admission_order():
    class ShortestPromptFirst:
        name = "spf"

        def order(self, waiting, now):
            return sorted(waiting, key=lambda r: r.num_prompt_tokens)

        def victim(self, candidates):
            return candidates[-1]

    sched = make_scheduler(max_num_seqs=1, policy=ShortestPromptFirst())
    long, short = make_request(range(20)), make_request(range(3))
    sched.add(long)
    sched.add(short)
    batch, _ = run_step(sched)
    assert [e.request_id for e in batch.entries] == [short.request_id]


def test_prefix_hit_skips_cached_tokens_at_admission():
    sched = make_scheduler(block_size=4)
    a = make_request(range(12), max_tokens=1)
    sched.add(a)
    while sched.num_unfinished:
        run_step(sched)
    b = make_request(list(range(12)) + [77], max_tokens=1)
    sched.add(b)
    batch, _ = run_step(sched)
    assert (batch.entries[0].num_computed_tokens, batch.entries[0].num_new_tokens) == (12, 1)


def test_an_optional_admit_hook_can_hold_a_request_back():
    class NoLongPromptsWhileBusy(FCFS):
        def admit(self, request, budget):
            return request.num_prompt_tokens <= budget // 2

    sched = make_scheduler(budget=16, policy=NoLongPromptsWhileBusy())
    long, short = make_request(range(12), arrival=0), make_request(range(4), arrival=1)
    sched.add(long)
    sched.add(short)
    batch, _ = run_step(sched)
    assert [e.request_id for e in batch.entries] == [short.request_id]  # the long one was skipped, not blocking
    assert long in sched.waiting


def test_fcfs_admits_in_arrival_order_whatever_the_order_of_queueing():
    sched = make_scheduler(max_num_seqs=1)
    late, early, middle = (make_request(range(3), arrival=t) for t in (5.0, 1.0, 3.0))
    for r in (late, early, middle):
        sched.add(r)
    assert sched.waiting == [early, middle, late]
    batch, _ = run_step(sched)
    assert [e.request_id for e in batch.entries] == [early.request_id]


def test_a_preempted_request_rejoins_the_queue_in_arrival_order():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_num_seqs=2)
    a = make_request(range(8), max_tokens=20, arrival=0)
    b = make_request(range(50, 58), max_tokens=20, arrival=1)
    c = make_request(range(70, 78), max_tokens=20, arrival=2)
    for r in (a, b, c):
        sched.add(r)
    while not b.num_preemptions:
        run_step(sched)
    assert sched.waiting.index(b) < sched.waiting.index(c)


def test_rows_are_lowest_free_and_reported_when_released():
    sched = make_scheduler(max_num_seqs=3, budget=64)
    reqs = [make_request(range(4), max_tokens=1 + i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    batch, _ = run_step(sched)
    assert [(e.row, e.new_row) for e in batch.entries] == [(0, True), (1, True), (2, True)]
    assert reqs[0].row is None and reqs[0].is_finished  # one token, done
    batch, _ = run_step(sched)
    assert batch.freed_rows == (0,)
    assert [(e.request_id, e.row, e.new_row) for e in batch.entries] == [
        (reqs[1].request_id, 1, False), (reqs[2].request_id, 2, False),
        (reqs[3].request_id, 0, True),
    ]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_whole():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv=kv, max_num_seqs=4, max_num_batched_tokens=20, max_model_len=20,
                      chunked_prefill=False)
    a, b = make_request(range(12), max_tokens=3), make_request(range(50, 62), max_tokens=3)
    sched.add(a)
    sched.add(b)
    batch, _ = run_step(sched)
    assert [(e.request_id, e.num_new_tokens) for e in batch.entries] == [(a.request_id, 12)]
    batch, _ = run_step(sched)
    assert [(e.request_id, e.num_new_tokens) for e in batch.entries] == [
        (a.request_id, 1), (b.request_id, 12)
    ]


def test_the_batch_carries_spans_and_block_tables():
    sched = make_scheduler(block_size=4, budget=5)
    r = make_request(range(100, 109), max_tokens=2)
    sched.add(r)
    first, _ = run_step(sched)
    second, _ = run_step(sched)
    e1, e2 = first.entries[0], second.entries[0]
    assert (e1.start, e1.token_ids, e1.num_scored) == (0, (100, 101, 102, 103, 104), 0)
    assert (e2.start, e2.token_ids, e2.num_scored) == (5, (105, 106, 107, 108), 1)
    # The first entry sends the whole table; later ones only what changed since.
    assert e1.setup is not None and e2.setup is None
    assert (e1.blocks_from, e1.blocks) == (0, sched.kv.block_table(r.request_id)[:2])
    assert (e2.blocks_from, e2.blocks) == (2, sched.kv.block_table(r.request_id)[2:])
    assert len(sched.kv.block_table(r.request_id)) == 3
    third, _ = run_step(sched)  # a decode inside the last block: no table change
    assert (third.entries[0].blocks_from, third.entries[0].blocks) == (3, ())
