"""The small classifier several multi-rank tests train: the same start on every rank (seeded),
each rank its own batches, so that the ranks' gradients differ and the optimizer has averaging
to do."""
import torch


def classifier(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def train(model: torch.nn.Module, opt, rank: int, steps) -> None:
    """One step per entry of ``steps`` on rank ``rank``'s batch of 32 for that step."""
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


# The layers several optimizer tests step by hand: four tensors of different shapes whose gradients
# differ by orders of magnitude, as a real model's layers do.
SHAPES = [(7, 5), (5,), (16,), (3, 4, 2)]
SCALES = [1.0, 0.01, 10.0, 0.3]


def initial_params(shapes=SHAPES):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) * 0.5 for s in shapes]


def grads_for(params, rank: int, step: int, scales=SCALES):
    """A noisy pull of each layer toward its own target, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [scales[i] * (p.detach().float() - 1.0 + 0.5 * torch.randn(p.shape, generator=g))
            for i, p in enumerate(params)]


def through_a_checkpoint(params, opt, fresh):
    """``params`` and ``opt`` saved to bytes and restored into the new objects ``fresh(params)`` builds,
    as a resumed job would have them."""
    import io

    blob = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, blob)
    blob.seek(0)
    ckpt = torch.load(blob, weights_only=False)
    params, opt = fresh(ckpt["params"])
    opt.load_state_dict(ckpt["opt"])
    return params, opt
