"""``bench_model --cuda-graph``: the captured step is the training step, replayed."""

import pytest
import torch

from benchmarks.bench_model import build, graphed, training_step


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", ["kla", "attention"])
def test_graphed_step_trains_as_the_eager_step(mixer):
    """Replays of the captured step (zero_grad, forward, loss, backward, capturable fused AdamW)
    give the losses and parameters of the same number of eager steps."""
    models, optimizers = [], []
    for capturable in (True, False):
        torch.manual_seed(0)
        model = build(mixer, 64, 2, 128, "cuda")
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=capturable))
    tokens = torch.randint(0, 128, (2, 65), device="cuda")
    replay = graphed(lambda: training_step(models[0], optimizers[0], tokens, "cuda"), warmup=2)
    eager = [training_step(models[1], optimizers[1], tokens, "cuda").detach() for _ in range(2)]
    losses = [replay().clone() for _ in range(3)]
    eager += [training_step(models[1], optimizers[1], tokens, "cuda").detach() for _ in range(3)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager[2:]), rtol=1e-4, atol=1e-5)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
