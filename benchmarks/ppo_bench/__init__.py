"""The PPO step benchmark behind ``benchmarks/bench_ppo.py``, one concern a module.

- ``rows``: the table of rows and the entry point of the child process that runs one row;
  ``ours_row`` and ``torchtune_row`` time each recipe, ``device`` holds what both need.
- ``configs`` and ``random_model``: the configs the rows share (and the random-weight
  checkpoints of ``--gpu`` and ``--cpu-large``).
- ``running``: launching the rows, one fresh process each, within the time budgets.
- ``summary`` and ``report``: medians and speedups; markdown, JSON and chart.
"""
