"""The path from a public call to a kernel goes down once: no module of attnkit is entered
again below itself (API -> checks -> policy -> kernel, never a callback up)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

from attnkit import TransformerConfig, TransformerLM, decoding
from attnkit.functional import scaled_dot_product_attention as sdpa
from tests.helpers import VOCAB


def _reentered(fn: Callable[[], object]) -> set[str]:
    """Call stacks (innermost module first) in which an attnkit module appears twice with another
    module between, at any function call made while ``fn`` runs."""
    found: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        stack: list[str] = []
        at: FrameType | None = frame
        while at is not None:
            name = at.f_globals.get("__name__", "")
            if name.startswith("attnkit.") and (not stack or stack[-1] != name):
                stack.append(name)
            at = at.f_back
        if len(stack) != len(set(stack)):
            found.add(" <- ".join(stack))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return found


def _the_path_is_fresh(a_call: Callable[[], object]) -> set[str]:
    a_call()  # builds the kernels and decides measured choices first: the steady path counts
    return _reentered(a_call)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"causal": True, "window": 32},
        {"causal": True, "softcap": 20.0},
        {"causal": True, "segment_ids": torch.tensor([[0] * 100 + [1] * 156])},
        {"causal": True, "return_weights": True},
        {"mask": torch.ones(256, 256, dtype=torch.bool).tril()},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_goes_down_once(kw: dict[str, Any], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 16, generator=g, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        assert not _the_path_is_fresh(lambda: sdpa(q, k, v, **kw))


def test_one_query_attention_goes_down_once() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = (torch.randn(1, 4, 300, 16, generator=g) for _ in range(2))
    with torch.no_grad():
        assert not _the_path_is_fresh(lambda: sdpa(q, k, v))


@pytest.mark.parametrize("options", [{}, {"num_kv_heads": 2}, {"window": 8}])
@pytest.mark.parametrize("prepared", [False, True])
def test_a_decoding_step_goes_down_once(options: dict[str, Any], prepared: bool) -> None:
    torch.manual_seed(0)
    lm = TransformerLM(TransformerConfig(VOCAB, 32, 2, 4, max_seq_len=64, **options)).eval()
    if prepared:
        decoding.prepare(lm)
    prompt = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        caches = lm.make_kv_caches(1, 64)
        lm(prompt, kv_caches=caches)

        def step() -> None:
            lm(prompt[:, -1:], kv_caches=caches)

        assert not _the_path_is_fresh(step)
        # the prefill of a longer chunk too
        assert not _reentered(lambda: lm(prompt, kv_caches=lm.make_kv_caches(1, 64)))


def test_the_probe_finds_a_reentry() -> None:
    # The check itself can fail: functions of a module "a" that call into "b", which calls back
    # into "a", are seen; a call that stays down is not.
    space_a: dict[str, Any] = {"__name__": "attnkit.a"}
    space_b: dict[str, Any] = {"__name__": "attnkit.b"}
    exec("def top(): return middle()\ndef bottom(): return 1", space_a)
    exec("def middle(): return bottom()\ndef leaf(): return 2", space_b)
    space_a["middle"] = space_b["middle"]
    space_b["bottom"] = space_a["bottom"]
    assert _reentered(space_a["top"]) == {"attnkit.a <- attnkit.b <- attnkit.a"}
    space_a["middle"] = space_b["leaf"]
    assert not _reentered(space_a["top"])
