"""attnkit against llama.cpp (through ``llama-cpp-python``): decode tokens/s per precision.

Usage::

    python -m attnkit.bench.llamacpp                     # random 135M-shape Llama
    python -m attnkit.bench.llamacpp --model DIR --gguf-dir GGUFS
    python -m attnkit.bench.llamacpp --model DIR --gguf f32=FILE --gguf q8_0=FILE2

Needs ``llama-cpp-python`` (``pip install llama-cpp-python``; it builds llama.cpp from source,
so it is not a dependency of attnkit and no test runs this script); without it the script says
so and exits. Pairs, each measured side by side in interleaved rounds (medians of the decode-step
rate: the time of ``new`` tokens minus the time of one, over ``new - 1``):

* llama.cpp ``f32`` vs attnkit fp32 (``compile=True``),
* llama.cpp ``bf16`` vs attnkit bf16 weights (compiled),
* llama.cpp ``q8_0`` vs attnkit int8 weight-only (``quantize="int8"``, its default kernel;
  eager and compiled),
* llama.cpp ``q4_0`` (a scale per 32 weights) and ``q4_1`` (a scale and a minimum per 32) vs
  attnkit int4 weight-only (``quantize="int4"``: a scale and an offset per group of 32 inputs;
  compiled).

The GGUF files: ``--gguf PRECISION=FILE`` (e.g. converted with llama.cpp's own
``convert_hf_to_gguf.py --outtype f32|bf16|q8_0``), or, for the precisions not given, written
here from the attnkit model with the ``gguf`` package's writer (tensor names and the rotary
channel order of llama.cpp's converter; q8_0, q4_0 and q4_1 quantized by ``gguf.quants``).
Goals: attnkit / llama.cpp >= 1.15 in fp32 and >= 1.0 in bf16. Each GGUF file is first run in a
child process: a precision whose llama.cpp path crashes on this CPU is left out and reported.

Prints a table and writes JSON (default ``benchmarks/results/llamacpp.json``).
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnkit.bench.decoding.models import QUANT_MODELS
from attnkit.bench.peers import import_quietly
from attnkit.bench.quantization.speed import quantized_variants
from attnkit.bench.results import bench_parser, write_report
from attnkit.models import TransformerLM

PRECISIONS = ("f32", "bf16", "q8_0", "q4_0", "q4_1")
#: (llama.cpp precision, attnkit variant of ``attnkit.bench.quantization.quantized_variants``)
PAIRS = (
    ("f32", "fp32 compile"),
    ("bf16", "bf16 compile"),
    ("q8_0", "int8 compile"),
    ("q8_0", "int8"),
    ("q4_0", "int4 compile"),
    ("q4_1", "int4 compile"),
)
GOALS = {"f32": 1.15, "bf16": 1.0}


def write_gguf(lm: TransformerLM, path: Path, precision: str) -> Path:
    """``lm`` (a tied or untied Llama-shaped model) as a GGUF file of 2-D weights in
    ``precision`` (``f32``, ``bf16``, ``q8_0``, ``q4_0`` or ``q4_1``), with a placeholder
    SentencePiece vocabulary (speed does not depend on the tokens). Needs the ``gguf`` package."""
    import numpy as np

    gguf = import_quietly("gguf")

    from attnkit.interop.gguf import llama_cpp_name
    from attnkit.interop.hf_weights import hf_state_dict
    from attnkit.positional import permute_rotary_weight

    c = lm.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(int(c.ffn_dim or 4 * c.dim))
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.eps)
    w.add_rope_freq_base(c.rope_base)
    vocab = int(c.vocab_size or 0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_types(([2, 3, 3] + [6] * 256 + [1] * vocab)[:vocab])
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    heads = {"self_attn.q_proj": c.num_heads, "self_attn.k_proj": c.num_kv_heads}
    kind = {"f32": None, "bf16": gguf.GGMLQuantizationType.BF16}
    for name, t in hf_state_dict(lm, "LlamaForCausalLM"):
        t = t.float()
        part = name.split(".", 3)[-1].rsplit(".", 1)[0]  # e.g. self_attn.q_proj
        if name.startswith("model.layers.") and part in heads:  # llama.cpp's rotary order
            t = permute_rotary_weight(t, heads[part], to="interleaved")
        target = llama_cpp_name(name)
        if target == name:
            raise ValueError(f"no llama.cpp name for {name!r}")
        if t.dim() == 1 or precision == "f32":
            w.add_tensor(target, t.numpy().astype(np.float32))
        elif precision == "bf16":
            w.add_tensor(target, t.bfloat16().view(torch.uint8).numpy(), raw_dtype=kind["bf16"])
        else:
            q = getattr(gguf.GGMLQuantizationType, precision.upper())
            w.add_tensor(target, gguf.quants.quantize(t.numpy(), q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_runner(path: Path, prompt: list[int], threads: int) -> Callable[[int], Any]:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=len(prompt) + 256, n_threads=threads, verbose=False)

    def run(n: int) -> None:
        llm.reset()
        llm.eval(prompt)
        for _ in range(n - 1):  # (speed only: the next token is a fixed one)
            llm.eval([prompt[-1]])

    return run


_PROBE = """
import sys
from llama_cpp import Llama
path, threads, *prompt = sys.argv[1:]
llm = Llama(path, n_ctx=len(prompt) + 8, n_threads=int(threads), verbose=False)
llm.eval([int(t) for t in prompt])
llm.eval([int(prompt[-1])])
"""


def _crash(path: Path, prompt: list[int], threads: int) -> str | None:
    """Why llama.cpp cannot run ``path`` here, tried in a child process first (some of its CPU
    paths crash the process on some CPUs), or ``None`` where it runs."""
    args = [sys.executable, "-c", _PROBE, str(path), str(threads), *map(str, prompt)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"crashed (signal {-done.returncode}) loading or running it"
    return f"failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}"


def _generate(lm: Any, prompt: torch.Tensor, n: int, *, compile: bool) -> Any:
    return lm.generate(prompt, n, eos_token_id=[], compile=compile)


def _step_rate(run: Callable[[int], Any], new: int) -> float:
    start = time.perf_counter()
    run(new)
    mid = time.perf_counter()
    run(1)
    end = time.perf_counter()
    return (new - 1) / max((mid - start) - (end - mid), 1e-9)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("attnkit.bench.llamacpp", __doc__)
    parser.add_argument("--model", type=Path, help="Hugging Face Llama folder (default: random)")
    parser.add_argument("--shape", default="llama-135m", choices=sorted(QUANT_MODELS))
    parser.add_argument("--gguf", action="append", default=[], help="PRECISION=FILE")
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="threads of both (0: torch's default)"
    )
    parser.add_argument("--out", type=Path, help="default benchmarks/results/llamacpp.json")
    args = parser.parse_args(argv)
    try:
        llama_cpp = import_quietly("llama_cpp")
    except ImportError:
        print(
            "llama-cpp-python is not installed: nothing to compare against "
            "(pip install llama-cpp-python builds llama.cpp from source)",
            file=sys.stderr,
        )
        return {"skipped": "llama-cpp-python not installed"}
    given = dict(item.split("=", 1) for item in args.gguf)
    bad = sorted(set(given) - set(PRECISIONS))
    if bad:
        raise ValueError(f"unknown precisions {bad}; known: {sorted(PRECISIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is not None:
        lm = TransformerLM.from_pretrained(args.model)
    else:
        torch.manual_seed(0)
        lm = TransformerLM(QUANT_MODELS[args.shape][0]).eval()
    prompt = torch.randint(3, int(lm.config.vocab_size or 4), (1, args.prompt))
    variants = quantized_variants(lm, compile=True)
    threads = torch.get_num_threads()
    runners: dict[str, Callable[[int], Any]] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in PRECISIONS:
            path = Path(given[precision]) if precision in given else None
            if path is None:
                path = write_gguf(lm, Path(tmp) / f"model-{precision}.gguf", precision)
            why = _crash(path, prompt[0].tolist(), threads)
            if why is not None:
                print(f"llama.cpp {precision} {why}: left out", file=sys.stderr)
                failures[precision] = why
                continue
            runners[f"llama.cpp {precision}"] = _llama_runner(path, prompt[0].tolist(), threads)
        for name in dict.fromkeys(ours for _, ours in PAIRS):
            runners[f"attnkit {name}"] = functools.partial(
                _generate, variants[name], prompt, compile=name.endswith("compile")
            )
        for name, runner in runners.items():
            print(f"warm-up {name}", file=sys.stderr)
            runner(args.new)
        rates: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                rates[name].append(_step_rate(runner, args.new))
    median = {k: statistics.median(v) for k, v in rates.items()}
    rows = []
    print(
        f"\n{'llama.cpp':<10} {'tok/s':>8}  {'attnkit':<18} {'tok/s':>8} {'ratio':>7} {'goal':>6}"
    )
    for precision, ours in PAIRS:
        theirs = median.get(f"llama.cpp {precision}")
        mine = median[f"attnkit {ours}"]
        ratio = None if theirs is None else mine / theirs
        goal = GOALS.get(precision)
        rows.append(
            {
                "precision": precision,
                "llama_cpp": theirs,
                "attnkit_variant": ours,
                "attnkit": mine,
                "ratio": ratio,
                "goal": goal,
            }
        )
        shown = (
            ("crashed" if "crash" in failures.get(precision, "") else "failed")
            if theirs is None
            else f"{theirs:8.1f}"
        )
        print(
            f"{precision:<10} {shown:>8}  {ours:<18} {mine:>8.1f} "
            f"{'-' if ratio is None else f'{ratio:7.2f}':>7} {goal or '-':>6}"
        )
    result = {
        "rows": rows,
        "llama_cpp_failures": failures,
        "rates": median,
        "threads": threads,
        "load_average_1min_after": os.getloadavg()[0],
        "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
    }
    return write_report(result, args.out, "llamacpp.json")


if __name__ == "__main__":
    main()
