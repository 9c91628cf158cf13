"""Which prefill workers a decode worker pulls from when the two engines run tensor parallelism
of different degrees (free of vLLM). Worker r of an engine of TP t holds KV heads
[r x H / t, (r + 1) x H / t) of the model's H; a decode worker pulls from every prefill worker
whose heads overlap its own, and each pull moves the heads both hold (torch_p2p.kv slices them).
One degree must divide the other, as with NixlConnector; heads replicated over workers (TP
larger than H) are not handled."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sources:
    ranks: list[int]  # the prefill workers to pull from
    readers: int  # decode workers that pull from each of them


def sources(rank: int, tp: int, remote_tp: int, kv_heads: int) -> Sources:
    """The prefill workers (of an engine of TP `remote_tp`) that decode worker `rank` (of TP
    `tp`) pulls from, for a model of `kv_heads` KV heads."""
    if not 0 <= rank < tp or remote_tp < 1:
        raise ValueError(f"rank {rank} of tensor parallelism {tp}, remote tensor parallelism {remote_tp}")
    if max(tp, remote_tp) % min(tp, remote_tp):
        raise ValueError(f"tensor parallelism {tp} here and {remote_tp} on the prefill side: one must divide "
                         "the other")
    if kv_heads % max(tp, remote_tp):
        raise ValueError(f"{kv_heads} KV heads do not split over tensor parallelism {max(tp, remote_tp)} "
                         "(replicated heads are not supported)")
    if tp >= remote_tp:
        return Sources([rank * remote_tp // tp], tp // remote_tp)
    per = remote_tp // tp
    return Sources(list(range(rank * per, (rank + 1) * per)), 1)
