"""DeepSpeed's command-line flags (`trident.add_config_arguments`, as `deepspeed.add_config_arguments`)."""

from __future__ import annotations


def add_config_arguments(parser):
    """DeepSpeed's command-line flags on `parser` (an argparse parser), returned: `--deepspeed`
    (use the engine), `--deepspeed_config FILE`, their legacy `--deepscale` spellings, and
    trident's own `--trident` / `--trident_config` as aliases of the same two settings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configuration (trident)")
    group.add_argument("--deepspeed", "--trident", dest="deepspeed", default=False, action="store_true",
                       help="train with the engine (DeepSpeed's flag; trident always does)")
    group.add_argument("--deepspeed_config", "--trident_config", dest="deepspeed_config", default=None, type=str,
                       help="JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="legacy name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="legacy name of --deepspeed_config")
    group.add_argument("--deepspeed_mpi", default=False, action="store_true",
                       help="accepted; trident starts from torchrun's environment, not MPI")
    return parser
