"""aps.torch.Optimizer with mixed precision: 16-bit parameters on float32 master weights,
torch.autocast, torch.amp.GradScaler; and what people do around step(): gradient
accumulation, clip_grad_norm_, torch.compile. Each against the same loop with torch.optim."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

import aps  # noqa: E402
import aps.torch  # noqa: E402
from aps import workloads  # noqa: E402
from aps.testing.workers import digits_batches  # noqa: E402

LR, MOMENTUM, BATCH, STEPS = 0.05, 0.9, 16, 8


def bsp_server(server_process, *extra):
    return server_process("--workers", "1", "--sync", "bsp", "--lr", str(LR), "--momentum", str(MOMENTUM), *extra)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_parameters_train_on_float32_master_weights(server_process, transport, dtype):
    """The reference keeps float32 master weights, steps them with torch.optim.SGD on the
    widened 16-bit gradients and copies them back rounded: aps does the same, bit for bit."""
    reference = workloads.make_model(8, seed=0).to(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in reference.parameters()]
    ref_opt = torch.optim.SGD(master, lr=LR, momentum=MOMENTUM)
    model = workloads.make_model(8, seed=0).to(dtype)
    server = bsp_server(server_process)
    with aps.torch.Optimizer(model, server.address, 0, 1, transport=transport) as opt:
        if transport == "tcp":  # the 16-bit gradients travel as they are
            assert opt.worker.compression == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        for step in range(STEPS):
            x, y = digits_batches(0, 1, step, BATCH)
            for net in (reference, model):
                net.zero_grad()
                F.cross_entropy(net(x.to(dtype)).float(), y).backward()
            for m, p in zip(master, reference.parameters()):
                m.grad = p.grad.float()
            ref_opt.step()
            with torch.no_grad():
                for m, p in zip(master, reference.parameters()):
                    p.copy_(m)
            opt.step()
            for p in model.parameters():
                assert p.dtype == dtype and p.grad.dtype == dtype
        assert opt.version == STEPS
        if transport == "tcp":  # the parameters and gradients are the worker's 16-bit buffers: nothing copied
            weights, grads = opt.worker.half_buffers()
            for p in model.parameters():
                assert weights.ctypes.data <= p.data_ptr() < weights.ctypes.data + weights.nbytes
                assert grads.ctypes.data <= p.grad.data_ptr() < grads.ctypes.data + grads.nbytes
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            opt.worker.reconnect()  # a rejoin's float32 weights are rounded into the model too
        else:  # no rounding on the way: the worker holds the master weights themselves
            for (name, value), m in zip(opt.worker.pull().items(), master, strict=True):
                np.testing.assert_array_equal(value, m.detach().numpy(), err_msg=name)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def against_torch(server_process, transport, run, check=lambda opt: None):
    """``run(model, opt)`` with torch.optim.SGD and with one BSP aps worker, from the same model:
    ``check(opt)`` looks at the aps optimizer before it closes; the weights must be equal, bit for
    bit. Returns what each run returned (torch's, aps's)."""
    reference = workloads.make_model(8, seed=0)
    theirs = run(reference, torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM))
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, bsp_server(server_process).address, 0, 1, transport=transport) as opt:
        mine = run(model, opt)
        check(opt)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    return theirs, mine


def test_autocast_with_float32_parameters_equals_torch_optim(server_process, transport):
    def run(model, opt):
        for step in range(STEPS):
            x, y = digits_batches(0, 1, step, BATCH)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

    against_torch(server_process, transport, run)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaler-unscales", "clip-after-unscale"])
def test_grad_scaler_skips_overflowing_steps_and_counts_them(server_process, transport, unscale_first):
    """Steps whose gradients overflow (an inf at steps 2 and 5) push nothing and are counted,
    the scale backs off, and training goes on exactly as torch.optim with the same GradScaler."""
    def run(model, opt):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
        for step in range(STEPS):
            x, y = digits_batches(0, 1, step, BATCH)
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if step in (2, 5):
                model[-1].bias.grad[3] = float("inf") if step == 2 else float("nan")
            if unscale_first:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale()

    def check(opt):
        skipped = opt.skipped_steps
        assert skipped == 2 and opt.clock == STEPS - skipped == opt.version

    ref_scale, scale = against_torch(server_process, transport, run, check)
    assert scale == ref_scale


def test_gradient_accumulation_and_clipping_equal_torch_optim(server_process, transport):
    """Four micro-batches accumulate into .grad (the worker's buffer), then clip_grad_norm_,
    then one step: one push per step, as torch.optim takes one step."""
    def run(model, opt):
        for step in range(STEPS // 2):
            opt.zero_grad()
            for micro in range(4):
                x, y = digits_batches(micro, 4, step, BATCH // 4)
                (F.cross_entropy(model(x), y) / 4).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()

    def check(opt):
        assert opt.clock == STEPS // 2

    against_torch(server_process, transport, run, check)


@pytest.mark.parametrize("order", ["compile-after", "compile-first"])
def test_a_compiled_model_trains_through_the_views(server_process, order):
    """torch.compile(model), before or after the optimizer is made, reads the parameters where
    they live (the worker's buffers) and its backward writes their .grad there: the compiled
    model trains as the eager one does with torch.optim, and names its parameters as the model."""
    def run(compiled, opt):
        for step in range(STEPS // 2):
            x, y = digits_batches(0, 1, step, BATCH)
            opt.zero_grad()
            F.cross_entropy(compiled(x), y).backward()
            opt.step()

    reference = workloads.make_model(8, seed=0)
    run(torch.compile(reference, backend="aot_eager"),
        torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM))
    model = workloads.make_model(8, seed=0)
    compiled = torch.compile(model, backend="aot_eager") if order == "compile-first" else None
    with aps.torch.Optimizer(compiled or model, bsp_server(server_process).address, 0, 1, transport="tcp") as opt:
        assert opt.worker.layout.names == tuple(n for n, _ in model.named_parameters())
        run(compiled or torch.compile(model, backend="aot_eager"), opt)
        weights = opt.worker.flat_weights
        for param in model.parameters():  # still views after compiling and training
            assert weights.ctypes.data <= param.data_ptr() < weights.ctypes.data + weights.nbytes
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
