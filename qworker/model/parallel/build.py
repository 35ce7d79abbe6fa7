"""One rank's model: the checkpoint read on the host, its shard moved to the device.

Every rank reads the whole checkpoint into host memory (the families check full shapes there)
and moves only its own slices to its device, so a device never holds more than its share; the
embedding, the final norm and (on the leader) the LM head are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from qworker.model.families import spec_for
from qworker.model.families.spec import dims
from qworker.model.parallel import shard as sh


@dataclass(slots=True)
class TPRank:
    rank: int
    world: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    def build_model(self, model_dir: str | Path, config, device: torch.device, dtype: torch.dtype, max_positions: int,
                    kernel_backend: str | None):
        from qworker.model.decoder import DecoderModel
        from qworker.model.loader import load_state_dict

        check_supported(config, self.world)
        weights = load_state_dict(model_dir, torch.device("cpu"), dtype, config)
        if device.type != "cpu":  # the replicated tensors; the layers move as they are sliced
            for name in [n for n in weights if not n.startswith("model.layers.")]:
                weights[name] = weights[name].to(device)
        sharder = sh.Sharder(dims(config), self.rank, self.world, device)
        model = DecoderModel(config, weights, device, dtype, max_positions, kernel_backend, shard=sharder)
        sh.wrap(model, self.all_reduce, leader=self.rank == 0)
        return model


def check_supported(config, world: int) -> None:
    """A ValueError naming why ``config`` cannot be split ``world`` ways (checked by the leader
    before any follower starts, and again by each rank)."""
    why = sh.unsupported(spec_for(config))
    if why is not None:
        raise ValueError(f"tensor_parallel_size={world} is not supported for {config.model_type}: {why}")
    sh.plan(dims(config), 0, world)  # raises for a head split that cannot work
