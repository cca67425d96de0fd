"""The server's optimizers against torch.optim on the same gradient sequence."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aps import _core, _reference  # noqa: E402
from aps.server.engine.optim import SGD, Adam, AdamW, make_optimizer  # noqa: E402

STEPS = 40
N = 1031  # odd, so vector loops end with a remainder


def run_aps(optimizer_cls, kernels, w0, grads, out_of_place=True, **options):
    opt = optimizer_cls(len(w0), kernels=kernels, **options)
    w = w0.copy()
    for g in grads:
        out = np.empty_like(w) if out_of_place else w
        assert opt.step(out, w, g)
        opt.commit()
        w = out
    return w


def run_torch(optimizer_cls, w0, grads, **options):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = optimizer_cls([p], **options)
    for g in grads:
        opt.zero_grad()
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy()


def assert_matches(cls, ours, theirs):
    """SGD equals torch bit for bit; Adam to float rounding (torch orders its ops differently)."""
    if cls is SGD:
        np.testing.assert_array_equal(ours, theirs)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.fixture
def problem():
    rng = np.random.default_rng(1234)
    w0 = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(STEPS)]
    return w0, grads


SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.1},
    {"lr": 0.1, "weight_decay": 1e-2},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4},
]


@pytest.mark.parametrize("options", SGD_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("out_of_place", [True, False], ids=["out-of-place", "in-place"])
def test_sgd_equals_torch(problem, kernels, options, out_of_place):
    w0, grads = problem
    ours = run_aps(SGD, kernels, w0, grads, out_of_place, **options)
    theirs = run_torch(torch.optim.SGD, w0, grads, **options)
    # bit for bit: fused multiply-adds exactly where torch's CPU kernels use them
    np.testing.assert_array_equal(ours, theirs)


ADAM_CASES = [
    {"lr": 1e-3},
    {"lr": 1e-2, "betas": (0.8, 0.99)},
    {"lr": 1e-3, "weight_decay": 1e-2},
    {"lr": 1e-3, "betas": (0.3, 0.9), "eps": 1e-6},
]


@pytest.mark.parametrize("options", ADAM_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("ours, theirs", [(Adam, "Adam"), (AdamW, "AdamW")], ids=["adam", "adamw"])
def test_adam_equals_torch(problem, kernels, options, ours, theirs):
    w0, grads = problem
    mine = run_aps(ours, kernels, w0, grads, **options)
    reference = run_torch(getattr(torch.optim, theirs), w0, grads, **options)
    np.testing.assert_allclose(mine, reference, rtol=1e-5, atol=1e-6)


def test_scale_is_applied_before_the_optimizer(problem):
    """step(scale=s) equals torch.optim fed s * g: momentum and Adam state stay consistent."""
    w0, grads = problem
    scales = [1.0 / (1 + i % 4) for i in range(STEPS)]
    for cls, torch_cls, options in [
        (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        (Adam, torch.optim.Adam, {"lr": 1e-3}),
    ]:
        opt = cls(N, kernels=_core, **options)
        w = w0.copy()
        for g, s in zip(grads, scales):
            out = np.empty_like(w)
            assert opt.step(out, w, g, s)
            opt.commit()
            w = out
        expected = run_torch(torch_cls, w0, [g * np.float32(s) for g, s in zip(grads, scales)], **options)
        assert_matches(cls, w, expected)


def test_make_optimizer_validates():
    from aps.errors import ConfigurationError

    assert isinstance(make_optimizer("adamw", 3, lr=1e-3), AdamW)
    with pytest.raises(ConfigurationError):
        make_optimizer("rmsprop", 3, lr=0.1)
    with pytest.raises(ConfigurationError):
        make_optimizer("sgd", 3, lr=-1)
    with pytest.raises(ConfigurationError):
        make_optimizer("sgd", 3, lr=0.1, nesterov=True)
    with pytest.raises(ConfigurationError):
        make_optimizer("adam", 3, lr=0.1, betas=(1.0, 0.9))
    with pytest.raises(ConfigurationError):
        make_optimizer("adam", 3, lr=0.1, momentum=0.9)
    assert _reference is not None


def test_a_refused_step_leaves_the_optimizer_as_it_was(problem):
    """Steps that are not committed (a refused gradient) change no state: the run
    still equals torch.optim fed only the accepted gradients."""
    w0, grads = problem
    for cls, torch_cls, options in [
        (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        (Adam, torch.optim.Adam, {"lr": 1e-3}),
    ]:
        opt = cls(N, kernels=_core, **options)
        w = w0.copy()
        for i, g in enumerate(grads):
            out = np.empty_like(w)
            if i % 5 == 2:
                bad = g.copy()
                bad[i] = np.nan
                assert not opt.step(out, w, bad)  # not committed
                continue
            assert opt.step(out, w, g)
            opt.commit()
            w = out
        accepted = [g for i, g in enumerate(grads) if i % 5 != 2]
        assert_matches(cls, w, run_torch(torch_cls, w0, accepted, **options))
