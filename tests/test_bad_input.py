"""Bad input raises a ValueError that names the argument and what was expected."""

import pytest
import torch

import pathlab
from pathlab import ModelConfig, build_model, reference
from pathlab.testing import random_path_inputs


def _path_inputs(**kw):
    return random_path_inputs(1, 8, 2, 4, gate=True, **kw)


def _replace(inputs, name, value):
    names = ["q", "k", "v", "w", "beta", "g"]
    out = list(inputs)
    out[names.index(name)] = value
    return out


@pytest.mark.parametrize("fn", [pathlab.path_attention, reference.path_attention], ids=["fast", "reference"])
@pytest.mark.parametrize("name,bad,message", [
    ("q", torch.randn(8, 2, 4), "q must have 4 dimensions"),
    ("k", torch.randn(1, 9, 2, 4), "share batch and length"),
    ("k", torch.randn(1, 8, 2, 6), "head dim of q"),
    ("v", torch.randn(1, 8, 1, 4), "v must have as many heads as k"),
    ("k", torch.randn(1, 8, 3, 4), "multiple of the key/value heads"),
    ("w", torch.randn(1, 8, 2, 3), "w must have the shape of k"),
    ("beta", torch.rand(1, 8, 3), "beta must have shape"),
    ("g", torch.zeros(1, 8), "g must have 3 dimensions"),
    ("q", torch.randint(0, 3, (1, 8, 2, 4)), "q must be a floating-point tensor"),
    ("w", torch.randn(1, 8, 2, 4, device="meta"), "w is on meta"),
    ("q", [[1.0]], "q must be a torch.Tensor"),
])
def test_path_attention_rejects(fn, name, bad, message):
    inputs = _path_inputs()
    if name == "k" and bad.shape[2] != 2:  # keep v consistent so the k check is what fails
        inputs = _replace(inputs, "v", torch.randn(*bad.shape[:3], 4))
        inputs = _replace(inputs, "w", torch.randn(*bad.shape))
        inputs = _replace(inputs, "beta", torch.rand(*bad.shape[:3]))
    with pytest.raises(ValueError, match=message):
        fn(*_replace(inputs, name, bad))


def test_beta_and_gate_values_are_checked_by_the_reference_and_in_debug_mode(monkeypatch):
    q, k, v, w, beta, g = _path_inputs()
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
        reference.path_attention(q, k, v, w, beta + 2.5, g)
    with pytest.raises(ValueError, match="g must be finite log forget gates <= 0"):
        reference.path_attention(q, k, v, w, beta, g.abs() + 0.1)
    pathlab.path_attention(q, k, v, w, beta + 2.5, g, backend="torch")  # no synchronising check by default
    monkeypatch.setenv("PATHLAB_DEBUG", "1")
    with pytest.raises(ValueError, match="beta must lie"):
        pathlab.path_attention(q, k, v, w, beta + 2.5, g, backend="torch")
    # under torch.compile the synchronising check stays out of the graph (fullgraph must not break on it)
    compiled = torch.compile(lambda *xs: pathlab.path_attention(*xs, backend="torch"), backend="eager", fullgraph=True)
    assert torch.isfinite(compiled(q, k, v, w, beta, g)).all()


def test_backend_and_scale_are_checked():
    inputs = _path_inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        pathlab.path_attention(*inputs, backend="cuda")
    with pytest.raises(ValueError, match="needs CUDA tensors|unavailable"):
        pathlab.path_attention(*inputs, backend="triton")
    with pytest.raises(ValueError, match="scale must be a positive number"):
        pathlab.path_attention(*inputs, scale=-1.0)


@pytest.mark.parametrize("call,message", [
    (lambda q, k, v: pathlab.rotation_attention(q, k, v, torch.zeros(1, 8, 2, 3)), "theta must have shape"),
    (lambda q, k, v: pathlab.fox_attention(q, k, v, torch.zeros(1, 8, 3)), "g must have shape"),
    (lambda q, k, v: pathlab.alibi_attention(q, k, v, slopes=torch.ones(3)), "slopes must have shape"),
    (lambda q, k, v: pathlab.rope_attention(q[..., :3], k[..., :3], v), "even head dim"),
    (lambda q, k, v: pathlab.nope_attention(q, k.double(), v), "share a dtype"),
])
def test_softmax_ops_reject(call, message):
    q, k, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=message):
        call(q, k, v)


@pytest.mark.parametrize("kwargs,message", [
    (dict(attention="xpos"), "unknown attention 'xpos'; known: nope, rope"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(n_embd=30, n_head=4), "must be a multiple of n_head"),
    (dict(n_kv_head=3), "n_kv_head must divide n_head"),
    (dict(dropout=1.5), "dropout must be in"),
    (dict(attention="path", attention_kwargs={"beta_max": 2.5}), r"beta_max must be a number in \(0, 2\]"),
    (dict(attention="rope", attention_kwargs={"bsae": 10}), r"does not take \['bsae'\]; its options are \['base'\]"),
    (dict(attention="rot_random_qk", attention_kwargs={"table": "hash"}), "table must be 'token'"),
    (dict(attention="rope", n_embd=36, n_head=4), "needs an even head dim"),
])
def test_model_config_rejects(kwargs, message):
    cfg = dict(n_layer=1, n_head=4, n_embd=32, vocab_size=11)
    cfg.update(kwargs)
    with pytest.raises(ValueError, match=message):
        build_model(ModelConfig(**cfg))


def test_config_dicts_and_model_inputs_are_checked():
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys \['n_layers'\]"):
        ModelConfig.from_dict({"n_layers": 2})
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11))
    with pytest.raises(ValueError, match="idx must be an integer tensor"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative integer"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), -1)


def test_token_ids_outside_the_vocabulary_are_refused():
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11))
    ok = torch.randint(0, 11, (2, 5))
    targets = ok.clone()
    targets[0, 0] = -1  # -1 marks an ignored target
    model(ok, targets)
    with pytest.raises(ValueError, match=r"idx holds token ids in \[11, 11\]; the model's vocabulary is \[0, 11\)"):
        model(torch.full((2, 5), 11))
    with pytest.raises(ValueError, match=r"idx holds token ids in \[-2, "):
        model(torch.full((2, 5), -2))
    with pytest.raises(ValueError, match=r"targets holds token ids in \[.*, 12\]"):
        model(ok, torch.full((2, 5), 12))
    with pytest.raises(ValueError, match="idx holds token ids"):
        model.generate(torch.full((1, 3), 40), 2)
