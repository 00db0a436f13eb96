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
