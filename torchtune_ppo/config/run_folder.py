"""Where a run's output folder keeps its saved configs: ``<output_dir>/checkpoints/step_<N>/config.yaml``.

The checkpoint store (``torchtune_ppo.checkpointing``) writes these folders and imports the names
from here; validation reads the saved config before the store is built (``dtype: auto`` keeps the
saved dtype on resume: ``config.precision``), and ``checkpointing`` imports ``config``, so the
names live below both.
"""

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from omegaconf import OmegaConf

CHECKPOINTS_DIRNAME = "checkpoints"
CONFIG_FNAME = "config.yaml"  # the run's resolved config (checked on resume: checkpointing/resume_config.py)
STEP_RE = re.compile(r"^step_(\d+)$")


def step_folders(output_dir: Union[str, Path]) -> List[Tuple[int, Path]]:
    """``[(N, path)]`` of every ``<output_dir>/checkpoints/step_<N>`` folder, complete or not
    (nothing in them is read), sorted by N; folders set aside (``step_<N>.damaged-<time>``) and
    temporary ones are not counted."""
    root = Path(output_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    found = [(STEP_RE.match(p.name), p) for p in root.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m is not None and p.is_dir())


def saved_config(checkpoint: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """The config a checkpoint was saved with, or None for a checkpoint of the older format."""
    path = Path(checkpoint) / CONFIG_FNAME
    if not path.is_file():
        return None
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
