"""Quality and loading memory of weight-only quantization on real weights.

* **Quality on English text.** :func:`english_text` collects English prose that every Python
  installation ships offline (the docstrings of a fixed list of standard-library modules; whole
  modules go to the held-out split). :func:`train_text_lm` trains a byte-level Llama-shaped
  :class:`attnkit.TransformerLM` on the training split until the held-out loss stops improving and
  saves it as a Hugging Face folder (with a byte-level ``tokenizer.json``). :func:`quality_rows`
  loads any decoder folder (that one, or a real checkpoint a user points at) in fp32, bf16, int8
  and int4 (and torchao's int8 when installed) and reports, on held-out text, the share of
  positions whose top-1 next token matches fp32's and the perplexity change.
* **Loading peak memory.** :func:`load_peak` loads a folder with ``quantize=`` in a child process
  and reads the peak resident memory (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``), over the bytes of the loaded model's tensors.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import subprocess
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.bench.quantization.speed import quantization_quality, torchao_int8
from attnkit.config import FAMILIES, TransformerConfig
from attnkit.models import TransformerLM

__all__ = [
    "QUALITY_LM",
    "english_text",
    "load_peak",
    "quality_rows",
    "text_ids",
    "train_text_lm",
]

#: The byte-level decoder :func:`train_text_lm` trains: dim 128, 4 layers, 2 heads of 64, SwiGLU
#: 384, RMSNorm, rotary, tied head (every linear's sizes fit int4's group of 128).
QUALITY_LM = TransformerConfig(
    256, 128, 4, 2, num_kv_heads=2, ffn_dim=384, max_seq_len=256, **FAMILIES["llama"]
)

# Standard-library modules whose docstrings make the English corpus.
_MODULES = (  # (split by english_text)
    "abc argparse array ast asyncio.events base64 bisect bz2 calendar cmd codecs collections "
    "colorsys concurrent.futures configparser contextlib copy csv ctypes dataclasses datetime "
    "decimal difflib dis doctest email.message enum fnmatch fractions ftplib functools getopt "
    "gettext glob graphlib gzip hashlib heapq hmac html.parser http.client imaplib importlib "
    "inspect io itertools json locale logging lzma mailbox math mimetypes mmap multiprocessing "
    "netrc numbers operator optparse os pathlib pdb pickle pkgutil platform plistlib poplib pprint "
    "pydoc queue random re runpy sched secrets selectors shlex shutil signal site smtplib socket "
    "sqlite3 ssl statistics string struct subprocess sysconfig tarfile tempfile textwrap threading "
    "timeit tokenize trace traceback typing unicodedata unittest.case urllib.request uuid warnings "
    "wave weakref xml.dom.minidom zipfile zipimport zoneinfo"
)
_HELD_OUT_MODULUS = 7  # one module in 7 (by name hash) is held out


def _docstrings(name: str) -> list[str]:
    try:
        module = importlib.import_module(name)
    except ImportError:  # pragma: no cover - a build without the module
        return []
    objects: list[Any] = [module]
    for key, value in vars(module).items():
        if key.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            objects.append(value)
        elif inspect.isclass(value):
            objects.append(value)
            objects += [
                v for k, v in vars(value).items() if not k.startswith("_") and inspect.isfunction(v)
            ]
    with warnings.catch_warnings():  # (typing's deprecated io/re namespaces warn when read)
        warnings.simplefilter("ignore", DeprecationWarning)
        docs = [inspect.getdoc(o) for o in objects]
    return [d for d in docs if d and d.isascii()]


def english_text() -> tuple[str, str]:
    """``(training, held-out)`` English text: standard-library docstrings, whole modules to the
    held-out split (one in :data:`_HELD_OUT_MODULUS` by a hash of the name).
    """
    seen: set[str] = set()
    splits: tuple[list[str], list[str]] = ([], [])
    for name in _MODULES.split():
        held_out = zlib.crc32(name.encode()) % _HELD_OUT_MODULUS == 0
        for doc in _docstrings(name):
            if doc not in seen:
                seen.add(doc)
                splits[held_out].append(doc)
    return "\n\n".join(splits[0]), "\n\n".join(splits[1])


def _bytes_to_unicode() -> dict[int, str]:
    """The printable stand-in for each byte that byte-level BPE tokenizers use."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def byte_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` whose id of each byte is the byte's value (needs
    ``tokenizers``)."""
    import tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def _byte_ids(text: str) -> Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()


def text_ids(folder: str | Path, text: str) -> Tensor:
    """``text`` as the token ids of the model in ``folder``: its ``tokenizer.json``, or bytes for
    a model of 256 tokens without one.

    Shape: ``(tokens,)``.

    Raises:
        ValueError: If the folder has no ``tokenizer.json`` and is not a byte-level model.
    """
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        return torch.tensor(tok.encode(text, add_special_tokens=False).ids)
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size")
    if vocab != 256:
        raise ValueError(f"{folder} has no tokenizer.json and vocab_size {vocab}, not bytes (256)")
    return _byte_ids(text)


def _windows(ids: Tensor, length: int, count: int | None = None) -> Tensor:
    """Non-overlapping rows of ``length`` tokens (``count`` of them at most), ``(rows, length)``."""
    rows = len(ids) // length
    if count is not None:
        rows = min(rows, count)
    return ids[: rows * length].reshape(rows, length)


@torch.no_grad()
def _held_out_loss(model: nn.Module, rows: Tensor, batch: int = 16) -> float:
    losses = []
    for start in range(0, len(rows), batch):
        x = rows[start : start + batch]
        logits = model(x[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


def train_text_lm(
    out: str | Path,
    *,
    config: TransformerConfig = QUALITY_LM,
    max_steps: int = 2500,
    batch: int = 16,
    seq_len: int = 64,
    lr: float = 3e-3,
    eval_every: int = 100,
    patience: int = 3,
    min_improvement: float = 0.005,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train a byte-level causal LM on :func:`english_text` until the held-out loss converges.

    AdamW, linear warm-up over ``eval_every`` steps, then constant ``lr`` until the held-out loss
    (every ``eval_every`` steps) has not improved by ``min_improvement`` (relative) for
    ``patience`` evaluations; then ``lr`` decays to zero linearly over another ``eval_every``
    steps, and the run has converged (``max_steps`` bounds the whole run). At each evaluation
    that improves on the best, the weights are saved to ``out`` as a Hugging Face folder with a
    byte-level ``tokenizer.json`` (when ``tokenizers`` is installed); ``training.json`` holds
    the record returned, updated at every evaluation.

    Returns:
        ``{"steps", "best_step", "converged", "held_out_loss", "held_out_bits_per_byte",
        "history", "seconds", "config", "seq_len", "batch"}``.

    Raises:
        ValueError: If ``config`` is not a 256-token decoder or a size is not positive.
    """
    if config.vocab_size != 256 or not config.causal:
        raise ValueError(f"train_text_lm needs a causal 256-token (byte) config, got {config}")
    for name, value in (("max_steps", max_steps), ("batch", batch), ("seq_len", seq_len)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    say = progress or (lambda _msg: None)
    train_text, held_text = english_text()
    train_ids = _byte_ids(train_text)
    held_rows = _windows(_byte_ids(held_text), seq_len + 1, 64)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TransformerLM(config.replace(max_seq_len=max(config.max_seq_len, seq_len)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    out = Path(out)
    record: dict[str, Any] = {
        "converged": False,
        "held_out_loss": math.inf,
        "history": [],
        "config": {"dim": config.dim, "layers": config.num_layers, "ffn_dim": config.ffn_dim},
        "seq_len": seq_len,
        "batch": batch,
    }
    stale, decay_from = 0, None
    start = time.perf_counter()
    for step in range(1, max_steps + 1):
        if decay_from is None:
            scale = min(1.0, step / eval_every)
        else:
            scale = max(0.0, 1 - (step - decay_from) / eval_every)
        for group in opt.param_groups:
            group["lr"] = lr * scale
        model.train()
        at = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([train_ids[i : i + seq_len + 1] for i in at.tolist()])
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every and step != max_steps:
            continue
        model.eval()
        held = _held_out_loss(model, held_rows)
        record["history"].append({"step": step, "train_loss": loss.item(), "held_out_loss": held})
        say(f"step {step}: train {loss.item():.3f}, held-out {held:.3f} nats/byte")
        best = record["held_out_loss"]
        stale = 0 if held < best * (1 - min_improvement) else stale + 1
        finished = decay_from is not None and scale == 0
        if decay_from is None and stale >= patience:
            decay_from = step
        record |= {"steps": step, "seconds": time.perf_counter() - start}
        if finished:
            record["converged"] = True
        if held < best:  # the best weights so far are saved (an interrupted run leaves them)
            record |= {"held_out_loss": held, "held_out_bits_per_byte": held / math.log(2)}
            record["best_step"] = step
            model.save_pretrained(out)
            with contextlib.suppress(ImportError):  # text_ids reads bytes without it
                byte_tokenizer().save(str(out / "tokenizer.json"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "training.json").write_text(json.dumps(record, indent=2))
        if finished:
            break
    return record


def _load(folder: Path, variant: str) -> nn.Module:
    if variant == "fp32":
        return TransformerLM.from_pretrained(folder)
    if variant == "bf16":
        return TransformerLM.from_pretrained(folder, dtype=torch.bfloat16)
    if variant == "torchao int8":
        return torchao_int8(TransformerLM.from_pretrained(folder))
    return TransformerLM.from_pretrained(folder, quantize=variant)  # type: ignore[arg-type]


def quality_rows(
    folder: str | Path,
    text: str,
    *,
    context: int = 256,
    max_windows: int = 32,
    batch: int = 4,
    variants: tuple[str, ...] = ("bf16", "int8", "int4", "torchao int8"),
) -> list[dict[str, Any]]:
    """Top-1 agreement with fp32 and perplexity change of each variant of the decoder in
    ``folder`` on ``text`` (non-overlapping windows of ``context`` tokens, ``max_windows`` at
    most, ``batch`` windows per forward).

    Variants: ``"bf16"`` (bf16 weights), ``"int8"``/``"int4"`` (``from_pretrained(quantize=)``),
    ``"torchao int8"`` (torchao's ``Int8WeightOnlyConfig``; left out without torchao).

    Returns:
        One row per variant: ``variant``, ``top1_agreement``, ``perplexity``,
        ``reference_perplexity``, ``perplexity_change``, ``tokens``.

    Raises:
        ValueError: If the text gives fewer than ``batch`` windows, or an unknown variant.
    """
    known = ("bf16", "int8", "int4", "torchao int8")
    bad = [v for v in variants if v not in known]
    if bad:
        raise ValueError(f"unknown variants {bad}; known: {known}")
    folder = Path(folder)
    rows = _windows(text_ids(folder, text), context, max_windows)
    if len(rows) < batch:
        raise ValueError(
            f"the text gives {len(rows)} windows of {context} tokens, fewer than {batch} windows"
        )
    rows = rows[: len(rows) // batch * batch]
    reference = TransformerLM.from_pretrained(folder)
    out = []
    for variant in variants:
        try:
            model = _load(folder, variant)
        except ImportError:
            continue
        parts = [
            quantization_quality(reference, model, rows[i : i + batch])
            for i in range(0, len(rows), batch)
        ]
        # Equal-sized batches: the mean agreement and mean log-perplexity are the overall ones.
        agree = sum(p["top1_agreement"] for p in parts) / len(parts)
        ppl = math.exp(sum(math.log(p["perplexity"]) for p in parts) / len(parts))
        ref = math.exp(sum(math.log(p["reference_perplexity"]) for p in parts) / len(parts))
        out.append(
            {
                "variant": variant,
                "top1_agreement": agree,
                "perplexity": ppl,
                "reference_perplexity": ref,
                "perplexity_change": ppl / ref - 1,
                "tokens": rows.numel(),
            }
        )
    return out


_CHILD = """
import ctypes, functools, gc, json, sys, tempfile, torch
from pathlib import Path
from attnkit.models import TransformerLM
from attnkit.bench.quantization.speed import stored_bytes
from attnkit.interop import hf
from attnkit.interop.hf import config_from_hf, read_json
from attnkit.profiling import peak_memory
from attnkit.quantize import Int8Linear, quantize, quantize_linear
folder, mode, kernel = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

def load(folder):
    if mode == "fp32":
        return TransformerLM.from_pretrained(folder)
    if kernel == "default":
        return TransformerLM.from_pretrained(folder, quantize=mode)
    # from_pretrained's streaming quantization with a named int8 kernel
    replace = functools.partial(quantize_linear, mode=mode, int8_kernel=kernel)
    lm = hf.from_pretrained(folder, cls=TransformerLM, replace=replace)
    return quantize(lm, mode, int8_kernel=kernel)

def rss():
    gc.collect()
    try:  # (freed blocks back to the system: what stays is the model's)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None

# Warm-up: load a one-layer model of the same architecture first (imports, first-call buffers).
_, config = config_from_hf(read_json(folder / "config.json"))
with tempfile.TemporaryDirectory() as tmp:
    TransformerLM(config.replace(num_layers=1, vocab_size=256)).save_pretrained(tmp)
    load(Path(tmp))
box = []
base = rss()
peak = peak_memory(lambda: box.append(load(folder)))
model = box[0]
after = rss()
tensors = {t.data_ptr(): t.numel() * t.element_size()
           for t in [*model.parameters(), *model.buffers()] if t.numel()}
# fbgemm's prepacked int8 weights (kernel "fbgemm") live outside the tensors.
packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, Int8Linear))
kernels = sorted({m.kernel for m in model.modules() if isinstance(m, Int8Linear)})
print(json.dumps({"peak_bytes": peak, "model_bytes": sum(tensors.values()) + packed,
                  "packed_bytes": packed, "read_bytes": stored_bytes(model),
                  "resident_bytes": None if base is None else after - base,
                  "int8_kernels": kernels}))
"""


def load_peak(
    folder: str | Path, mode: str = "int8", *, int8_kernel: str = "default"
) -> dict[str, Any]:
    """Peak memory of ``TransformerLM.from_pretrained(folder, quantize=mode)`` in a fresh process.

    The child loads a one-layer model of the same architecture first (imports, first-call
    allocations), then resets its peak resident memory (``/proc/self/clear_refs``),
    loads, and reports the growth of ``VmHWM`` (:func:`attnkit.profiling.peak_memory`), the
    growth of ``VmRSS`` that stays with the loaded model, and the bytes of the loaded model's
    tensors with fbgemm's prepacked int8 weights (``packed_bytes``, one byte a weight);
    ``mode="fp32"`` loads without quantizing. ``int8_kernel`` (other than ``"default"``) loads
    with that :func:`attnkit.quantize.quantize` kernel, streaming as ``from_pretrained`` does.

    Returns:
        ``{"mode", "int8_kernel", "int8_kernels", "peak_bytes", "resident_bytes",
        "model_bytes", "packed_bytes", "read_bytes", "peak_over_model"}`` (``peak_bytes`` and
        ``resident_bytes`` ``None`` where ``/proc`` cannot be used; ``int8_kernels``: those the
        loaded int8 layers run).

    Raises:
        RuntimeError: If the child fails (with its error output).
    """
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), mode, int8_kernel],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"loading {folder} ({mode}) failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    peak = result["peak_bytes"]
    result["mode"], result["int8_kernel"] = mode, int8_kernel
    result["peak_over_model"] = None if peak is None else peak / result["model_bytes"]
    return result
