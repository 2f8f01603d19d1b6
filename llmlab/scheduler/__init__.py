"""Scheduling: the continuous-batching scheduler and the policies it consults."""

from llmlab.scheduler.batch import Admission, BatchOutput, ScheduledBatch, ScheduledRequest
from llmlab.scheduler.policies import (
    FCFS,
    SCHEDULING_POLICIES,
    CacheAware,
    PriorityPolicy,
    ShortestJobFirst,
    ShortestPromptFirst,
    SkipJoinMLFQ,
    VirtualTokenCounter,
)
from llmlab.scheduler.policy import (
    KeyedQueue,
    OrderPolicy,
    Policy,
    SchedulerView,
    SchedulingPolicy,
    Served,
    as_policy,
)
from llmlab.scheduler.scheduler import Scheduler

__all__ = [
    "FCFS",
    "SCHEDULING_POLICIES",
    "Admission",
    "BatchOutput",
    "CacheAware",
    "KeyedQueue",
    "OrderPolicy",
    "Policy",
    "PriorityPolicy",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerView",
    "SchedulingPolicy",
    "Served",
    "ShortestJobFirst",
    "ShortestPromptFirst",
    "SkipJoinMLFQ",
    "VirtualTokenCounter",
    "as_policy",
]
