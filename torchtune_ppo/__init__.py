"""Building blocks of the fast PPO recipe for torchtune."""

from pathlib import Path

from omegaconf import OmegaConf

ASSETS_DIR = Path(__file__).parent / "assets"


def asset_path(name: str = "") -> str:
    """Absolute path of a file or folder shipped in ``torchtune_ppo/assets``."""
    path = ASSETS_DIR / name
    if not path.exists():
        raise FileNotFoundError(
            f"ppo_asset: {name!r} is not in {ASSETS_DIR}; shipped assets: "
            f"{sorted(p.name for p in ASSETS_DIR.iterdir()) if ASSETS_DIR.exists() else []}"
        )
    return str(path)


# Configs name shipped files as ${ppo_asset:tiny_sentiment/tokenizer.model} so that they
# work from any directory and from a plain (non-editable) install.
if not OmegaConf.has_resolver("ppo_asset"):
    # omegaconf 2.4 renamed register_new_resolver; 2.3 only has the old name.
    _register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    _register("ppo_asset", asset_path)
