"""Past one device: tensor parallelism over ``torch.distributed`` and data-parallel replicas.

* :mod:`llmlab.distributed.parallel_state`: a tensor-parallel group (rank, size, the two
  collectives a sharded model needs), and the vocabulary split.
* :mod:`llmlab.distributed.tp_executor`: the multi-process executor (rank 0 schedules and
  broadcasts the data-only batch; every rank executes), started with
  ``torch.multiprocessing`` or as Ray actors.
* :mod:`llmlab.distributed.data_parallel`: N whole engines in N processes behind one front
  end that routes each request with a :class:`~llmlab.routing.policy.RoutingPolicy`;
  :mod:`llmlab.distributed.liveness` finds replicas that hang (heartbeats, a deadline).

See ``docs/distributed.md``.
"""
