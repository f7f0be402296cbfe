"""Building a transformers model without allocating its weights."""

from __future__ import annotations

import contextlib

from torch import nn


@contextlib.contextmanager
def meta_parameters():
    """Parameters registered inside are moved to the meta device (buffers stay where they are
    built, so computed ones such as RoPE frequencies are real)."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            param.__dict__.update(kwargs)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
