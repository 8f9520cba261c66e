"""SequenceModel.generate: greedy output equals the prefill-and-step loop exactly (KLA, attention,
hybrids, chunked prefill), sampling with temperature and top-k, bad arguments; on a GPU the steps
replayed from a CUDA graph equal the eager loop."""

from __future__ import annotations

import pytest
import torch

from kalmanscan.nn import SequenceModel


def model_of(mix, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    names = mix if isinstance(mix, list) else [mix, mix]
    kwargs = dict(n_heads=2) if {"attention", "gla", "gdn", "mlstm"} & set(names) else {}
    if "kla" in names and device == "cpu":
        kwargs["backend"] = "torch"                     # the prefill's scan: no compilation to wait for
    return SequenceModel(13, 16, len(names), mixer=names, d_state=4, dtype=dtype, device=device, **kwargs)


def prefill_and_step(model, prompt, n):
    """The greedy continuation by hand: one forward over the prompt, then ``model.step``."""
    with torch.no_grad():
        logits, state = model(prompt, state=model.init_state(prompt.shape[0], prompt.device))
        token = logits[:, -1].argmax(-1)
        out = [token]
        for _ in range(n - 1):
            logits, state = model.step(token, state)
            token = logits.argmax(-1)
            out.append(token)
    return torch.cat([prompt, torch.stack(out, 1)], 1)


@pytest.mark.parametrize("mix", ["kla", "attention", ["attention", "gla", "kla"]])
@pytest.mark.parametrize("chunk", [3, 2048])
def test_greedy_equals_prefill_and_step(mix, chunk):
    model = model_of(mix)
    prompt = torch.randint(0, 13, (3, 7))
    tokens = model.generate(prompt, 11, prefill_chunk=chunk)
    assert tokens.shape == (3, 18) and tokens.dtype == torch.long
    assert torch.equal(tokens, prefill_and_step(model, prompt, 11))


@pytest.mark.parametrize("mix", [["mamba", "gdn"], ["mlstm", "gru"]])
def test_mixers_stepping_into_copies(mix):
    """Mixers whose step returns a new state (copied into the state's tensors by generate)."""
    model = model_of(mix)
    prompt = torch.randint(0, 13, (2, 5))
    assert torch.equal(model.generate(prompt, 6, prefill_chunk=3), prefill_and_step(model, prompt, 6))


def test_few_new_tokens():
    model = model_of("kla")
    prompt = torch.randint(0, 13, (2, 5))
    assert torch.equal(model.generate(prompt, 0), prompt)
    assert torch.equal(model.generate(prompt, 1), prefill_and_step(model, prompt, 1))


def test_sampling():
    """A generator makes a draw reproducible; ``top_k=1`` is greedy; every draw is one of the
    ``top_k`` most likely tokens of its step; a high temperature draws other tokens than greedy."""
    model = model_of("kla")
    prompt = torch.randint(0, 13, (4, 6))

    def draw(seed, **kwargs):
        return model.generate(prompt, 8, generator=torch.Generator().manual_seed(seed), **kwargs)

    assert torch.equal(draw(0, temperature=1.0), draw(0, temperature=1.0))
    assert torch.equal(draw(0, temperature=1.0, top_k=1), model.generate(prompt, 8))
    assert not torch.equal(draw(1, temperature=100.0), model.generate(prompt, 8))
    tokens = draw(2, temperature=2.0, top_k=3)
    with torch.no_grad():
        logits = model(tokens[:, :-1])[:, 5:]
    allowed = logits.topk(3, -1).indices
    assert (allowed == tokens[:, 6:, None]).any(-1).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=torch.zeros(2, 0, dtype=torch.long)), "prompt"),
    (dict(prompt=torch.zeros(2, 3)), "prompt"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=14), "top_k"),
    (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(cuda_graph=True), "cuda_graph"),
])
def test_bad_arguments_raise(kwargs, match):
    args = dict(prompt=torch.zeros(2, 3, dtype=torch.long), max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        model_of("kla").generate(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["kla", "attention", ["attention", "gla", "kla"]])
def test_cuda_graph_equals_eager(mix):
    model = model_of(mix, device="cuda")
    prompt = torch.randint(0, 13, (4, 9), device="cuda")
    eager = model.generate(prompt, 20)
    assert torch.equal(model.generate(prompt, 20, cuda_graph=True), eager)
    assert torch.equal(eager, prefill_and_step(model, prompt, 20))
    torch.manual_seed(1)
    sampled = model.generate(prompt, 20, temperature=1.0, top_k=5, cuda_graph=True)
    assert sampled.shape == (4, 29) and ((sampled >= 0) & (sampled < 13)).all()
