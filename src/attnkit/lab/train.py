"""The lab's training loop: a small attnkit encoder learns a built-in task.

Determinism: the model is initialised from ``seed``; the batch of step ``s`` is drawn from a
generator seeded with ``(seed, s)``, so a resumed run sees exactly the batches an uninterrupted run
would, and every data-parallel process can draw the same global batch and keep only its shard.
The loss is normalised by the number of scored tokens in the *global* batch, so the averaged
gradient of ``W`` processes equals the gradient of one process on the whole batch.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.attention import MultiHeadAttention
from attnkit.config import FAMILIES, TransformerConfig
from attnkit.distributed import RingKernel, shard_positions
from attnkit.lab import checkpoint as ckpt
from attnkit.lab.distributed import DistContext
from attnkit.lab.tasks import IGNORE, Task, get_task
from attnkit.models import TransformerEncoder

__all__ = [
    "DTYPES",
    "POSITIONS",
    "LabConfig",
    "TrainResult",
    "attention_weights",
    "autocast",
    "build_model",
    "default_lengths",
    "eval_set",
    "evaluate",
    "head_alignment",
    "length_generalization",
    "load_trained",
    "train",
    "train_batch",
    "with_overrides",
]

LabPositions = Literal["none", "sinusoidal", "rope"]
POSITIONS: tuple[LabPositions, ...] = ("none", "sinusoidal", "rope")
LabDtype = Literal["float32", "bfloat16"]
#: Compute dtypes of the lab: ``bfloat16`` runs the forward under ``torch.autocast``.
DTYPES: tuple[LabDtype, ...] = ("float32", "bfloat16")
# Options that may change when a run is resumed; the rest must match the checkpoint.
RESUMABLE = frozenset({"steps", "eval_every", "save_every", "eval_size"})
_EVAL_SEED_OFFSET = 1 << 40  # the evaluation stream never meets a training step's stream


@dataclass(frozen=True)
class LabConfig:
    """Everything that defines a lab run. The defaults are the fast reversal run of ``attnkit lab``.

    Attributes:
        task: Task name (see :data:`attnkit.lab.tasks.TASKS`).
        seq_len: Training sequence length ``n``.
        num_symbols: Alphabet size.
        positions: ``"none"``, ``"sinusoidal"`` or ``"rope"``.
        rope_base: Rotary wavelength base (used with ``positions="rope"``). 100, not the 10,000
            of language models: a lab head has 16 dims, so 8 frequency pairs, and with 10,000
            the slowest 5 barely turn over the lab's 16-64 positions, leaving rotary attention
            little to tell positions apart by (reverse: 0.84 held-out accuracy after 400 steps,
            and a seed reaching only 0.83 after 800; with 100 every pair turns by at least
            ~1/64 rad per position and 4 seeds reach 0.97-0.99 in 400 steps).
        dim: Model dim ``D``.
        num_layers: Encoder blocks.
        num_heads: Attention heads ``H``.
        ffn_dim: Feed-forward width ``F``.
        max_seq_len: Longest sequence the position tables cover (length generalization tests
            go up to it); defaults to ``4 * seq_len``.
        dropout: Dropout probability.
        steps: Optimizer steps.
        batch_size: Global batch (split over data-parallel processes).
        lr: Peak learning rate (AdamW, linear warmup then cosine decay to 10%).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warmup steps.
        eval_size: Held-out sequences for evaluation.
        eval_every: Evaluate every this many steps (0: only at the end).
        save_every: Checkpoint every this many steps (0: only at the end).
        seed: Seed of the initialisation and the data.
        dtype: ``"float32"``, or ``"bfloat16"``: the forward passes of training and evaluation
            run under ``torch.autocast`` in bfloat16 (matrix products and attention in bf16;
            the parameters, their gradients, the optimizer and the loss stay float32).
    """

    task: str = "reverse"
    seq_len: int = 16
    num_symbols: int = 10
    positions: LabPositions = "sinusoidal"
    rope_base: float = 100.0
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_dim: int = 128
    max_seq_len: int | None = None
    dropout: float = 0.0
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    eval_size: int = 1000
    eval_every: int = 50
    save_every: int = 0
    seed: int = 0
    dtype: LabDtype = "float32"

    def __post_init__(self) -> None:
        ints = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.type in ("int", "int | None") and getattr(self, f.name) is not None
        }
        bad = {k: v for k, v in ints.items() if isinstance(v, bool) or not isinstance(v, int)}
        if bad:
            raise TypeError(f"these options must be ints: {bad}")
        positive = (
            "seq_len",
            "num_symbols",
            "dim",
            "num_layers",
            "num_heads",
            "ffn_dim",
            "steps",
            "batch_size",
            "eval_size",
        )
        bad = {k: ints[k] for k in positive if ints[k] < 1}
        bad |= {k: ints[k] for k in ("eval_every", "save_every", "warmup_steps") if ints[k] < 0}
        if bad:
            raise ValueError(
                f"sizes must be positive (eval_every/save_every/warmup_steps may be 0), got {bad}"
            )
        if self.positions not in POSITIONS:
            raise ValueError(
                f"positions must be one of {', '.join(POSITIONS)}; got {self.positions!r}"
            )
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        head_dim = self.dim // self.num_heads
        if self.positions == "rope" and head_dim % 2:
            raise ValueError(
                f"rope needs an even head dim, got dim/num_heads = {self.dim}/"
                f"{self.num_heads} = {head_dim}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.max_seq_len is not None and self.max_seq_len < self.seq_len:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must be >= seq_len ({self.seq_len})"
            )
        if not (math.isfinite(self.rope_base) and self.rope_base > 1.0):
            raise ValueError(f"rope_base must be a number > 1, got {self.rope_base}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        self.make_task()  # unknown task names and sizes that do not fit the task fail here

    @property
    def table_len(self) -> int:
        """Positions covered by the position tables."""
        return self.max_seq_len if self.max_seq_len is not None else 4 * self.seq_len

    def make_task(self) -> Task:
        """The task this config trains on."""
        return get_task(self.task, seq_len=self.seq_len, num_symbols=self.num_symbols)

    def model_config(self) -> TransformerConfig:
        """The encoder this run trains: the blog's post-norm ReLU blocks over the task's
        vocabulary, positions covering :attr:`table_len`."""
        config = TransformerConfig(
            vocab_size=self.make_task().vocab_size,
            dim=self.dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            ffn_dim=self.ffn_dim,
            max_seq_len=self.table_len,
            dropout=self.dropout,
            **(FAMILIES["blog"] | {"position": self.positions}),
        )
        # the base matters only to rotary positions; the others keep TransformerConfig's
        return config.replace(rope_base=self.rope_base) if self.positions == "rope" else config

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown LabConfig fields {unknown}")
        # runs saved before rope_base existed trained rotary models with the base of 10,000
        return cls(**{"rope_base": 10_000.0, **data})


def autocast(dtype: LabDtype, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """The context the lab's forward passes run in: ``torch.autocast`` to ``dtype`` on
    ``device``'s type, or nothing for ``"float32"``."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, dtype))


def build_model(config: LabConfig) -> TransformerEncoder:
    """The tagger for ``config``: an attnkit encoder (:meth:`LabConfig.model_config`) with a
    per-token linear head over the task's vocabulary.

    It is initialised from the current torch RNG state.
    """
    model_config = config.model_config()
    return TransformerEncoder(model_config, num_outputs=model_config.vocab_size)


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        config: The run's config.
        model: The trained model (unwrapped), in eval mode.
        history: One dict per logged step (``step``, ``loss``, ``accuracy``, and at evaluation
            steps ``eval_loss``, ``eval_accuracy``).
        eval: Final held-out metrics (see :func:`evaluate`).
        train_time_s: Seconds spent in training steps, summed over resumed runs.
        step: Steps done.
        resumed_from: Step the run resumed from (None for a fresh run).
        world_size: Data-parallel processes.
    """

    config: LabConfig
    model: TransformerEncoder
    history: list[dict[str, float]] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)
    train_time_s: float = 0.0
    step: int = 0
    resumed_from: int | None = None
    world_size: int = 1

    @property
    def num_params(self) -> int:
        """Trainable parameters."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def train_batch(config: LabConfig, task: Task, step: int) -> tuple[Tensor, Tensor]:
    """The global training batch of ``step`` (same on every process, never held-out rows)."""
    return task.sample_split(
        config.batch_size, _generator(config.seed * 1_000_003 + step), held_out=False
    )


def eval_set(task: Task, size: int, seed: int) -> tuple[Tensor, Tensor]:
    """``size`` held-out sequences of ``task`` (deterministic in ``seed`` and the length)."""
    return task.sample_split(
        size, _generator(_EVAL_SEED_OFFSET + seed * 1_000_003 + task.seq_len), held_out=True
    )


def _lr_at(config: LabConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _masked_stats(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Summed loss, number of correct and number of scored tokens."""
    flat_logits, flat_targets = logits.flatten(0, -2), targets.flatten()  # (B*L, V), (B*L,)
    loss_sum = F.cross_entropy(
        flat_logits.float(), flat_targets, ignore_index=IGNORE, reduction="sum"
    )
    scored = flat_targets != IGNORE
    correct = ((flat_logits.argmax(-1) == flat_targets) & scored).sum()
    return loss_sum, correct, scored.sum()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    chunk: int = 500,
    dtype: LabDtype = "float32",
) -> dict[str, float]:
    """Token accuracy, sequence accuracy and mean loss over the scored positions.

    Args:
        model: The tagger.
        inputs: Held-out sequences.
        targets: Their targets.
        chunk: Sequences per forward pass.
        dtype: ``"bfloat16"`` runs the forward under ``torch.autocast`` (as the lab trained).

    Returns:
        ``{"accuracy", "sequence_accuracy", "loss", "sequences"}``.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    loss = correct = count = seq_ok = 0.0
    for start in range(0, inputs.shape[0], chunk):
        x = inputs[start : start + chunk].to(device)
        y = targets[start : start + chunk].to(device)
        with autocast(dtype, device):
            logits = model(x)  # (b, L, V)
        l_sum, c, n = _masked_stats(logits, y)
        loss, correct, count = loss + float(l_sum), correct + float(c), count + float(n)
        ok = (logits.argmax(-1) == y) | (y == IGNORE)
        seq_ok += float(ok.all(-1).sum())
    model.train(was_training)
    n_seq = max(1, inputs.shape[0])
    return {
        "accuracy": correct / max(count, 1.0),
        "sequence_accuracy": seq_ok / n_seq,
        "loss": loss / max(count, 1.0),
        "sequences": float(inputs.shape[0]),
    }


@torch.no_grad()
def attention_weights(model: TransformerEncoder, inputs: Tensor) -> Tensor:
    """Attention weights of every layer and head.

    Shape:
        inputs ``(B, L)`` -> ``(B, layers, H, L, L)``.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    _, weights = model(inputs.to(device), return_weights=True)
    model.train(was_training)
    return torch.stack([w.float().cpu() for w in weights], dim=1)


def head_alignment(task: Task, inputs: Tensor, weights: Tensor) -> Tensor:
    """Share of each head's attention that lands where the task's answer comes from.

    Averaged over the scored query positions (see :meth:`Task.sources`): 1.0 means the head
    looks only at the positions holding the answer (reverse: the anti-diagonal).

    Shape:
        inputs ``(B, L)``, weights ``(B, layers, H, L, L)`` -> ``(layers, H)``.
    """
    src = task.sources(inputs).to(weights.dtype)  # (B, L, L)
    rows = src.amax(-1)  # (B, L): 1 where the query is scored
    mass = (weights * src[:, None, None]).sum(-1)  # (B, layers, H, L)
    return (mass * rows[:, None, None]).sum((0, -1)) / rows.sum().clamp(min=1)


def length_generalization(
    model: nn.Module, task: Task, lengths: list[int], *, size: int, seed: int
) -> dict[int, float | None]:
    """Held-out token accuracy at other sequence lengths (None where the length does not fit).

    A length does not fit when the task rejects it (e.g. odd lengths for copy) or it exceeds
    the position table.
    """
    out: dict[int, float | None] = {}
    for n in lengths:
        try:
            t = task.with_seq_len(n)
            x, y = eval_set(t, size, seed)
            out[n] = evaluate(model, x, y)["accuracy"]
        except ValueError:
            out[n] = None
    return out


def default_lengths(config: LabConfig) -> list[int]:
    """Lengths for the length-generalization table: ``n``, a bit longer, ``1.5 n`` and ``2 n``."""
    n = config.seq_len
    cands = [n, n + 2, n + 4, n + (n // 2 + 1) // 2 * 2, 2 * n]
    return sorted({m for m in cands if m <= config.table_len})


def _check_resumable(saved: LabConfig, wanted: LabConfig) -> None:
    diff = {
        f.name: (getattr(saved, f.name), getattr(wanted, f.name))
        for f in fields(LabConfig)
        if f.name not in RESUMABLE and getattr(saved, f.name) != getattr(wanted, f.name)
    }
    if diff:
        listing = ", ".join(f"{k}: saved {a!r} vs asked {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"--resume: the checkpoint was trained with other options ({listing}); "
            f"only {', '.join(sorted(RESUMABLE))} may change"
        )


def train(
    config: LabConfig,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    ctx: DistContext | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    stop_after: int | None = None,
    fsdp: bool = False,
    context_parallel: bool = False,
) -> TrainResult:
    """Train a :class:`TransformerEncoder` on ``config.task``.

    Args:
        config: The run.
        out_dir: Directory for ``checkpoint.safetensors`` and ``config.json`` (only the main
            process writes). None: no files.
        resume: Continue from ``out_dir``'s checkpoint (model, optimizer, step, RNG, history).
        ctx: Data-parallel context (see :func:`attnkit.lab.distributed.init_distributed`).
        progress: Show a tqdm progress bar with loss and accuracy (main process only).
        log: Called with one-line messages (main process only).
        stop_after: Stop (after checkpointing) once this step is reached, as if the run had been
            interrupted there; for tests of ``resume``.
        fsdp: Shard parameters, gradients and optimizer state over the processes with torch's
            FSDP2 (``fully_shard`` on each block, then on the model) instead of replicating
            them with DDP. Checkpoints hold the full state either way (gathered to rank 0).
        context_parallel: Shard each training sequence over the processes instead of the
            batch: every process takes the whole batch but only its contiguous slice of the
            positions (``seq_len`` must divide evenly), passes them as the model's
            ``positions``, and attends over the whole sequence with
            :func:`attnkit.distributed.ring_attention` as every attention layer's ``kernel``
            (during the training steps only; evaluation runs the whole sequence on rank 0).
            With ``fsdp`` too, the same processes also shard the parameters.

    Returns:
        A :class:`TrainResult` (its ``eval`` is filled on every process).

    Raises:
        ValueError: If the global batch does not split evenly over the processes or a resumed
            checkpoint was trained with other options.
        FileNotFoundError: If ``resume`` is set and there is no checkpoint.
    """
    from tqdm.auto import tqdm

    ctx = ctx if ctx is not None else DistContext()
    say = log if (log is not None and ctx.is_main) else (lambda _msg: None)
    cp = context_parallel and ctx.distributed
    if cp and config.seq_len % ctx.world_size:
        raise ValueError(
            f"--context-parallel: seq_len ({config.seq_len}) must be divisible by the number "
            f"of processes ({ctx.world_size})"
        )
    if not cp and config.batch_size % ctx.world_size:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be divisible by the number of "
            f"processes ({ctx.world_size})"
        )
    if resume and out_dir is None:
        raise ValueError("resume needs an out_dir holding a checkpoint")
    sharded = fsdp and ctx.distributed
    out = Path(out_dir) if out_dir is not None else None
    task = config.make_task()
    torch.manual_seed(config.seed)
    model = build_model(config).to(ctx.device)
    history: list[dict[str, float]] = []
    start, train_time, resumed_from = 0, 0.0, None
    if resume:
        assert out is not None
        tensors, meta = ckpt.load_checkpoint(out / ckpt.CHECKPOINT_NAME)
        _check_resumable(LabConfig.from_dict(meta["config"]), config)
        model.load_state_dict(ckpt.model_state(tensors))  # before sharding: whole tensors
        start, train_time = int(meta["step"]), float(meta["train_time_s"])
        history, resumed_from = list(meta["history"]), start

    net: nn.Module = model
    if sharded:
        from torch.distributed.fsdp import fully_shard

        # The logits are a view; the loop never changes them in place, which is what it warns of.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    if resume:
        if sharded:
            ckpt.restore_sharded(optimizer, tensors, meta)
        else:
            ckpt.restore_optimizer(optimizer, tensors, meta)
        torch.set_rng_state(tensors["rng.torch"])
        say(f"resumed from step {start} of {Path(str(out_dir)) / ckpt.CHECKPOINT_NAME}")

    eval_x, eval_y = eval_set(task, config.eval_size, config.seed)
    shard = config.batch_size if cp else config.batch_size // ctx.world_size
    lo = 0 if cp else ctx.rank * shard
    # Context parallel: this process's positions of every sequence.
    pos = shard_positions(config.seq_len, ctx.rank, ctx.world_size) if cp else None
    ring_group = None
    if cp:  # the ring's sends get their own group, apart from DDP's gradient all-reduces
        import torch.distributed as dist

        ring_group = dist.new_group(list(range(ctx.world_size)))

    def save(step: int) -> None:
        if out is None:
            return
        # A sharded model's full state is gathered by every rank; rank 0 writes it.
        weights, optim = ckpt.full_states(model, optimizer) if sharded else (model, optimizer)
        if not ctx.is_main:
            return
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "config": config.to_dict(),
            "model": config.model_config().to_dict(),  # for loaders that lack the lab
            "step": step,
            "train_time_s": train_time,
            "history": history,
        }
        ckpt.write_json(out / "config.json", config.to_dict())
        ckpt.save_checkpoint(
            out / ckpt.CHECKPOINT_NAME, model=weights, optimizer=optim, metadata=meta
        )

    end = config.steps if stop_after is None else min(config.steps, stop_after)
    bar = tqdm(
        total=config.steps,
        initial=start,
        desc=f"{config.task} ({config.positions})",
        unit="step",
        disable=not (progress and ctx.is_main),
        dynamic_ncols=True,
        leave=True,
    )
    log_every = max(1, min(20, config.steps // 50))
    window = [0.0, 0.0, 0.0]  # loss sum, correct, count since the last history row
    model.train()
    for step in range(start, end):
        t0 = time.perf_counter()
        x, y = train_batch(config, task, step)  # (B, L): the global batch, on every process
        n_global = float((y != IGNORE).sum())
        x, y = x[lo : lo + shard].to(ctx.device), y[lo : lo + shard].to(ctx.device)  # this shard
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(config, step)
        if pos is not None:
            x, y = x[:, pos], y[:, pos]
            with ring_kernels(model, ring_group), autocast(config.dtype, ctx.device):
                logits = net(x, positions=pos.to(ctx.device))
        else:
            with autocast(config.dtype, ctx.device):
                logits = net(x)
        loss_sum, correct, count = _masked_stats(logits, y)
        # DDP averages gradients over processes, hence the world_size factor.
        loss = loss_sum * (ctx.world_size / max(n_global, 1.0))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        train_time += time.perf_counter() - t0
        stats = ctx.all_reduce_sum([float(loss_sum.detach()), float(correct), float(count)])
        window = [a + b for a, b in zip(window, stats, strict=True)]
        done = step + 1
        eval_due = bool(config.eval_every) and done % config.eval_every == 0
        if done % log_every == 0 or done == end or eval_due:
            row = {
                "step": done,
                "loss": window[0] / max(window[2], 1.0),
                "accuracy": window[1] / max(window[2], 1.0),
                "lr": _lr_at(config, step),
            }
            window = [0.0, 0.0, 0.0]
            # (a sharded model's forward is a collective: every rank evaluates)
            if eval_due and done != config.steps and (ctx.is_main or sharded):
                ev = evaluate(model, eval_x, eval_y, dtype=config.dtype)
                row |= {"eval_loss": ev["loss"], "eval_accuracy": ev["accuracy"]}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}", refresh=False)
        bar.update(1)
        if config.save_every and done % config.save_every == 0 and done != end:
            save(done)
    bar.close()
    step = max(start, end)
    final = evaluate(model, eval_x, eval_y, dtype=config.dtype)
    if step == config.steps and (not history or "eval_accuracy" not in history[-1]):
        if history and history[-1]["step"] == step:
            history[-1] |= {"eval_loss": final["loss"], "eval_accuracy": final["accuracy"]}
        else:
            history.append(
                {"step": step, "eval_loss": final["loss"], "eval_accuracy": final["accuracy"]}
            )
    save(step)
    ctx.barrier()
    if sharded:  # hand back a plain model: reports and explorers run on rank 0 only
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        model = build_model(config).to(ctx.device)
        model.load_state_dict(weights)
    model.eval()
    say(
        f"step {step}: held-out accuracy {final['accuracy']:.4f} "
        f"(sequences fully right: {final['sequence_accuracy']:.4f}), "
        f"training time {train_time:.1f} s"
    )
    return TrainResult(
        config=config,
        model=model,
        history=history,
        eval=final,
        train_time_s=train_time,
        step=step,
        resumed_from=resumed_from,
        world_size=ctx.world_size,
    )


@contextlib.contextmanager
def ring_kernels(model: nn.Module, group: Any = None) -> Iterator[None]:
    """Within the block, every :class:`~attnkit.attention.MultiHeadAttention` of ``model``
    attends with :func:`attnkit.distributed.ring_attention` over ``group`` (its kernel is
    restored afterwards)."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    saved = [m.kernel for m in layers]
    for m in layers:
        m.kernel = RingKernel(group)
    try:
        yield
    finally:
        for m, kernel in zip(layers, saved, strict=True):
            m.kernel = kernel


def load_trained(out_dir: str | Path) -> tuple[TransformerEncoder, LabConfig, dict[str, Any]]:
    """Rebuild the trained model of a lab run from its checkpoint.

    Returns:
        ``(model, config, metadata)`` with the model in eval mode.
    """
    tensors, meta = ckpt.load_checkpoint(Path(out_dir) / ckpt.CHECKPOINT_NAME)
    config = LabConfig.from_dict(meta["config"])
    model = build_model(config)
    if "model" in meta and TransformerConfig.from_dict(meta["model"]) != model.config:
        raise ValueError(
            f"checkpoint's model config {meta['model']} does not match its lab config's "
            f"{model.config.to_dict()}"
        )
    model.load_state_dict(ckpt.model_state(tensors))
    return model.eval(), config, meta


def with_overrides(config: LabConfig, **changes: Any) -> LabConfig:
    """``dataclasses.replace`` that ignores ``None`` values (CLI options left unset)."""
    return replace(config, **{k: v for k, v in changes.items() if v is not None})
