"""Embedded PPO tasks that run with no downloads, one folder each.

A task folder ``tasks/<name>/`` holds:

- ``__init__.py``: what the recipe needs at run time (the model and tokenizer builders
  that configs name as ``_component_``, and the constants they use). Nothing else, so
  that importing a task stays cheap.
- ``assets/``: the shipped files (tokenizer, Hugging Face checkpoint folders, prompts,
  ``README.md`` and ``MANIFEST.json`` with the sha256 of every file). Configs name them
  as ``${ppo_asset:<name>/<file>}``.

How the assets were made (data, tokenizer training, pretraining, export) and their check
are build tools, not shipped: ``tools/tasks/build_<name>.py build|check`` in the repository.
"""
