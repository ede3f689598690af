"""The decoder with every registered variant: learning, causality, cached generation, attention records."""

import pytest
import torch

import pathlab
from pathlab import ModelConfig, build_model
from pathlab.testing import assert_cached_generation_matches, train_on_repeated_pattern

VARIANTS = pathlab.available_attention()
VOCAB = 61


def _model(name, **kw):
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, attention=name)
    cfg.update(kw)
    return build_model(ModelConfig(**cfg))


def test_registry_lists_the_ten_variants():
    assert set(VARIANTS) >= {"nope", "rope", "alibi", "fox", "path", "path_fox", "rot_random_qk", "rot_random_qkv",
                             "rot_learned_qk", "rot_learned_qkv"}


@pytest.mark.parametrize("name", VARIANTS)
def test_loss_falls_on_a_learnable_sequence(name):
    losses = train_on_repeated_pattern(_model(name), 12)
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("name", VARIANTS)
def test_causality_and_reference_records(name):
    model = _model(name).double()
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (2, 23), generator=gen)
    logits, _ = model(idx)
    changed = idx.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % VOCAB
    logits_changed, _ = model(changed)
    assert torch.allclose(logits[:, :15], logits_changed[:, :15], atol=1e-10)
    assert not torch.allclose(logits[:, 15:], logits_changed[:, 15:])
    ref_logits, _, records = model(idx, return_attention=True)
    assert len(records) == 2 and records[0].probs.shape == (2, 4, 23, 23)
    assert torch.allclose(ref_logits, logits, atol=1e-9)
    assert torch.allclose(records[1].probs.sum(-1), torch.ones(2, 4, 23, dtype=torch.float64))


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_generation_matches_full_recompute(name):
    # the tokens, and the logits at every generated position, not only their argmax
    assert_cached_generation_matches(_model(name, n_kv_head=2).double().eval(), VOCAB)


def test_parameter_counts_of_the_paper_setting():
    from pathlab.info import parameter_counts

    counts = parameter_counts(paper=True)
    total, non_embedding = counts["rope"]
    assert total == 151_905_024 and non_embedding == 113_271_552  # nanoGPT's GPT-2 small count, 16 layers, no wpe
    assert counts["path"][0] > total and counts["nope"] == counts["rope"]


def test_learned_rotation_starts_as_rope():
    rot, rope = _model("rot_learned_qk"), _model("rope")
    rot.load_state_dict(rope.state_dict(), strict=False)
    idx = torch.randint(0, VOCAB, (1, 30))
    assert torch.allclose(rot(idx)[0], rope(idx)[0], atol=1e-5)


@pytest.mark.parametrize("conv_size", [1, 3, 4])
@pytest.mark.parametrize("with_tail", [False, True])
def test_path_short_convolution_matches_conv1d(conv_size, with_tail):
    """PaTH's causal depthwise convolution (K shifted products) equals ``F.conv1d(groups=C)`` over the
    tail-padded window, then SiLU, in fp64; with and without the generation tail."""
    import torch.nn.functional as F

    from pathlab.attention.path import PaTH

    torch.manual_seed(conv_size)
    attn = PaTH(conv_size=conv_size, n_embd=32, n_head=2, n_kv_head=2, head_dim=16, vocab_size=64,
                layer_idx=0).double()
    x = torch.randn(2, 9, attn.w_conv.shape[0], dtype=torch.float64)
    tail = torch.randn(2, conv_size - 1, x.shape[-1], dtype=torch.float64) if with_tail else None
    got = attn._conv(x, tail)
    pad = tail if with_tail else x.new_zeros(2, conv_size - 1, x.shape[-1])
    window = torch.cat((pad, x), dim=1).transpose(1, 2)
    want = F.silu(F.conv1d(window, attn.w_conv[:, None, :], groups=x.shape[-1]).transpose(1, 2))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
