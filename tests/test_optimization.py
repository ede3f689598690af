"""The optimiser groups and the schedule that the language-model trainer and the task runner share."""

import math

import pytest
import torch

from pathlab.training.optimization import adamw, autocast, warmup_cosine


def test_weight_decay_only_on_parameters_of_two_or_more_dimensions():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[2].weight.requires_grad_(False)  # frozen: in no group
    opt = adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[1].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].bias), id(model[2].bias)}


def test_warmup_then_cosine_clipped_to_the_floor():
    kw = dict(warmup=4, lr=1.0, min_lr=0.1)
    assert warmup_cosine(0, fraction=-1.0, **kw) == pytest.approx(1 / 5)
    assert warmup_cosine(3, fraction=-1.0, **kw) == pytest.approx(4 / 5)
    assert warmup_cosine(4, fraction=0.0, **kw) == pytest.approx(1.0)
    assert warmup_cosine(9, fraction=0.5, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert warmup_cosine(99, fraction=3.0, **kw) == pytest.approx(0.1)  # past the decay: the floor


def test_autocast_is_bf16_only_when_asked():
    x = torch.randn(4, 4)
    with autocast(torch.device("cpu"), True)():
        assert (x @ x).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), False)():
        assert (x @ x).dtype == torch.float32
