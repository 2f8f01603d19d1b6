"""Scheduling: the continuous-batching scheduler and the policies it consults."""

from llmlab.scheduler.batch import BatchOutput, ScheduledBatch, ScheduledRequest
from llmlab.scheduler.policy import FCFS, SCHEDULING_POLICIES, SchedulingPolicy
from llmlab.scheduler.scheduler import Scheduler

__all__ = [
    "FCFS",
    "SCHEDULING_POLICIES",
    "BatchOutput",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulingPolicy",
]
