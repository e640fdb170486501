"""The PPO step benchmark behind ``benchmarks/ppo/bench_ppo.py``, one concern a module.

- ``rows``: the table of rows and the worker process that runs one row, a step per command;
  ``ours_row`` and ``torchtune_row`` time each recipe, ``device`` holds what both need.
- ``configs`` and ``random_model``: the configs the rows share (and the random-weight
  checkpoints of ``--gpu`` and ``--cpu-large``).
- ``running``: starting the workers, then stepping them interleaved within the time budgets
  (the driver itself is ``benchmarks/bench_common``).
- ``summary`` and ``report``: medians and per-pair ratios; markdown, JSON and chart.
"""
