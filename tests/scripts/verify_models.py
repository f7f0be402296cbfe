"""Model factories for the `trident verify` tests: FUNCTION(config) -> (model, dataset)."""

import torch
import torch.distributed as dist

from trident.models.toy import TinyMLP, make_regression_data


def mlp(config):
    x, y = make_regression_data(64)
    return TinyMLP(n_layers=3), torch.utils.data.TensorDataset(x, y)


def mlp_with_a_bug_on_rank_1(config):
    """On rank 1 the gradient of layers.1.weight is doubled before data parallelism averages it."""
    model, data = mlp(config)
    if dist.is_initialized() and dist.get_rank() == 1:
        model.layers[1].weight.register_hook(lambda grad: grad * 2)
    return model, data
