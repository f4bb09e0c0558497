"""A torchtitan ``config_registry`` module for ``test_torchtitan.py``: what a user writes to
select tierckpt (``--module tests.integrations.titan_configs --config tierckpt``).

``Job`` stands in for ``torchtitan.trainer.Trainer.Config``, which cannot be imported here
(``torchtitan.trainer`` imports tensorboard); it has the fields ``ConfigManager`` and the
checkpointer read, with the same ``checkpoint`` annotation and default as the Trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager

from tierckpt.integrations.torchtitan import tierckpt_config


@dataclass(kw_only=True, slots=True)
class Job:
    hf_assets_path: str = "."
    dump_folder: str = "./outputs"
    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def stock() -> Job:
    """A model's stock config, as torchtitan's registries write it."""
    return Job(checkpoint=CheckpointManager.Config(interval=10, keep_latest_k=5,
                                                   last_save_model_only=False))


def tierckpt() -> Job:
    """The same job with tierckpt: the one changed line."""
    config = stock()
    config.checkpoint = tierckpt_config(config.checkpoint, enable=True)
    return config
