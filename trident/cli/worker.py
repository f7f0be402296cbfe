"""What `trident launch` runs on every rank: `python -m trident.cli.worker [--as-deepspeed]
[--local-rank-arg] [-m] TARGET ARGS...`, which runs the script (or module) as `__main__`.

Two things a bare `python script.py` under torchrun's agent does not do:

- `--as-deepspeed`: `trident.install_as_deepspeed()` first, so the script's `import deepspeed`
  and `from deepspeed.x import y` resolve to trident; `--local-rank-arg` appends
  `--local_rank=N`, as DeepSpeed's launcher does, unless the command line carries one.
- Every failure is recorded, once: an exception the script raises before trident's failure hook
  is installed (arguments, the config, the model, an import) goes into torchrun's error file
  with the rank, host, time and traceback, and is not printed here; `trident launch` prints the
  first failure's traceback once, with its rank and host (several ranks failing alike would
  otherwise print the same traceback each). Once `trident.initialize` has installed its hook,
  the hook reports as before (it prints the traceback and stops the other ranks).
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import traceback

from trident.reliability.failures import FailureHook, OneLineError, error_summary, write_error_file


def _split(argv: list[str]) -> tuple[bool, bool, bool, list[str]]:
    as_deepspeed = local_rank_arg = module = False
    while argv and argv[0] in ("--as-deepspeed", "--local-rank-arg", "-m"):
        flag = argv.pop(0)
        as_deepspeed |= flag == "--as-deepspeed"
        local_rank_arg |= flag == "--local-rank-arg"
        module |= flag == "-m"
    if not argv:
        raise SystemExit("trident.cli.worker: give the script (or -m module) to run")
    return as_deepspeed, local_rank_arg, module, argv


def main(argv: list[str] | None = None) -> int:
    as_deepspeed, local_rank_arg, module, target = _split(list(sys.argv[1:] if argv is None else argv))
    if as_deepspeed:
        from trident.deepspeed.hook import install_as_deepspeed
        install_as_deepspeed()
    if local_rank_arg and not any(a == "--local_rank" or a.startswith("--local_rank=") for a in target[1:]):
        target.append(f"--local_rank={os.environ.get('LOCAL_RANK', 0)}")
    sys.argv = list(target)
    try:
        if module:
            runpy.run_module(target[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001  (every failure is recorded, KeyboardInterrupt too)
        return record_failure(exc)
    return 0


def record_failure(exc: BaseException) -> int:
    """Report `exc` once (see module doc); the process's exit status."""
    hook = sys.excepthook
    if isinstance(hook, FailureHook) or isinstance(exc, OneLineError):
        hook(type(exc), exc, exc.__traceback__)  # trident's own reporting, as for an uncaught exception
        return 1
    rank = int(os.environ.get("RANK", 0))
    summary = error_summary(exc)
    text = "".join(traceback.format_exception(type(exc), exc, _script_frames(exc.__traceback__)))
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:  # not under torchrun: nobody else will print it
        print(text, file=sys.stderr, end="", flush=True)
        return 1
    write_error_file("exception", summary, rank, {"error": summary, "host": socket.gethostname(), "printed": False},
                     text)
    print(f"trident: rank {rank} failed: {summary} (trident launch prints its traceback)", file=sys.stderr,
          flush=True)
    return 1


def _script_frames(tb):
    """The traceback from the script's first frame on (this runner's and runpy's frames dropped)."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    sys.exit(main())
