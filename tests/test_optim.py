"""fastformer.optim.make_optimizer: torch's fused Adam where the device has it, the same update."""
import torch

from fastformer.optim import NoamScheduler, make_optimizer


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


def _train(model, opt, steps=5):
    gen = torch.Generator().manual_seed(3)
    sched = NoamScheduler(opt, d_model=16, warmup=2)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        sched.step()


def test_fused_adam_on_cpu_by_default_with_the_unfused_update():
    fused_model, plain_model = _model(0), _model(0)
    fused = make_optimizer(fused_model)
    plain = make_optimizer(plain_model, fused=False)
    assert fused.defaults["fused"] is True
    assert not plain.defaults["fused"]
    assert fused.defaults["betas"] == (0.9, 0.98) and fused.defaults["eps"] == 1e-9
    _train(fused_model, fused)
    _train(plain_model, plain)
    moved = False
    for (name, a), b, start in zip(fused_model.named_parameters(), plain_model.parameters(), _model(0).parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        moved |= not torch.equal(a, start)
    assert moved, "the parameters never changed"


def test_parameter_groups_are_accepted():
    model = _model(1)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.1}]
    opt = make_optimizer(groups)
    assert opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]
