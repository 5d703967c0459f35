"""What the peers benchmark decides before anything trains: the drafter every row trains (written by our exporter
in both peers' formats), the peers asked for, and the disk the peers' features may use."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from common.drafter.export import export_speculators, export_zlab
from common.drafter.model import build_drafter
from common.drafter.target_head import load_target_head
from launch.bench.peers.common import DraftShape, Peer

SPECFORGE_BYTES_PER_TOKEN_LAYER = 2
"""bf16: a token's feature costs 2 bytes per hidden unit per captured layer."""
DISK_HEADROOM = 0.9
"""The share of the free disk the peers' features may take (their checkpoints and exports need the rest)."""


def draft_shape(cfg, folder: Path) -> DraftShape:
    """The preset's drafter on ``cfg``'s target, untrained, exported by our exporter into ``folder``/zlab and
    ``folder``/speculators (bf16)."""
    from producer.target_model.load import build_target_config
    from trainer.build import draft_config_for

    target_dir = Path(cfg.target.path)
    target_config = build_target_config(cfg.target)
    config = draft_config_for(cfg, target_config, target_dir)
    torch.manual_seed(0)
    drafter = build_drafter(config, load_target_head(target_dir, dtype=torch.bfloat16))
    architectures = list(getattr(target_config, "architectures", None) or [])
    return DraftShape(
        config=config,
        zlab_dir=export_zlab(drafter, folder / "zlab"),
        speculators_dir=export_speculators(drafter, folder / "speculators", str(target_dir), architectures),
        target_dir=target_dir,
        num_target_layers=int(target_config.num_hidden_layers),
    )


def bytes_per_token(draft: DraftShape, hidden_size: int, extra_layers: int = 1) -> int:
    """The most a peer's features cost a token on disk: the target layers (and speculators' last one) in bf16."""
    return (len(draft.target_layer_ids) + extra_layers) * hidden_size * SPECFORGE_BYTES_PER_TOKEN_LAYER


def default_max_tokens(folder: Path, per_token: int) -> int:
    """The tokens whose features fit ``DISK_HEADROOM`` of the disk free under ``folder`` at ``per_token`` bytes (the
    peers run one after the other, each deleting its features before the next dumps)."""
    folder.mkdir(parents=True, exist_ok=True)
    return int(shutil.disk_usage(folder).free * DISK_HEADROOM) // per_token


def pick_peers(names: list[str], known: dict[str, Peer]) -> tuple[list[Peer], list[str]]:
    """(the peers asked for that are set up, one line for each that is not). KeyError naming an unknown name."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise KeyError(f"unknown peer {', '.join(unknown)}; known: {', '.join(known)}")
    ready, missing = [], []
    for name in names:
        line = known[name].missing()
        (missing.append(line) if line else ready.append(known[name]))
    return ready, missing
