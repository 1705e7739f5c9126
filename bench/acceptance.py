"""Acceptance length of a trained drafter vs an untrained one of the same shape, on held-out example prompts.

    python -m bench.acceptance --drafter runs/runs/<run>/drafter [--limit 32] [--max-new-tokens 2048]

Held-out prompts are fresh conversations from the example corpus generator (a seed the assets never use),
so none of them was seen in training; every user turn is answered in order (`dflash eval`'s protocol). Prints
one JSON object: both taus (mean of per-response means, and pooled over steps) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from dflash_core.example import build_example
from dflash_core.example.corpus import generate_conversations
from dflash_core.io import write_jsonl
from dflash_core.model.config import DRAFT_SETTINGS, ModelConfig
from dflash_core.model.drafter import build_drafter
from dflash_core.model.evaluate import evaluate
from dflash_core.model.export import config_layout, save_dflash
from dflash_core.model.target import load_target

HELD_OUT_SEED = 424242


def untrained_like(drafter_dir: str, target: str, out: str, seed: int = 0) -> str:
    """A random-init drafter with the trained one's shape, exported like it."""
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    layout = config_layout(cfg)
    model_cfg = ModelConfig(target=target, num_draft_layers=cfg["num_hidden_layers"], block_size=cfg["block_size"],
                            target_layer_ids=cfg["dflash_config"]["target_layer_ids"],
                            **{DRAFT_SETTINGS[key]: value for key, value in layout.items()},
                            layer_types=cfg.get("layer_types"), sliding_window=cfg.get("sliding_window") or 2048)
    torch.manual_seed(seed)
    drafter = build_drafter(load_target(target), model_cfg, cfg["dflash_config"]["mask_token_id"])
    save_dflash(drafter, out)
    return out


def main() -> None:
    """Evaluate both drafters on the same held-out prompts and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="trained drafter folder (config.json + model.safetensors)")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    assets = build_example()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "held-out.jsonl"
        write_jsonl(str(prompts), generate_conversations(args.limit, seed=HELD_OUT_SEED), sort_keys=True)
        kwargs = {"target": assets.target, "tokenizer": assets.tokenizer, "data": str(prompts),
                  "limit": args.limit, "max_new_tokens": args.max_new_tokens, "device": "cpu"}
        trained = evaluate(drafter_dir=args.drafter, **kwargs)
        baseline = evaluate(drafter_dir=untrained_like(args.drafter, assets.target, f"{tmp}/untrained"), **kwargs)
    print(json.dumps({"instances": trained["instances"], "responses": trained["responses"],
                      "tau_trained": trained["tau"], "tau_untrained": baseline["tau"],
                      "ratio": trained["tau"] / baseline["tau"], "tau_pooled_trained": trained["tau_pooled"],
                      "tau_pooled_untrained": baseline["tau_pooled"],
                      "histogram_trained": trained["histogram"], "histogram_untrained": baseline["histogram"]}))


if __name__ == "__main__":
    main()
