"""What every benchmark here shares: rows measured interleaved, ratios over pairs, machine state.

- ``stats``: per-pair ratios and the distribution-free interval of their median.
- ``interleave``: the driver that runs one step of each row in turn (A B, B A, ...) until the
  ratios' intervals are narrow or a step cap is hit.
- ``protocol``: long-lived worker processes (one per row, or one per rank of a row), driven one
  step at a time over line-delimited JSON on their stdin and stdout.
- ``machine``: CPU model, versions, commit, load averages, the CPU time other processes used
  during the measured steps, and whether a result may stand as a headline.

Scripts put ``benchmarks/`` on ``sys.path`` to import it (see ``benchmarks/ppo/bench_ppo.py``).
"""
