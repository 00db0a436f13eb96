"""onebitlamb: 1-bit LAMB, 1-bit Adam and LAMB on plain torch.distributed."""
from onebitlamb.comm import CommStats, compressed_allreduce, padded_size

__version__ = "0.1.0"

__all__ = ["CommStats", "compressed_allreduce", "padded_size", "__version__"]
