"""Parameter-server training: servers hold the parameters and run the optimizer, workers compute
gradients, push them and pull fresh parameters, synchronously or with bounded staleness.

`trident.initialize` hands over to `initialize_parameter_server` when `parameter_server.servers`
> 0: the first S ranks serve (and exit 0 when every worker has finished), the others get the
one `Engine` over a `PushPullStrategy` (push gradients, pull parameters). `serve` runs a server
as a function that returns, for tests and for programs that do something after serving. One
server (S = 1) is TensorFlow's CentralStorage strategy: every parameter on one host, workers on
their devices.
"""

from trident.parameter_server.protocol import (ParameterServerError, UpdateRecord, WorkerLostError, format_updates,
                                               staleness_violations)
from trident.parameter_server.server import ServeResult
from trident.parameter_server.sharding import assign_servers
from trident.parameter_server.start import initialize_parameter_server, serve
from trident.parameter_server.strategy import PushPullStrategy

__all__ = ["initialize_parameter_server", "serve", "ServeResult", "PushPullStrategy", "UpdateRecord", "format_updates",
           "staleness_violations", "assign_servers", "ParameterServerError", "WorkerLostError"]
