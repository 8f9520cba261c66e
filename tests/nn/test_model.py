"""SequenceModel and the mixer registry: every mixer's decoding, prefill and gradients, training, bad
input (the baselines' own recurrences: tests/nn/baselines/)."""

import pytest
import torch
import torch.nn.functional as F

from kalmanscan.nn import KLA, MIXERS, SequenceModel, register_mixer
from kalmanscan.nn.baselines.attention import CausalAttention
from kalmanscan.nn.baselines.gla import GatedLinearAttention
from kalmanscan.nn.baselines.ssm import SelectiveSSM
from kalmanscan.nn.model import SwiGLU

TOL = dict(rtol=1e-10, atol=1e-12)
NAMES = ["kla", "attention", "gla", "mamba", "gdn", "mlstm", "gru"]
KWARGS = {"kla": dict(backend="torch", d_state=4), "attention": dict(n_heads=2),
          "gla": dict(n_heads=2), "mamba": dict(d_state=4), "gdn": dict(n_heads=2, chunk_size=16),
          "mlstm": dict(n_heads=2, chunk_size=16), "gru": dict(expand=1.5),
          "gla+conv": dict(n_heads=2, d_conv=3), "kla+conv1": dict(backend="torch", d_state=4, d_conv=1)}
VARIANTS = NAMES + ["gla+conv", "kla+conv1"]


def mixer(name, d_model=8, seed=0):
    """The mixer ``name`` (a registry name, or ``name+option`` for a variant in KWARGS)."""
    torch.manual_seed(seed)
    return MIXERS[name.split("+")[0]](d_model, **KWARGS[name]).double()


def series(B=2, L=37, D=8, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, L, D, dtype=torch.float64)


@pytest.mark.parametrize("name", VARIANTS)
def test_mixer_decoding_and_chunked_prefill_equal_forward(name):
    m = mixer(name)
    x = series()
    y = m(x)
    assert y.shape == x.shape
    state = m.init_state(2)
    steps = []
    for t in range(x.shape[1]):
        y_t, state = m.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, 1), y, **TOL)
    state = m.init_state(2)
    chunks = []
    for lo, hi in [(0, 1), (1, 1), (1, 18), (18, 37)]:  # lengths 1, 0, 17 and 19 (chunks of 16)
        y_c, state = m(x[:, lo:hi], state=state)
        chunks.append(y_c)
    torch.testing.assert_close(torch.cat(chunks, 1), y, **TOL)
    assert m(x[:, :0]).shape == (2, 0, 8)


@pytest.mark.parametrize("name", VARIANTS)
def test_mixer_gradients_reach_every_parameter(name):
    m = mixer(name)
    m(series(L=9)).square().sum().backward()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_attention_is_causal():
    m = mixer("attention")
    x = series(L=12)
    x2 = x.clone()
    x2[:, 7:] = torch.randn_like(x2[:, 7:])
    torch.testing.assert_close(m(x)[:, :7], m(x2)[:, :7], **TOL)


@pytest.mark.parametrize("mix", ["kla", "attention", "gla", "mamba", ["attention", "gla", "kla"]])
def test_model_decoding_and_prefill_equal_forward(mix):
    torch.manual_seed(0)
    names = mix if isinstance(mix, list) else [mix, mix]
    kwargs = dict(backend="torch") if "kla" in names else {}
    if {"attention", "gla"} & set(names):
        kwargs["n_heads"] = 2
    model = SequenceModel(11, 8, len(names), mixer=names, d_state=4, dtype=torch.float64, **kwargs)
    tokens = torch.randint(0, 11, (2, 21))
    logits = model(tokens)
    assert logits.shape == (2, 21, 11) and logits.dtype == torch.float64
    state = model.init_state(2)
    steps = []
    for t in range(21):
        l_t, state = model.step(tokens[:, t], state)
        steps.append(l_t)
    torch.testing.assert_close(torch.stack(steps, 1), logits, **TOL)
    head, state = model(tokens[:, :13], state=model.init_state(2))
    tail, _ = model(tokens[:, 13:], state=state)
    torch.testing.assert_close(torch.cat([head, tail], 1), logits, **TOL)


def test_hybrid_builds_the_named_mixers():
    model = SequenceModel(7, 8, 3, mixer=["attention", "attention", "kla"], n_heads=2,
                          variant="mamba")
    kinds = [type(b.mixer) for b in model.blocks]
    assert kinds == [CausalAttention, CausalAttention, KLA]
    assert model.blocks[2].mixer.variant == "mamba" and model.blocks[0].mixer.n_heads == 2
    assert isinstance(SequenceModel(7, 8, 1, mixer="gla").blocks[0].mixer, GatedLinearAttention)
    assert isinstance(SequenceModel(7, 8, 1, mixer="mamba").blocks[0].mixer, SelectiveSSM)


def test_register_mixer_plugs_into_the_model():
    @register_mixer("identity_for_test")
    class Identity(torch.nn.Module):
        def __init__(self, d_model, device=None, dtype=None):
            super().__init__()

        def forward(self, x, state=None):
            return x if state is None else (x, state)

    try:
        model = SequenceModel(5, 8, 2, mixer="identity_for_test")
        assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 5)
    finally:
        MIXERS.pop("identity_for_test")


def test_tiny_model_overfits_a_toy_sequence():
    """Random tokens: the next token depends on the context, so only the mixer can fit them."""
    torch.manual_seed(0)
    vocab, L = 12, 48
    tokens = torch.randint(0, vocab, (1, L + 1))
    model = SequenceModel(vocab, 32, 2, mixer="kla", d_state=4, backend="torch")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):          # the loss passes 0.05 at step 16 and is 0.007 at step 25
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 2.0 and losses[-1] < 0.05, (losses[0], losses[-1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(mixer="transformer"), "unknown"),
    (dict(mixer=["kla", "attention", "kla"]), "n_layers"),
    (dict(mixer="attention", variant="plain"), "variant"),
    (dict(mixer="kla", n_heads=2), "n_heads"),
    (dict(n_layers=0), "n_layers"),
    (dict(mixer="attention", n_heads=3), "n_heads"),
    (dict(mixer="gla", n_heads=3), "n_heads"),
    (dict(mixer="gla", d_conv=-1), "d_conv"),
    (dict(mixer="mamba", expand=1.3), "expand"),
    (dict(mlp_ratio=0.0), "mlp_ratio"),
    (dict(mlp_multiple_of=0), "multiple_of"),
])
def test_bad_arguments_raise(kwargs, match):
    args = dict(vocab_size=10, d_model=8, n_layers=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SequenceModel(**args)


def test_swiglu_hidden_width_rounds_up_to_its_multiple():
    assert SwiGLU(512, multiple_of=1).w_out.in_features == 1365   # int(8 * 512 / 3)
    assert SwiGLU(512).w_in.out_features == 2 * 1408               # the default multiple, 64
    model = SequenceModel(10, 128, 1, mixer="attention", n_heads=2)
    assert model.blocks[0].mlp.w_out.in_features == 384            # 341 rounded up
    model = SequenceModel(10, 128, 1, mixer="attention", n_heads=2, mlp_multiple_of=1)
    assert model.blocks[0].mlp.w_out.in_features == 341
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 10)


def test_bad_tokens_raise():
    model = SequenceModel(10, 8, 1, mixer="attention", n_heads=2)
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="token"):
        model.step(torch.zeros(3, 1, dtype=torch.long), model.init_state(3))
    with pytest.raises(ValueError, match="name"):
        register_mixer("")
    deep = SequenceModel(10, 8, 2, mixer="attention", n_heads=2)
    with pytest.raises(ValueError, match="state must be a list of 2"):
        deep.step(torch.zeros(3, dtype=torch.long), deep.init_state(3)[:1])
    with pytest.raises(ValueError, match="state must be a list of 2"):
        deep(torch.zeros(3, 4, dtype=torch.long), deep.init_state(3)[:1])
