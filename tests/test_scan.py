"""The generic associative scan against a sequential loop, with a non-commutative combine."""

import pytest
import torch

from kalmanscan.model import mobius
from kalmanscan.model.scan import associative_scan


def matmul_combine(earlier, later):
    (m1,), (m2,) = earlier, later
    return (m2 @ m1,)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 63, 64, 1000])
@pytest.mark.parametrize("reverse", [False, True])
def test_matrix_product_scan(T, reverse):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(3, T, 2, 2, dtype=torch.float64, generator=g) / 1.5
    (out,) = associative_scan(matmul_combine, (x.movedim(1, 0),), dim=0, reverse=reverse)
    out = out.movedim(0, 1)
    order = range(T - 1, -1, -1) if reverse else range(T)
    acc, ref = None, torch.empty_like(x)
    for t in order:
        acc = x[:, t] if acc is None else x[:, t] @ acc
        ref[:, t] = acc
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def _affine_loop(f, b, reverse):
    order = range(f.shape[-2] - 1, -1, -1) if reverse else range(f.shape[-2])
    eta, out = torch.zeros_like(f[..., 0, :]), [None] * f.shape[-2]
    for t in order:
        eta = f[..., t, :] * eta + b[..., t, :]
        out[t] = eta
    return torch.stack(out, -2)


def test_affine_scan_matches_recursion():
    g = torch.Generator().manual_seed(0)
    f = torch.rand(4, 77, 3, dtype=torch.float64, generator=g)
    b = torch.randn(4, 77, 3, dtype=torch.float64, generator=g)
    F, B = associative_scan(mobius.affine_compose, (f, b), dim=-2)
    torch.testing.assert_close(B, _affine_loop(f, b, reverse=False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 64, 65])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_gradients_match_the_loop(T, reverse):
    """Backward through the split/unbind views of every level, odd and even lengths alike: the
    gradients equal the sequential loop's, and gradcheck passes in float64."""
    g = torch.Generator().manual_seed(100 + T)
    f = torch.rand(2, T, 3, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(2, T, 3, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(2, T, 3, dtype=torch.float64, generator=g)

    def scan(f, b):
        return associative_scan(mobius.affine_compose, (f, b), dim=-2, reverse=reverse)[1]

    grads = torch.autograd.grad((scan(f, b) * w).sum(), (f, b), materialize_grads=True)
    ref = torch.autograd.grad((_affine_loop(f, b, reverse) * w).sum(), (f, b))
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(scan, (f, b))


def test_mobius_products_are_rescaled_powers_of_two():
    g = torch.Generator().manual_seed(1)
    a, q, phi = (torch.rand(5000, 1, dtype=torch.float64, generator=g) + 0.5 for _ in range(3))
    P = associative_scan(mobius.compose, mobius.leaf(a, q, phi), dim=0)
    trace = P[0] + P[3]
    assert torch.all(torch.isfinite(torch.stack(P))) and torch.all(trace < 4) and torch.all(torch.stack(P) >= 0)
    lam, ref = mobius.readout(P, 1.0), []
    x = torch.ones(1, dtype=torch.float64)
    for t in range(5000):
        x = x / (a[t] ** 2 + q[t] * x) + phi[t]
        ref.append(x)
    torch.testing.assert_close(lam, torch.stack(ref), rtol=1e-13, atol=0)
