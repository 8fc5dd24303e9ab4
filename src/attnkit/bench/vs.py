"""``attnkit bench --vs``: attnkit against what a user would pick instead, in one table.

Every row is one job timed side by side in one process (interleaved rounds, medians, after one
warm-up call each that also checks the results agree), with both absolute times and the ratio
``peer time / attnkit time`` (above 1: attnkit is faster):

* ``window fwd`` / ``window fwd+bwd``: causal sliding window (8 heads, E=64, fp32) through
  :func:`attnkit.functional.scaled_dot_product_attention`, against torch's SDPA given the dense
  mask and compiled FlexAttention (forward only: torch 2.13 has no FlexAttention backward on
  CPU; its compile time is in the note);
* ``documents fwd`` / ``documents fwd+bwd``: causal attention within packed documents
  (``segment_ids``), same peers;
* ``flex window fwd`` / ``flex window first call`` / ``flex alibi+causal fwd`` / ``flex window
  fwd+bwd``: :func:`attnkit.flex.flex_attention` against torch's compiled FlexAttention (warm,
  and the first call with its compilation) and, with the backward, dense-mask SDPA
  (:mod:`attnkit.bench.flex_speed`; goals 1.5x, 1.0x and 12x);
* ``ring fwd+bwd`` / ``ring memory``: causal :func:`attnkit.distributed.ring_attention` on
  2 gloo processes against one process on the whole sequence (N=16384, 8 heads, E=64, fp32,
  one thread per process; :mod:`attnkit.bench.ring`): the slowest rank's time, and the largest
  per-rank peak memory growth (goal: at most 0.6x that of one process, i.e. ``x >= 1.67``);
* ``MiniLM encode``: :class:`attnkit.interop.SentenceEncoder` against sentence-transformers on
  all-MiniLM-L6-v2, 128 texts of mixed length (one of 400 words), batch 32;
* ``decode llama-3m`` / ``decode llama-100m`` (eager and ``compile``): cached greedy generation
  against transformers' ``LlamaForCausalLM`` with the same weights, and the 100M model's bf16
  weights against its fp32 ones (:mod:`attnkit.bench.decoding`; notes give tokens/s and the share
  of the read-bandwidth bound);
* ``decode llama-135m compile`` (fp32 and bf16 weights): the 30-layer D576 shape of real small
  checkpoints, compiled, with each dtype's share of its own read-bandwidth bound;
* ``first token llama-135m`` (fp32 and bf16, prompts 256 and 2048): time to first token against
  transformers in the same dtype, and bf16 against attnkit's fp32 (goals at 2048 tokens: bf16
  >= 1.0x transformers, and >= 2.5x attnkit fp32 where torch's bf16 GEMM is >= 4x its fp32);
* ``speculative prompt lookup``: greedy decoding with ``prompt_lookup_num_tokens`` against plain
  greedy decoding on the same model, where the output repeats earlier tokens
  (:mod:`attnkit.bench.speculative`; same tokens, checked).

Peers that are not installed give a row that says so instead of a time. Rows come from the
makers in :data:`ROW_MAKERS`, in order; a new comparison is one function
``maker(config) -> list[VsRow]`` added there with :func:`register`.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROW_MAKERS",
    "AttentionJob",
    "VsConfig",
    "VsRow",
    "format_vs_table",
    "register",
    "run_vs",
]


@dataclass(frozen=True)
class AttentionJob:
    """The attention problem of the window and documents rows: one sequence, fp32.

    Attributes:
        seq_len: Tokens ``N``.
        window: Sliding window of the window rows.
        documents: Equal documents packed into ``seq_len`` for the documents rows.
        heads: Attention heads.
        head_dim: Head dim E.
    """

    seq_len: int = 8192
    window: int = 256
    documents: int = 8
    heads: int = 8
    head_dim: int = 64


@dataclass(frozen=True)
class VsConfig:
    """What the ``--vs`` rows measure.

    Attributes:
        attention: The problem of the structured-attention rows.
        repeats: Timed rounds per row (medians).
        flex: Whether to compile and time FlexAttention.
        texts: Texts of the sentence-embedding row.
        long_words: Words of its one long text.
        decode_models: Models of :data:`attnkit.bench.decoding.DECODE_MODELS` for the decoding
            rows (cached greedy generation against transformers).
        decode_compile: Also time ``generate(..., compile=True)`` (compiles once per model).
        checkpoint_model: Model of the compiled fp32/bf16 decoding rows on the shape of real
            small checkpoints (None: no such rows).
        prefill_model: Model of the time-to-first-token rows
            (:data:`attnkit.bench.decoding.QUANT_MODELS`).
        prefill_prompts: Their prompt lengths.
        ring_len: Whole sequence of the ring rows.
        ring_world: Processes of the ring rows.
        speculative_model: Model of the prompt lookup row (:mod:`attnkit.bench.speculative`).
        flex_quick: The flex rows at :meth:`attnkit.bench.flex_speed.FlexSpeedJob.quick`'s
            sizes instead of the full ones.
    """

    attention: AttentionJob = field(default_factory=AttentionJob)
    repeats: int = 3
    flex: bool = True
    texts: int = 128
    long_words: int = 400
    decode_models: tuple[str, ...] = ("llama-3m", "llama-100m")
    decode_compile: bool = True
    checkpoint_model: str | None = "llama-135m"
    prefill_model: str = "llama-135m"
    prefill_prompts: tuple[int, ...] = (256, 2048)
    ring_len: int = 16384
    ring_world: int = 2
    speculative_model: str = "llama-135m"
    flex_quick: bool = False

    @classmethod
    def quick(cls, *, flex: bool = False) -> VsConfig:
        """Sizes small enough to run every row in seconds (a smoke test, not a measurement)."""
        return cls(
            AttentionJob(seq_len=512, window=32, documents=4, heads=2, head_dim=16),
            repeats=1,
            flex=flex,
            texts=6,
            long_words=40,
            decode_models=("llama-tiny",),
            decode_compile=False,
            checkpoint_model=None,
            prefill_model="llama-tiny",
            prefill_prompts=(16,),
            ring_len=512,
            speculative_model="llama-tiny",
            flex_quick=True,
        )


@dataclass
class VsRow:
    """One comparison: attnkit and one peer on the same job.

    Attributes:
        job: What runs, e.g. ``"window fwd"``.
        peer: What a user would pick instead.
        attnkit_s: Median seconds of attnkit (bytes for a ``unit="bytes"`` row), or None when
            not measured.
        peer_s: Median seconds of the peer (bytes), or None when it could not run.
        note: Sizes, agreement, compile time, why a peer was skipped.
        goal: The ratio ``peer / attnkit`` this row aims at, if any.
        unit: ``"s"`` (times) or ``"bytes"`` (peak memory).
    """

    job: str
    peer: str
    attnkit_s: float | None
    peer_s: float | None
    note: str = ""
    goal: float | None = None
    unit: str = "s"

    @property
    def target(self) -> str:
        """The goal and whether it is met, e.g. ``">= 12x: 6% short"``; empty without a goal."""
        if self.goal is None:
            return ""
        text = f">= {self.goal:.3g}x"
        if self.speedup is None:
            return text
        if self.speedup >= self.goal:
            return f"{text}: met"
        return f"{text}: {100 * (1 - self.speedup / self.goal):.0f}% short"

    @property
    def speedup(self) -> float | None:
        """``peer_s / attnkit_s`` (above 1: attnkit is faster), or None."""
        if self.attnkit_s is None or self.peer_s is None:
            return None
        return self.peer_s / self.attnkit_s


#: The FlexAttention peer's name in the table.
FLEX = "FlexAttention (compiled)"
RowMaker = Callable[[VsConfig], list[VsRow]]
#: The row makers of the table, in order. Each measures its job side by side in one process.
ROW_MAKERS: dict[str, RowMaker] = {}


def register(name: str, maker: RowMaker) -> None:
    """Add (or replace) a maker of ``--vs`` rows; rows appear in registration order.

    Args:
        name: A short key, e.g. ``"decoding"``.
        maker: ``maker(config) -> list[VsRow]``.
    """
    ROW_MAKERS[name] = maker


def run_vs(config: VsConfig, *, progress: bool = True) -> list[VsRow]:
    """Run every registered maker (with a progress bar on stderr when tqdm is installed).

    Args:
        config: Sizes and repeats.
        progress: Show a progress bar.

    Returns:
        All rows, in table order.
    """
    rows: list[VsRow] = []
    bar = _progress(list(ROW_MAKERS), "attnkit bench --vs", enabled=progress)
    for name in bar:
        if hasattr(bar, "set_postfix_str"):  # the job being measured, beside the counter
            bar.set_postfix_str(name)
        rows += ROW_MAKERS[name](config)
    return rows


def format_vs_table(rows: list[VsRow], config: VsConfig) -> str:
    """The rows as a plain-text table (times in ms, ``x`` = peer time / attnkit time)."""
    import torch

    from attnkit.bench.results import cpu_model

    head = (
        f"attnkit bench --vs  {cpu_model()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
        f"{config.repeats} interleaved rounds; x = peer time / attnkit time (> 1: attnkit faster)"
    )
    cols = ("job", "attnkit ms", "peer", "peer ms", "x", "target", "note")  # or MiB, as marked
    table = [cols]
    for r in rows:
        table.append(
            (
                r.job,
                _value(r.attnkit_s, r.unit),
                r.peer,
                _value(r.peer_s, r.unit),
                "-" if r.speedup is None else f"{r.speedup:.2f}",
                r.target,
                r.note,
            )
        )
    widths = [max(len(row[c]) for row in table) for c in range(len(cols) - 1)]
    lines = [head]
    for row in table:
        pairs = enumerate(zip(row[:-1], widths, strict=True))
        cells = [f"{x:<{w}}" if c in (0, 2, 5) else f"{x:>{w}}" for c, (x, w) in pairs]
        lines.append("  ".join(cells) + "  " + row[-1])
    return "\n".join(lines)


def rows_as_json(rows: list[VsRow], config: VsConfig) -> dict[str, Any]:
    """The report written by ``--json`` (with :func:`attnkit.bench.results.machine`)."""
    from attnkit.bench.results import machine

    return {
        "kind": "vs",
        "machine": machine(),
        "config": asdict(config),
        "rows": [{**asdict(r), "speedup": r.speedup, "target": r.target} for r in rows],
    }


# --------------------------------------------------------------------------------------------
# structured attention rows


def _structured_rows(case: str, config: VsConfig) -> list[VsRow]:
    import torch
    import torch.nn.functional as F

    from attnkit.functional import scaled_dot_product_attention
    from attnkit.masks import structured_mask

    job = config.attention
    n = job.seq_len
    if case == "window":
        kw: dict[str, Any] = {"causal": True, "window": job.window}
        size = f"N={n} W={job.window}"
    else:
        doc = n // job.documents
        seg = (torch.arange(n) // doc).clamp(max=job.documents - 1).view(1, n)
        kw = {"causal": True, "segment_ids": seg}
        size = f"{job.documents}x{doc} in N={n}"
    goals = {
        "dense-mask SDPA": {"fwd": 10.0, "fwd+bwd": 12.0},
        FLEX: {"fwd": 1.0},
    }
    mask = structured_mask(n, n, **kw)  # (1, 1, N, N)
    scale = job.head_dim**-0.5
    gen = torch.Generator().manual_seed(0)
    shape = (1, n, job.heads, job.head_dim)  # projections give (B, L, H, E) memory
    q, k, v = (torch.randn(shape, generator=gen).transpose(1, 2) for _ in range(3))
    grad = torch.randn(q.shape, generator=gen)

    peers: dict[str, Callable[..., torch.Tensor]] = {
        "dense-mask SDPA": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale
        ),
    }
    flex_note = ""
    if config.flex:
        from attnkit.bench.flex import flex_or_reason

        flex, first_s, why = flex_or_reason(q, q, scale=scale, **kw)
        if flex is not None:
            peers[FLEX] = flex
            flex_note = f"Flex first call (compile) {first_s:.1f} s"
        else:
            flex_note = why
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        backward = mode == "fwd+bwd"
        fns: dict[str, Callable[..., torch.Tensor]] = {
            "attnkit": lambda q, k, v: scaled_dot_product_attention(q, k, v, scale=scale, **kw),
            **{p: f for p, f in peers.items() if not (backward and p.startswith("Flex"))},
        }
        times, err = _time_attention(fns, q, k, v, grad, backward, config.repeats)
        for peer in peers:
            note = f"{size}, fp32, H={job.heads}, E={job.head_dim}"
            if peer.startswith("Flex"):
                if backward:
                    why = "no FlexAttention backward on CPU in torch 2.13"
                    rows.append(VsRow(f"{case} {mode}", peer, times["attnkit"], None, why))
                    continue
                note += f"; {flex_note}"
            note += f"; max diff {err[peer]:.1e}"
            goal = goals[peer].get(mode)
            rows.append(VsRow(f"{case} {mode}", peer, times["attnkit"], times[peer], note, goal))
        if config.flex and FLEX not in peers and not backward:
            rows.append(VsRow(f"{case} {mode}", FLEX, times["attnkit"], None, flex_note))
    return rows


def _time_attention(
    fns: dict[str, Callable[..., torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    backward: bool,
    repeats: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per implementation, and each one's max difference from attnkit's result
    (values, and gradients with ``backward``)."""
    import torch

    from attnkit.profiling import time_interleaved

    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))

    def step(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with torch.set_grad_enabled(backward):
            out = fn(qg, kg, vg)
            if not backward:
                return (out.detach(),)
            return (out.detach(), *torch.autograd.grad(out, (qg, kg, vg), grad))

    results = {name: step(fn) for name, fn in fns.items()}  # also the warm-up
    ours = results["attnkit"]
    err = {
        name: max(float((a - b).abs().max()) for a, b in zip(res, ours, strict=True))
        for name, res in results.items()
    }
    samples = time_interleaved(
        {name: functools.partial(step, fn) for name, fn in fns.items()}, repeats=repeats
    )
    return {name: statistics.median(t) for name, t in samples.items()}, err


# --------------------------------------------------------------------------------------------
# sentence embeddings


def _sentence_rows(config: VsConfig) -> list[VsRow]:
    from attnkit.bench.sentence import make_texts, minilm_peer
    from attnkit.profiling import time_interleaved

    job, peer = "MiniLM encode", "sentence-transformers"
    texts = make_texts(config.texts, long_words=config.long_words)
    size = f"{len(texts)} texts (one of {config.long_words} words), batch 32"
    try:
        from attnkit.interop import SentenceEncoder

        ours = SentenceEncoder.from_pretrained()
    except ImportError as err:
        return [VsRow(job, peer, None, None, f"skipped: {err}")]
    try:
        theirs = minilm_peer()
    except ImportError as err:
        return [VsRow(job, peer, None, None, f"peer skipped: {err}")]

    def run_ours() -> torch.Tensor:
        return ours.encode(texts, batch_size=32)

    def run_theirs() -> torch.Tensor:
        out: torch.Tensor = theirs.encode(texts, batch_size=32, convert_to_tensor=True)
        return out

    diff = float((run_ours() - run_theirs()).abs().max())  # also the warm-up
    samples = time_interleaved({"ours": run_ours, "theirs": run_theirs}, repeats=config.repeats)
    return [
        VsRow(
            job,
            peer,
            statistics.median(samples["ours"]),
            statistics.median(samples["theirs"]),
            f"{size}; diff goal <= 1e-5; max diff {diff:.1e}",
            1.3,
        )
    ]


register("window", lambda config: _structured_rows("window", config))
register("documents", lambda config: _structured_rows("documents", config))


def _flex_rows(config: VsConfig) -> list[VsRow]:
    """:mod:`attnkit.flex` against compiled FlexAttention and dense-mask SDPA (see
    :mod:`attnkit.bench.flex_speed`); the compiled peer only with ``config.flex``."""
    from attnkit.bench.flex_speed import FlexSpeedJob, flex_rows

    job = FlexSpeedJob.quick() if config.flex_quick else FlexSpeedJob(repeats=config.repeats)
    return [VsRow(**row) for row in flex_rows(replace(job, flex=config.flex))]


register("flex", _flex_rows)
register("sentence", _sentence_rows)


def _decoding_rows(config: VsConfig) -> list[VsRow]:
    """Cached greedy generation against transformers (see :mod:`attnkit.bench.decoding`)."""
    from attnkit.bench.decoding.rows import vs_rows

    rows = vs_rows(
        repeats=config.repeats, compile=config.decode_compile, names=config.decode_models
    )
    return [VsRow(**row) for row in rows]


register("decoding", _decoding_rows)


def _small_checkpoint_rows(config: VsConfig) -> list[VsRow]:
    """The shape of real small checkpoints (:data:`VsConfig.checkpoint_model`), compiled, fp32
    and bf16, each with its share of the read-bandwidth bound (see
    :mod:`attnkit.bench.decoding.rows`)."""
    from attnkit.bench.decoding.rows import vs_rows

    if config.checkpoint_model is None:
        return []
    rows = vs_rows(
        repeats=config.repeats, compile=True, eager=False, names=(config.checkpoint_model,)
    )
    return [VsRow(**row) for row in rows]


register("small checkpoint decoding", _small_checkpoint_rows)


def _batched_rows(config: VsConfig) -> list[VsRow]:
    """Left-padded prompts decoded together against transformers' batched generate (see
    :mod:`attnkit.bench.decoding.batched`), on the first decoding model."""
    from attnkit.bench.decoding.batched import vs_batched_rows

    rows = vs_batched_rows(
        repeats=config.repeats, compile=config.decode_compile, names=config.decode_models[:1]
    )
    return [VsRow(**row) for row in rows]


register("batched decoding", _batched_rows)


def _prefill_rows(config: VsConfig) -> list[VsRow]:
    """Time to first token against transformers (see :mod:`attnkit.bench.decoding`)."""
    from attnkit.bench.decoding.prefill import vs_prefill_rows

    rows = vs_prefill_rows(
        config.prefill_model, prompts=config.prefill_prompts, repeats=max(config.repeats, 3)
    )
    return [VsRow(**row) for row in rows]


register("prefill", _prefill_rows)


def _speculative_rows(config: VsConfig) -> list[VsRow]:
    """Greedy decoding with prompt lookup against plain greedy decoding, where the output
    repeats earlier tokens (see :mod:`attnkit.bench.speculative`)."""
    from attnkit.bench.speculative import vs_rows

    return [VsRow(**row) for row in vs_rows(config.speculative_model, repeats=config.repeats)]


register("speculative", _speculative_rows)


#: The ring's goal: per-rank peak memory at most this fraction of one process's.
RING_MEMORY_GOAL = 0.6


def _ring_rows(config: VsConfig) -> list[VsRow]:
    """Ring attention on ``ring_world`` processes against one process (see
    :mod:`attnkit.bench.ring`)."""
    from attnkit.bench.ring import RingJob, measure_ring

    att, n, world = config.attention, config.ring_len, config.ring_world
    jobs = {w: RingJob(n, w, "contiguous", att.heads, att.head_dim, config.repeats)
            for w in (1, world)}  # fmt: skip
    single, ring = (measure_ring(job) for job in jobs.values())
    size = f"causal N={n}, fp32, H={att.heads}, E={att.head_dim}, 1 thread per process"
    peer = "1 process"
    per_rank = ", ".join(f"{t:.2f}" for t in ring["seconds"])
    return [
        VsRow(f"ring fwd+bwd {world} ranks", peer, max(ring["seconds"]), single["seconds"][0],
              f"{size}; slowest rank; per rank s {per_rank}"),
        VsRow(f"ring memory {world} ranks", peer, max(ring["peak"]), single["peak"][0],
              f"{size}; largest per-rank peak growth (VmHWM); goal <= {RING_MEMORY_GOAL}x "
              "one process", 1 / RING_MEMORY_GOAL, "bytes"),
    ]  # fmt: skip


register("ring", _ring_rows)


# --------------------------------------------------------------------------------------------
# helpers


def _value(x: float | None, unit: str) -> str:
    """Seconds as ms, bytes as ``"... MiB"``, ``"-"`` for nothing."""
    if x is None:
        return "-"
    return f"{x / 2**20:.1f} MiB" if unit == "bytes" else f"{x * 1e3:.1f}"


def _progress(items: list[str], desc: str, *, enabled: bool) -> Iterable[str]:
    """``items`` wrapped in a tqdm bar on stderr (plain iteration without tqdm)."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{desc}: {len(items)} steps (install tqdm for a progress bar)", file=sys.stderr)
        return items
    return tqdm(items, desc=desc, file=sys.stderr, unit="job")
