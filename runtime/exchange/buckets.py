"""The DP side of a step, bucket by bucket: which process group a bucket travels over, which of
its slices this rank keeps, and the launch of its reduction and its gather
(`canzona.runtime.exchange.comm`).

Dense buckets travel over the DP group; under expert parallelism an expert bucket travels over
the expert-DP group (the DP ranks of this EP rank) and its mean is still taken over the DP size,
as Megatron scales expert gradients (`canzona.runtime.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor

from canzona.runtime.exchange import comm
from canzona.runtime.plan import RankPlan
from canzona.schedules.layout import EXPERT, DpBucket


@dataclass(frozen=True)
class DpComms:
    """The DP exchange's process groups (global ranks in group-rank order), its collective form
    (`comm.DP_COLLECTIVES`: "schedule", each bucket in its schedule's, or one for all) and the
    timeout of each wait."""

    dp_group: dist.ProcessGroup
    dp_ranks: tuple[int, ...]
    expert_group: dist.ProcessGroup | None
    expert_ranks: tuple[int, ...]
    mode: str
    timeout: timedelta | None

    def route(self, plan: RankPlan, bucket: DpBucket) -> tuple[dist.ProcessGroup, tuple[int, ...], int]:
        """A bucket's process group, its ranks' global ranks, and this rank's rank in it."""
        if bucket.kind == EXPERT:
            assert self.expert_group is not None
            return self.expert_group, self.expert_ranks, bucket.dp_ranks.index(plan.place.dp_rank)
        return self.dp_group, self.dp_ranks, plan.place.dp_rank


def start_bucket_reduce(plan: RankPlan, comms: DpComms, send: Tensor, index: int) -> comm.Pending:
    """Launch the DP mean of bucket `index` of `send`, in place: the slices this rank updates
    hold it once landed (every slice under DP-SC, which all-reduces)."""
    bucket = plan.layout.buckets[index]
    group, ranks, rank = comms.route(plan, bucket)
    kept = [p for p, r in enumerate(bucket.dp_ranks) if r in plan.ranks]
    mode = comm.ALL_REDUCE if plan.strategy.all_dp else comm.bucket_mode(bucket, comms.mode)
    return comm.start_reduce(send, bucket, mode, rank, group, ranks, kept, plan.place.dp_size)


def start_bucket_gather(plan: RankPlan, comms: DpComms, gathered: Tensor, index: int) -> comm.Pending:
    """Launch the gather of bucket `index` of `gathered`, whose slice of this rank holds its new
    values."""
    bucket = plan.layout.buckets[index]
    group, ranks, rank = comms.route(plan, bucket)
    return comm.start_gather(gathered, bucket, comm.bucket_mode(bucket, comms.mode), rank, group, ranks)
