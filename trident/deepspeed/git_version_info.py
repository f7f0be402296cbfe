"""`deepspeed.git_version_info`: the build facts DeepSpeed's tests and tools read.

trident is a pure-Python build: no compiled ops, so both op tables are empty."""

from trident.deepspeed.package import DEEPSPEED_VERSION as version

git_hash = "unknown"
git_branch = "unknown"
installed_ops: dict[str, bool] = {}
compatible_ops: dict[str, bool] = {}
torch_info = {"version": "0.0", "bf16_support": False, "cuda_version": "0.0", "nccl_version": "0.0",
              "hip_version": "0.0", "cpu_version": "0.0"}

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "torch_info"]
