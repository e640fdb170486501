"""Two ranks in one process, for library code that all-reduces: two threads stand in for the
ranks, and ``distributed.all_reduce_sum`` adds the tensors both threads pass."""

import threading
from typing import Any, Callable, List

from torchtune_ppo import distributed


def on_two_ranks(monkeypatch, work: Callable[[int], Any]) -> List[Any]:
    """Runs ``work(rank)`` for ranks 0 and 1 at once, in a world of 2 whose
    ``all_reduce_sum`` returns the sum of both ranks' tensors; returns ``[work(0), work(1)]``
    (None for a rank that raised or hung for a minute)."""
    barrier, shared, rank_of, results = threading.Barrier(2), [None, None], {}, [None, None]

    def all_reduce_sum(x):  # both threads' x, summed
        r = rank_of[threading.get_ident()]
        shared[r] = x.clone()
        barrier.wait()
        total = shared[0] + shared[1]
        barrier.wait()
        return total

    def rank(r):
        rank_of[threading.get_ident()] = r
        results[r] = work(r)

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results
