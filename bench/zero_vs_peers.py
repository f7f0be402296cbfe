"""trident ZeRO stages 1-3 vs DeepSpeed ZeRO and PyTorch FSDP2: step time, peak RSS and model states.

Same model (the reference GPT), same batches, fp32, AdamW (torch.optim's), gloo on CPU, one
thread per rank, the same ZeRO bucket sizes for trident and DeepSpeed. For each world size and
stage, every system gets its own ranks (spawned processes, its own process group), which stay
alive across the repeats of that stage, so memory never mixes and start-up is paid once. The
repeats are interleaved in rotating order, so machine noise hits the systems alike. Idle ranks
wait on a queue and use no CPU.

Per system: the median over repeats of the slowest rank's median step time; the largest peak
RSS of any rank; and the model states of a rank after a backward pass (gradients present, before
the step), as parameters + gradients + optimizer states (fp32 master copies count as optimizer
states; scalar step counters do not):
  trident    engine.memory_breakdown();
  DeepSpeed  the storages of the parameters (whole flat buffer at stages 1-2; the `ds_tensor`
             partitions and the whole persistent parameters at stage 3), of its gradient
             partitions (`averaged_gradients`, `grad_partitions_flat_buffer`) and of the inner
             torch optimizer's parameters (the fp32 partitions) and their state;
  FSDP2      the local shards of the parameters, of their gradients and of the optimizer state.
"live tensors" is the same figure for every system: the bytes of all distinct tensor storages
reachable from Python at that moment (buckets and other buffers included).

DeepSpeed runs only when importable (see bench/ZERO.md for its CPU install); FSDP2 only at stage 3.

    python bench/zero_vs_peers.py [--world 2 4] [--stages 1 2 3] [--repeats 3] [--steps 8] [--quick]
                                  [--model gpt | llama-hf]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import os
import queue
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import build_gpt, free_port, peak_rss_bytes, rotated, start_rank, timed_steps, token_batches

MODEL = dict(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256)
# `--model llama-hf`: an unmodified transformers LlamaForCausalLM of about 50M parameters
# (grouped-query attention, untied head), the Hugging Face issue's benchmark model.
LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
SEQ_LEN = 128


class CausalLM(torch.nn.Module):
    """The transformers model unchanged inside; (tokens, next tokens) -> mean cross-entropy, as
    the reference GPT's forward gives it, so every system runs the same loop."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(name: str) -> torch.nn.Module:
    """The benchmark model, seed 0, so every system starts from the same weights."""
    if name == "gpt":
        return build_gpt(MODEL)
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA)
    config._attn_implementation = "sdpa"
    return CausalLM(transformers.LlamaForCausalLM(config).float())


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 wraps one by one."""
    return list(model.lm.model.layers) if isinstance(model, CausalLM) else list(model.blocks)
MICRO = 4
WARMUP = 3      # steps before the first timed repeat; later repeats re-warm with one step
LR = 1e-4
# DeepSpeed's defaults (5e8 / 5e7 elements) are sized for GPUs and billion-parameter models: here
# one bucket would hold the whole model, and stage 3 would reserve a 2 GB reduce bucket. Both
# systems get these instead: about half of this 4.2M-parameter model per bucket.
ZERO_KEYS = {"reduce_bucket_size": 2**21, "allgather_bucket_size": 2**21}
# Stage 3 also shards the small parameters that the default persistence threshold (1e5 elements)
# would keep whole on every rank: FSDP2 has no such threshold, so this compares like with like.
STAGE3_KEYS = {"stage3_prefetch_bucket_size": 2**21, "stage3_param_persistence_threshold": 0}


def zero_keys(stage: int) -> dict:
    """The zero_optimization keys both trident and DeepSpeed get at `stage`."""
    return {"stage": stage, **ZERO_KEYS, **(STAGE3_KEYS if stage == 3 else {})}
PEERS = {1: ("deepspeed",), 2: ("deepspeed",), 3: ("deepspeed", "fsdp2")}
STATE_KEYS = ("parameters", "gradients", "optimizer_states")
COMMAND_TIMEOUT_S = 900


# -- measuring, inside a rank ---------------------------------------------------------------------

def unique_storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> tuple[int, set[int]]:
    """Bytes of the distinct storages behind `tensors` (views count once), and their addresses.

    DTensors count their local shard; meta and empty tensors count nothing; storages whose
    address is in `exclude` are skipped (already counted in another category).
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type == "meta" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address and address not in (exclude or ()):
            seen[address] = max(seen.get(address, 0), storage.nbytes())
    return sum(seen.values()), set(seen)


def nested_tensors(obj) -> Iterable[torch.Tensor]:
    """Tensors inside lists, tuples and dicts (DeepSpeed keeps its partitions in such nests)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from nested_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from nested_tensors(v)


def deepspeed_model_states(model: torch.nn.Module, zero) -> dict[str, int]:
    """Bytes of a DeepSpeed ZeRO engine's model states on this rank, from the storages it holds
    (`zero` is the optimizer deepspeed.initialize returns)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for name in ("averaged_gradients", "grad_partitions_flat_buffer"):
        grads += nested_tensors(getattr(zero, name, None))
    inner = zero.optimizer  # torch's AdamW, rebound to the fp32 partitions
    masters = [p for g in inner.param_groups for p in g["params"]]
    return _breakdown([p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params],
                      grads, inner, masters)


def _breakdown(params: list, grads: list, optimizer: torch.optim.Optimizer, masters: list) -> dict[str, int]:
    """parameters / gradients / optimizer states, each storage counted once, in that order."""
    p_bytes, counted = unique_storage_bytes(params)
    g_bytes, g_seen = unique_storage_bytes(grads, counted)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    o_bytes, _ = unique_storage_bytes(masters + state, counted | g_seen)
    return {"parameters": p_bytes, "gradients": g_bytes, "optimizer_states": o_bytes}


def live_tensor_bytes(model: torch.nn.Module) -> int:
    """All distinct tensor storages reachable from Python now, plus the model's parameters and grads."""
    gc.collect()
    params = list(model.parameters())
    found = (o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return unique_storage_bytes(itertools.chain(found, params, (p.grad for p in params)))[0]


# -- the three systems: (forward + backward, optimizer step, model-state breakdown) ----------------

System = tuple[Callable[[torch.Tensor], None], Callable[[], None], Callable[[], dict[str, int]]]


def _trident(model: torch.nn.Module, stage: int, world: int, micro: int = MICRO, offload: bool = False) -> System:
    """`offload`: ZeRO-Offload, the optimizer states and step on the CPU (bench/suite.py's row)."""
    import trident
    zero = zero_keys(stage) | ({"offload_optimizer": {"device": "cpu"}} if offload else {})
    cfg = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": zero}
    engine, *_ = trident.initialize(model=model, config=cfg)

    def backward(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    return backward, engine.step, engine.memory_breakdown


def _deepspeed(model: torch.nn.Module, stage: int, world: int, micro: int = MICRO, offload: bool = False) -> System:
    """`offload`: DeepSpeed's ZeRO-Offload, which requires its own C++ CPU Adam (built on first use)
    from the config's optimizer section; otherwise torch's AdamW, as for the other systems."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "steps_per_print": 2**31 - 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": zero_keys(stage)}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}
        optimizer = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg,
                                              model_parameters=model.parameters() if offload else None)

    def backward(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))

    def breakdown() -> dict[str, int]:
        return deepspeed_model_states(model, zero)
    return backward, engine.step, breakdown


def _fsdp2(model: torch.nn.Module, stage: int, world: int, micro: int = MICRO) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    def backward(batch: torch.Tensor) -> None:
        model(batch[:, :-1], batch[:, 1:]).backward()

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def breakdown() -> dict[str, int]:
        params = list(model.parameters())
        return _breakdown(params, [p.grad for p in params], optimizer, [])
    return backward, step, breakdown


SYSTEMS: dict[str, Callable[[torch.nn.Module, int, int], System]] = {
    "trident": _trident, "deepspeed": _deepspeed, "fsdp2": _fsdp2}


def _worker(rank: int, world: int, port: int, system: str, stage: int, log_path: str,
            commands, results, model_name: str = "gpt") -> None:
    """One rank of one system: build, report ready, then run the commands until None."""
    start_rank(rank, world, port)
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)  # start-up tables and C++ warnings go to the log, not the report
    os.dup2(log.fileno(), 2)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = build_model(model_name)
        backward, opt_step, breakdown = SYSTEMS[system](model, stage, world)

        def step(batch: torch.Tensor) -> None:
            backward(batch)
            opt_step()
        vocab = MODEL["vocab_size"] if model_name == "gpt" else LLAMA["vocab_size"]
        batches = token_batches(rank, {"vocab_size": vocab, "seq_len": MODEL["seq_len"]}, MICRO)
        results.put((rank, "ready"))
        while (command := commands.get()) is not None:
            if command == "memory":
                backward(next(batches))
                results.put((rank, (breakdown(), live_tensor_bytes(model))))
                opt_step()
            else:
                results.put((rank, timed_steps(step, batches, *command)))
        results.put((rank, peak_rss_bytes()))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


# -- the parent: pools of ranks, repeats, summary ----------------------------------------------------

class Pool:
    """The ranks of one system at one (world, stage), kept alive across repeats."""

    def __init__(self, ctx, system: str, stage: int, world: int, log_dir: str, model_name: str = "gpt") -> None:
        self.system, self.world = system, world
        port = free_port()
        self.logs = [os.path.join(log_dir, f"{system}-stage{stage}-world{world}-rank{r}.log") for r in range(world)]
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world, port, system, stage, self.logs[r], self.commands[r], self.results,
                                        model_name))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def collect(self) -> list:
        """One answer from every rank, in rank order; a dead rank raises with its log's tail."""
        answers: dict[int, object] = {}
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while len(answers) < self.world:
            try:
                rank, value = self.results.get(timeout=1.0)
                answers[rank] = value
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if p.exitcode not in (None, 0):
                        raise RuntimeError(f"{self.system} rank {r} exited with code {p.exitcode}; "
                                           f"the end of {self.logs[r]}:\n{_tail(self.logs[r])}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.system} ranks gave no answer in {COMMAND_TIMEOUT_S} s; "
                                       f"see the logs {self.logs}")
        return [answers[r] for r in range(self.world)]

    def send(self, command) -> None:
        """(warmup, steps) to time, "memory" to measure model states, None to stop (answer: peak RSS)."""
        for q in self.commands:
            q.put(command)

    def ask(self, command) -> list:
        self.send(command)
        return self.collect()

    def stop(self, grace_s: float) -> None:
        """Wait up to grace_s for each rank to exit, then end the ones still running."""
        for p in self.procs:
            p.join(grace_s)
            if p.is_alive():
                p.terminate()
                p.join()


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return "(no log: the rank died before opening it)"


@dataclass
class Result:
    """One system's figures at one (world, stage)."""

    world: int
    stage: int
    system: str
    step_s: float
    faults: float
    rss: int
    states: dict[str, int]
    live: int

    @property
    def state_bytes(self) -> int:
        return sum(self.states[k] for k in STATE_KEYS)


def summarize(world: int, stage: int, system: str, repeats: list[list[tuple[float, float]]],
              memory: list[tuple[dict[str, int], int]], rss: list[int]) -> Result:
    """repeats[r][rank] = (median step s, faults/step); the slowest rank per repeat, median over repeats.

    Memory figures are those of the rank that holds the most (ranks differ by padding only).
    """
    step_s = statistics.median(max(t for t, _ in ranks) for ranks in repeats)
    faults = statistics.median(max(f for _, f in ranks) for ranks in repeats)
    states = max(memory, key=lambda m: sum(m[0][k] for k in STATE_KEYS))[0]
    return Result(world, stage, system, step_s, faults, max(rss), states, max(m[1] for m in memory))


def ratios(ours: Result, peer: Result) -> tuple[float, float, float]:
    """trident / peer for step time, peak RSS and model-state bytes."""
    return ours.step_s / peer.step_s, ours.rss / peer.rss, ours.state_bytes / peer.state_bytes


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_table(results: list[Result]) -> str:
    """A markdown table, one row per (world, stage, system), ratios trident / peer on peer rows."""
    head = ("| world | stage | system | step ms | peak RSS / rank MiB | model states / rank MiB "
            "(params + grads + optim) | live tensors MiB | faults / step | trident / peer: time | RSS | states |")
    lines = [head, "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ours = {(r.world, r.stage): r for r in results if r.system == "trident"}
    for r in results:
        parts = " + ".join(_mib(r.states[k]) for k in STATE_KEYS)
        mine = ours.get((r.world, r.stage))
        ratio = ("| | | " if r.system == "trident" or mine is None
                 else "| {:.3f} | {:.3f} | {:.3f} ".format(*ratios(mine, r)))
        lines.append(f"| {r.world} | {r.stage} | {r.system} | {r.step_s * 1000:.1f} | {_mib(r.rss)} | "
                     f"{_mib(r.state_bytes)} ({parts}) | {_mib(r.live)} | {r.faults:.0f} {ratio}|")
    return "\n".join(lines)


def run_stage(ctx, world: int, stage: int, systems: list[str], repeats: int, steps: int,
              warmup: int, log_dir: str, model_name: str = "gpt") -> list[Result]:
    """All systems of one (world, stage): start their pools, interleave the repeats, measure."""
    pools: dict[str, Pool] = {}
    grace_s = 0.0  # on an error, end the ranks at once
    try:
        for s in systems:
            pools[s] = Pool(ctx, s, stage, world, log_dir, model_name)
        for pool in pools.values():
            pool.collect()
        timings: dict[str, list] = {s: [] for s in systems}
        for r in range(repeats):
            for s in rotated(systems, r):
                timings[s].append(pools[s].ask((warmup if r == 0 else 1, steps)))
        for pool in pools.values():  # nothing is timed from here on: all systems at once
            pool.send("memory")
        memory = {s: pools[s].collect() for s in systems}
        for pool in pools.values():
            pool.send(None)
        rss = {s: pools[s].collect() for s in systems}
        grace_s = 30.0
    finally:
        for pool in pools.values():
            pool.stop(grace_s)
    return [summarize(world, stage, s, timings[s], memory[s], rss[s]) for s in systems]


def _peers_available() -> dict[str, str]:
    """Peers that cannot run here, with the reason."""
    missing = {}
    if importlib.util.find_spec("deepspeed") is None:
        missing["deepspeed"] = "not importable in this interpreter; bench/ZERO.md says how to install it"
    if importlib.util.find_spec("torch.distributed.fsdp") is None or not hasattr(
            importlib.import_module("torch.distributed.fsdp"), "fully_shard"):
        missing["fsdp2"] = f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard"
    return missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", "--worlds", dest="world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", choices=["gpt", "llama-hf"], default="gpt",
                        help="the reference GPT, or an unmodified transformers LlamaForCausalLM of ~50M parameters")
    parser.add_argument("--quick", action="store_true",
                        help="check the harness: world 2, 1 repeat of 2 steps after 1 warm-up step")
    args = parser.parse_args(argv)
    warmup = WARMUP
    if args.quick:
        args.world, args.repeats, args.steps, warmup = [2], 1, 2, 1
    missing = _peers_available()
    n_params = sum(p.numel() for p in build_model(args.model).parameters())
    shape = f"GPT {MODEL}" if args.model == "gpt" else f"transformers LlamaForCausalLM {LLAMA}, seq {SEQ_LEN}"
    print(f"{shape} ({n_params / 1e6:.2f}M params, {_mib(4 * n_params)} MiB in fp32), micro batch "
          f"{MICRO} per rank, fp32, AdamW, gloo, 1 thread/rank, ZeRO {ZERO_KEYS} (stage 3 also {STAGE3_KEYS}); {args.steps} timed steps "
          f"after {warmup} warm-up, {args.repeats} interleaved repeats", flush=True)
    for peer, why in missing.items():
        print(f"{peer} left out: {why}", flush=True)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks: one compute thread each
    ctx = mp.get_context("spawn")
    log_dir = tempfile.mkdtemp(prefix="zero_vs_peers-")
    results: list[Result] = []
    start = time.monotonic()
    for world in args.world:
        for stage in args.stages:
            systems = ["trident"] + [p for p in PEERS[stage] if p not in missing]
            results += run_stage(ctx, world, stage, systems, args.repeats, args.steps, warmup, log_dir, args.model)
            print(f"world {world}, stage {stage} done ({time.monotonic() - start:.0f} s)", flush=True)
    shutil.rmtree(log_dir)
    print()
    print(format_table(results))


if __name__ == "__main__":
    main()
