"""Scheduling: the continuous-batching scheduler and the policies it consults."""

from llmlab.scheduler.policy import FCFS, SCHEDULING_POLICIES, SchedulingPolicy
from llmlab.scheduler.scheduler import ScheduledBatch, ScheduledRequest, Scheduler

__all__ = [
    "FCFS",
    "SCHEDULING_POLICIES",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulingPolicy",
]
