"""The compressed collective and the communication accounting. Never imports an optimizer."""
from onebitlamb.comm.collectives import padded_size
from onebitlamb.comm.groups import (allreduce_mean_, average_, compressed_allreduce, duplicate_group,
                                    quantized_average_, rank_of, spanning_group, world_size_of)
from onebitlamb.comm.hierarchy import NodeGroups, error_sizes, node_groups
from onebitlamb.comm.quantized import quantized_error_sizes, quantized_wire_bytes
from onebitlamb.comm.stats import GLOBAL_STATS, CommStats

__all__ = ["CommStats", "GLOBAL_STATS", "NodeGroups", "allreduce_mean_", "average_", "compressed_allreduce", "duplicate_group",
           "error_sizes", "node_groups", "padded_size", "quantized_average_", "quantized_error_sizes",
           "quantized_wire_bytes", "rank_of", "spanning_group", "world_size_of"]
