"""``pathlab info``: the registered attention variants, their options and parameter counts."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paper", action="store_true",
                        help="count parameters at the paper setting (16 layers, width 768, 12 heads)")


def parameter_counts(paper: bool = False) -> dict[str, tuple[int, int]]:
    """{variant: (total, non-embedding)} for the paper setting or a small default model."""
    import torch

    from pathlab.attention.registry import available_attention
    from pathlab.model import ModelConfig, build_model

    counts = {}
    for name in available_attention():
        cfg = ModelConfig.paper(name) if paper else ModelConfig(attention=name)
        with torch.device("meta"):
            model = build_model(cfg)
        counts[name] = (model.num_parameters(), model.num_parameters(non_embedding=True))
    return counts


def run(args) -> int:
    from pathlab.attention.registry import attention_options, describe_attention

    descriptions = describe_attention()
    print(f"{'variant':17s} {'params':>12s} {'non-emb':>12s}  description / options")
    for name, (total, non_emb) in parameter_counts(args.paper).items():
        print(f"{name:17s} {total:12,d} {non_emb:12,d}  {descriptions[name]}")
        options = attention_options(name)
        if options:
            print(" " * 45 + "options: " + ", ".join(f"{k}={v!r}" for k, v in options.items()))
    return 0
