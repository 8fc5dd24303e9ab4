"""Speculative decoding against plain decoding: ``python -m attnkit.bench.speculative``.

Writes ``benchmarks/results/speculative.json`` (``--out``). The model is the 135M Llama shape
(:data:`attnkit.bench.decoding.DECODE_MODELS`, fp32, random weights, prepared for decoding);
every run of a round is timed side by side in this process, rounds interleaved, medians.

What the rows measure, and what they do not:

* ``prompt lookup``: greedy decoding after a prompt of random tokens, with
  ``prompt_lookup_num_tokens=10`` against plain greedy decoding (same tokens, checked) and
  against ``transformers``' own prompt lookup on the same weights (``LlamaForCausalLM`` from
  :func:`attnkit.interop.hf.to_transformers`). A model with random weights does not copy a
  paragraph, but its greedy output falls into a loop that repeats itself, and that is the case
  prompt lookup serves (a summary or an edit repeating its input). So the row measures the
  mechanism where most proposals are kept, not the acceptance of real text.
* ``int8 / int4 self-draft``: ``assistant_model="int8"`` / ``"int4"`` (the model's own
  weight-quantized copy drafts) against plain greedy decoding on the same prompt, same tokens
  checked, with the share of drafted tokens kept. With random weights the quantized copy's
  choices differ from the model's more often than a trained model's would.
* ``prefill``: the prompt and the first token alone (``max_new_tokens=1``; transformers' too),
  timed in the same rounds: each row also gives its speedup after the first token (its time
  less its prefill's, the rate a chat shows once the answer starts), since the prompt's forward
  is the same with or without proposals.
* ``prompt lookup, drafts fail``: sampling (temperature 1) after a prompt of random tokens: the
  output is as random as the prompt, so almost every proposal is rejected; prompt lookup against
  plain sampling (goal: no slower than 0.95x). The tokens differ (other random draws).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from attnkit.bench.decoding.models import model_parser, model_report, random_lm, random_prompt
from attnkit.bench.results import parse_with_threads, write_report
from attnkit.models import TransformerLM
from attnkit.speculative import SpeculationStats

__all__ = ["main", "measure", "vs_rows"]

#: Tokens prompt lookup proposes (as transformers' documented example).
LOOKUP_TOKENS = 10
#: Goals of the issue: prompt lookup vs plain and vs transformers' lookup, self-draft vs plain,
#: failing proposals vs plain.
GOALS = {"lookup": 2.5, "transformers": 1.5, "draft": 1.5, "fail": 0.95}


def _runs(
    lm: TransformerLM, prompt: Tensor, new: int, *, peer: bool, drafts: Sequence[str]
) -> dict[str, Callable[[], tuple[Tensor, SpeculationStats | None]]]:
    """Name -> one timed generation (its tokens and speculation counts)."""

    def ours(
        sample: bool = False, tokens: int = new, **options: Any
    ) -> Callable[[], tuple[Tensor, SpeculationStats | None]]:
        def run() -> tuple[Tensor, SpeculationStats | None]:
            stats = SpeculationStats() if options else None
            extra: dict[str, Any] = {} if stats is None else {"speculation_stats": stats}
            if sample:
                extra |= {"temperature": 1.0, "generator": torch.Generator().manual_seed(1)}
            out = lm.generate(prompt, tokens, eos_token_id=[], **extra, **options)
            return out, stats

        return run

    runs = {
        "prefill": ours(tokens=1),  # (the prompt and the first token: no round of any kind)
        "plain": ours(),
        "lookup": ours(prompt_lookup_num_tokens=LOOKUP_TOKENS),
        **{draft: ours(assistant_model=draft) for draft in drafts},
        "plain sampled": ours(sample=True),
        "lookup sampled": ours(sample=True, prompt_lookup_num_tokens=LOOKUP_TOKENS),
    }
    if peer:
        from attnkit.bench.peers import to_transformers

        hf = to_transformers(lm).eval()

        def theirs(tokens: int) -> Callable[[], tuple[Tensor, SpeculationStats | None]]:
            def run() -> tuple[Tensor, SpeculationStats | None]:
                with torch.no_grad():
                    out = hf.generate(
                        prompt,
                        max_new_tokens=tokens,
                        min_new_tokens=tokens,
                        do_sample=False,
                        prompt_lookup_num_tokens=LOOKUP_TOKENS,
                        pad_token_id=0,
                        eos_token_id=None,
                    )
                return out, None

            return run

        runs["transformers prefill"] = theirs(1)
        runs["transformers lookup"] = theirs(new)
    return runs


def measure(
    name: str = "llama-135m",
    *,
    prompt_len: int = 150,
    new: int = 48,
    repeats: int = 3,
    peer: bool = True,
    drafts: Sequence[str] = ("int8", "int4"),
    progress: bool = True,
) -> dict[str, Any]:
    """Time every run ``repeats`` times, interleaved, after a warm-up round that also builds the
    self-drafts; return the rows of the report."""
    lm = random_lm(name)
    prompt_len = min(prompt_len, lm.max_seq_len - new)
    prompt = random_prompt(lm, prompt_len)
    runs = _runs(lm, prompt, new, peer=peer, drafts=drafts)
    times: dict[str, list[float]] = {k: [] for k in runs}
    outputs: dict[str, Tensor] = {}
    stats: dict[str, SpeculationStats | None] = {}
    for round_ in range(repeats + 1):
        for key, run in runs.items():
            if progress:
                print(f"round {round_}/{repeats}: {key}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            out, st = run()
            seconds = time.perf_counter() - start
            if round_:
                times[key].append(seconds)
            outputs[key], stats[key] = out, st
    median = {k: statistics.median(v) for k, v in times.items()}

    def decoding(key: str) -> float:
        """Seconds of the tokens after the first: the run's less its prompt's and first token's."""
        first = "transformers prefill" if key.startswith("transformers") else "prefill"
        return max(median[key] - median[first], 1e-9)

    def row(job: str, key: str, base: str, goal: float, **extra: Any) -> dict[str, Any]:
        st = stats[key]
        return {
            "job": job,
            "run": key,
            "baseline": base,
            "seconds": median[key],
            "baseline_seconds": median[base],
            "tokens_per_s": new / median[key],
            "baseline_tokens_per_s": new / median[base],
            "speedup": median[base] / median[key],
            "decode_tokens_per_s": (new - 1) / decoding(key),
            "decode_speedup": decoding(base) / decoding(key),
            "goal": goal,
            "acceptance": None if st is None else st.acceptance_rate,
            **extra,
        }

    same = {k: bool(torch.equal(outputs[k], outputs["plain"])) for k in ("lookup", *drafts)}
    rows = [row("prompt lookup", "lookup", "plain", GOALS["lookup"], identical=same["lookup"])]
    if peer:
        peer_same = bool(torch.equal(outputs["transformers lookup"], outputs["plain"]))
        rows.append(
            row(
                "prompt lookup vs transformers' prompt lookup",
                "lookup",
                "transformers lookup",
                GOALS["transformers"],
                identical=peer_same,
            )
        )
    for draft in drafts:
        rows.append(
            row(f"{draft} self-draft", draft, "plain", GOALS["draft"], identical=same[draft])
        )
    rows.append(row("prompt lookup, drafts fail", "lookup sampled", "plain sampled", GOALS["fail"]))
    return model_report(
        "speculative",
        name,
        prompt=prompt_len,
        new=new,
        repeats=repeats,
        rows=rows,
        lookup_tokens=LOOKUP_TOKENS,
    )


def vs_rows(name: str, *, repeats: int, new: int = 24) -> list[dict[str, Any]]:
    """The ``attnkit bench --vs`` row: prompt lookup against plain greedy decoding (fields of
    :class:`attnkit.bench.vs.VsRow`)."""
    report = measure(name, new=new, repeats=repeats, peer=False, drafts=(), progress=False)
    r = report["rows"][0]
    note = (
        f"{name}, prompt {report['prompt']} random tokens, {new} new tokens, "
        f"{r['acceptance']:.0%} of proposals kept, "
        + ("same tokens" if r["identical"] else "TOKENS DIFFER")
    )
    return [
        {
            "job": "speculative prompt lookup",
            "peer": "attnkit plain greedy",
            "attnkit_s": r["seconds"],
            "peer_s": r["baseline_seconds"],
            "note": note,
            "goal": r["goal"],
        }
    ]


def _line(r: dict[str, Any]) -> str:
    """A row as the command prints it."""
    acc = "" if r["acceptance"] is None else f", {r['acceptance']:.0%} kept"
    return (
        f"{r['job']}: {r['tokens_per_s']:.2f} vs {r['baseline_tokens_per_s']:.2f} tok/s "
        f"({r['baseline']}) = {r['speedup']:.2f}x (goal {r['goal']}x), after the first token "
        f"{r['decode_speedup']:.2f}x{acc}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its report."""
    parser = model_parser("attnkit.bench.speculative", __doc__, new=48)
    parser.add_argument("--no-peer", action="store_true", help="leave out transformers")
    args = parse_with_threads(parser, argv)
    report = measure(args.model, new=args.new, repeats=args.repeats, peer=not args.no_peer)
    write_report(report, args.out, "speculative.json", _line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
