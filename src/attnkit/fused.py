"""A cached decoding step of a whole decoder stack in one kernel call.

A decoding step of a small model spends most of its time between the kernels: each layer is a
dozen Python calls (norms, four products, the rotation, the cache's copies, the attention, the
activation, the residual adds), each a few microseconds of dispatch around a few microseconds of
work. :func:`run` hands the stack's layers to one C function instead
(``attnkit_decoder_step``, ``kernels/csrc/step.c``), which runs the same kernels back to back:
the products each layer's linears run (attnkit's float32, int8, int4 and GGUF block kernels),
the RMSNorm and rotary kernels, and the one-query attention over the cache, one query row per
new token.

It serves the stacks it can describe, and everything else runs the model's own forward
unchanged: a :class:`~attnkit.models.TransformerLM` of pre-norm
:class:`~attnkit.blocks.TransformerLayer` blocks with RMSNorms (plain ones, or Gemma's scaling by
1 + weight, also of the attention's and feed-forward's outputs), one fused q/k/v projection,
RMSNorms of the query and key heads or none, rotary positions (Gemma 3's local tables on its
sliding layers), grouped-query attention (a sliding window and a soft cap of its scores allowed,
no other variant), and a gated feed-forward (SwiGLU, or GeGLU with the tanh GELU): the Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 and SmolLM families. Float32 or bf16
activations (bf16: each op's result rounded where the model's forward rounds it) with weights of
their dtype or int8, int4 or block-quantized ones; the new tokens of one sequence, or one token
of each sequence of a batch (left padding left out by a bool key mask), appended to an attnkit
:class:`~attnkit.KVCache` per layer (no ``cache_position``), or one token of each sequence of a
serving engine's paged pool; no gradients, no forward hooks on the layers or
their modules, not under ``torch.compile`` or a dispatch mode (FLOP counters: torch's ops); and
only products attnkit's kernels take at this many rows: row-major float linears (plain, or
prepared by :func:`attnkit.decoding.prepare` with the ``"stream"`` layout: where the policy
measured MKL faster for one float32 row, a model prepared for one sequence keeps a column-major
layout and runs its blocks), and the quantized ones up to the rows the policy gives their
kernels.

The plan (each layer's weight pointers) is made once per model and checked on every call:
a parameter that moved or a module that was replaced or hooked makes a new plan (or none). A
step whose attention meets a non-finite score runs again through the model's forward, whose
rules for it are the general path's.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from attnkit import functional
from attnkit.attention import MultiHeadAttention
from attnkit.blocks import FeedForward, OffsetRMSNorm, TransformerLayer
from attnkit.cache import AttendingCache, KVCache
from attnkit.decoding import PreparedLinear, PreparedRMSNorm
from attnkit.kernels import binding, build, policy
from attnkit.kernels.linear import GROUP
from attnkit.positional import RotaryEmbedding
from attnkit.quantized.block import BlockLinear
from attnkit.quantized.int4 import Int4Linear
from attnkit.quantized.int8 import Int8Linear

__all__ = ["MOST_ROWS", "FusedStep", "plan", "plan_of", "run"]

# Weight kinds of csrc/step.c's step_linear.
_FLOAT, _INT8, _INT4, _BLOCK, _BLOCK_ROUNDED = range(5)
# Results of attnkit_decoder_step.
_NO_MEMORY, _REDO = 1, 2
#: The gated activations csrc/step.c computes (its GATE_* codes).
_GATES = {"swiglu": 0, "geglu_tanh": 1}
#: The most new tokens a fused step takes (a decoding step, a speculative round's check, a
#: serving engine's batch), where every product's kernel takes that many rows.
MOST_ROWS = policy.PROMPT_ROWS


class FusedStep:
    """One model's layers as ``attnkit_decoder_step`` reads them, with what keeps them valid.

    ``watch`` lists ``(parameters or buffers dict, name, data pointer)`` of every tensor the
    plan points at, ``tree`` the ``(parent's modules dict, name, child or None)`` links it was
    made from, ``hook_modules`` the modules whose forward hooks would be skipped, ``settings``
    each block's attributes the plan copied (window, soft cap, scale, epsilons, ...), and
    ``linears`` the products (whose kernels decide how many rows a step may bring). On every
    call :meth:`current` checks the tensors, links and settings, :meth:`hooked` the hooks.
    """

    def __init__(
        self,
        layers: Any,
        shape: binding.StepShape,
        rotary: tuple[RotaryEmbedding, RotaryEmbedding],
        linears: list[nn.Module],
        watch: list[tuple[dict[str, Any], str, int]],
        tree: list[tuple[dict[str, Any], str, nn.Module | None]],
        hooked: list[nn.Module],
        settings: list[tuple[tuple[Any, ...], tuple[Any, ...]]],
    ) -> None:
        self.layers, self.shape = layers, shape
        self.rotary = rotary  # (the global tables' module, the local ones')
        self.dtype = torch.bfloat16 if shape.bf16 else torch.float32
        self.count = len(layers)
        self.linears, self.watch, self.tree, self.hook_modules = linears, watch, tree, hooked
        self.settings = settings
        self.rows_ok: dict[int, bool] = {}
        # (flat lists, compared whole in :meth:`current`: a step checks them all)
        self._children = [child for _, _, child in tree]
        self._pointers = [pointer for _, _, pointer in watch]
        self._hooks = [d for m in hooked for d in (m._forward_hooks, m._forward_pre_hooks)]

    def current(self) -> bool:
        """Whether the model still holds the modules, tensors and settings the plan copied
        (hooks aside: :meth:`hooked`)."""
        # (modules compare by identity; a tensor replaced by None fails on data_ptr)
        if [parent.get(name) for parent, name, _ in self.tree] != self._children:
            return False
        try:
            pointers = [tensors[name].data_ptr() for tensors, name, _ in self.watch]
        except (KeyError, AttributeError):
            return False
        if pointers != self._pointers:
            return False
        return all(_settings(*modules) == saved for modules, saved in self.settings)

    def hooked(self) -> bool:
        """Whether a forward hook would be skipped: one on the layers' modules, or a global one."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(self._hooks)  # (each module's hook dicts, filled in place)

    def takes(self, rows: int) -> bool:
        """Whether every product of the plan runs attnkit's kernel at ``rows`` rows."""
        ok = self.rows_ok.get(rows)
        if ok is None:
            ok = rows <= MOST_ROWS and all(_kernel_rows(m, rows, self.dtype) for m in self.linears)
            self.rows_ok[rows] = ok
        return ok


def _kernel_rows(module: nn.Module, rows: int, dtype: torch.dtype) -> bool:
    if isinstance(module, Int8Linear):
        return policy.int8_kernel_rows(rows, compiling=False)
    if isinstance(module, BlockLinear):
        return policy.block_kernel_rows(rows)
    if isinstance(module, Int4Linear):
        return True
    # (float weights: the stream kernel takes a step's rows whichever product the policy
    # measured faster for a lone one, since here no Python runs between the layers)
    return rows <= getattr(module, "stream_rows", policy.most_stream_rows(dtype))


def _tensor(owner: nn.Module, name: str, watch: list[tuple[dict[str, Any], str, int]]) -> Tensor:
    """``owner``'s parameter or buffer ``name``, its pointer watched."""
    tensors = owner._parameters if name in owner._parameters else owner._buffers
    t = tensors[name]
    if t is None:
        raise _UnsupportedError
    watch.append((tensors, name, t.data_ptr()))
    return t


class _UnsupportedError(Exception):
    """A module the fused step does not describe."""


def _plain(t: Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.is_cpu and t.is_contiguous()


def _linear(
    m: nn.Module, watch: list[tuple[dict[str, Any], str, int]], dtype: torch.dtype
) -> binding.StepLinear:
    """``m`` as a ``step_linear`` of a stack whose activations are ``dtype`` (raises
    :class:`_UnsupportedError` for any other module); float weights and biases of ``dtype``."""
    b = None
    if m._parameters.get("bias") is not None:
        bias = _tensor(m, "bias", watch)
        if not _plain(bias, dtype):
            raise _UnsupportedError
        b = bias.data_ptr()
    n, out = getattr(m, "in_features", 0), getattr(m, "out_features", 0)
    if type(m) in (nn.Linear, PreparedLinear):
        w = _tensor(m, "weight", watch)
        if not _plain(w, dtype) or getattr(m, "layout", "stream") != "stream":
            raise _UnsupportedError
        return binding.StepLinear(_FLOAT, n, out, 0, 0, 0, w.data_ptr(), None, None, b)
    if type(m) is Int8Linear and m.kernel == "attnkit":
        codes, scale = _tensor(m, "weight_int8", watch), _tensor(m, "scale", watch)
        if scale.dtype != torch.float32 or not codes.is_contiguous() or codes.shape != (out, n):
            raise _UnsupportedError
        return binding.StepLinear(
            _INT8, n, out, 0, 0, 0, codes.data_ptr(), scale.data_ptr(), None, b
        )
    if type(m) is Int4Linear and m.kernel == "int4":
        codes, scales = _tensor(m, "codes", watch), _tensor(m, "scales", watch)
        if scales.dtype != torch.bfloat16 or not (codes.is_contiguous() and scales.is_contiguous()):
            raise _UnsupportedError
        group = n // (scales.shape[1] // (2 * GROUP))
        return binding.StepLinear(
            _INT4, n, out, group, 4, 0, codes.data_ptr(), scales.data_ptr(), None, b
        )
    if type(m) is BlockLinear and m.kernel == "block" and m.scales.dtype == torch.float16:
        for name in ("codes", "scales", "offsets"):
            if m._parameters.get(name) is not None or m._buffers.get(name) is not None:
                _tensor(m, name, watch)
        weight = m._prepared()
        if not weight.holds(m.codes, m.scales, m.offsets) or not m.codes.is_cpu:
            raise _UnsupportedError
        kind = _BLOCK_ROUNDED if m.activations == "int8" else _BLOCK
        size, codes_at, scales_at, offsets_at, rows, bits, group = weight.args
        return binding.StepLinear(
            kind, size, rows, group, bits, weight.tile, codes_at, scales_at, offsets_at, b
        )
    raise _UnsupportedError


def _norm(
    m: nn.Module,
    dim: int,
    watch: list[tuple[dict[str, Any], str, int]],
    dtype: torch.dtype,
    plus_one: bool,
) -> tuple[int, float]:
    """A plain RMSNorm's weight pointer and epsilon, or Gemma's (``plus_one``)."""
    # (exactly these types: a subclass may compute otherwise)
    if type(m) not in ((OffsetRMSNorm,) if plus_one else (nn.RMSNorm, PreparedRMSNorm)):
        raise _UnsupportedError
    assert isinstance(m, nn.RMSNorm)
    if tuple(m.normalized_shape) != (dim,):
        raise _UnsupportedError
    w = _tensor(m, "weight", watch)
    if not _plain(w, dtype):
        raise _UnsupportedError
    return w.data_ptr(), torch.finfo(torch.float32).eps if m.eps is None else float(m.eps)


def plan(lm: nn.Module) -> FusedStep | None:
    """The fused step of ``lm``, or None where the module docstring's conditions do not hold."""
    try:
        return _plan(lm)
    except _UnsupportedError:
        return None


def _plan(lm: nn.Module) -> FusedStep:
    blocks = getattr(lm, "blocks", None)
    rotary = getattr(lm, "rotary", None)
    local = getattr(lm, "rotary_local", None) or rotary  # (Gemma 3's sliding layers')
    if (
        not isinstance(blocks, nn.ModuleList)
        or not len(blocks)
        or not isinstance(rotary, RotaryEmbedding)
        or not isinstance(local, RotaryEmbedding)
        or local.interleaved != rotary.interleaved
        or getattr(lm, "position", None) is not None
        or not build.kernels_available()
    ):
        raise _UnsupportedError
    dim = int(lm.dim)  # type: ignore[arg-type]
    # (the activations' dtype: the norms' weights')
    dtype = getattr(getattr(blocks[0], "norm1", None), "weight", None)
    dtype = dtype.dtype if isinstance(dtype, Tensor) else None
    if dtype not in (torch.float32, torch.bfloat16):
        raise _UnsupportedError
    watch: list[tuple[dict[str, Any], str, int]] = []
    tree: list[tuple[dict[str, Any], str, nn.Module | None]] = []
    settings: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
    hooked: list[nn.Module] = [rotary, local]  # (hooks on the model itself run either way)
    # Gemma's kind: every RMSNorm scales by 1 + weight; else plain ones
    plus_one = type(getattr(blocks[0], "norm1", None)) is OffsetRMSNorm
    products: list[nn.Module] = []
    layers = (binding.StepLayer * len(blocks))()
    shape: binding.StepShape | None = None
    for i, block in enumerate(blocks):
        tree.append((blocks._modules, str(i), block))
        attention = block._modules.get("attention")
        ff = block._modules.get("feed_forward")
        if (
            type(block) is not TransformerLayer
            or not block.norm_first
            or type(attention) is not MultiHeadAttention
            or type(ff) is not FeedForward
        ):
            raise _UnsupportedError
        if (
            not attention.fused_qkv
            or attention.rotary not in (rotary, local)
            or attention.variant is not None
            or attention.kernel is not functional.attend
            or attention.embed_dim != dim
            or attention.out_dim != dim
            or not attention.causal
            or ff.activation_name not in _GATES
        ):
            raise _UnsupportedError
        H, K, E = attention.num_heads, attention.num_kv_heads, attention.head_dim
        hidden = ff.linear2.in_features
        scale = functional.resolve_scale(attention.scale, E)
        bf16 = dtype == torch.bfloat16
        gate = _GATES[ff.activation_name]
        this = binding.StepShape(
            dim, H, K, E, hidden, scale, rotary.interleaved, bf16, plus_one, gate
        )
        if shape is None:
            shape = this
        elif bytes(shape) != bytes(this):
            raise _UnsupportedError
        modules = {
            "norm1": block.norm1,
            "norm2": block.norm2,
            "qkv": attention.qkv_proj,
            "out": attention.out_proj,
            "gate_up": ff.gate_up,
            "down": ff.linear2,
        }
        for parent, name in (
            (block, "attention"),
            (block, "feed_forward"),
            (block, "norm1"),
            (block, "norm2"),
            (attention, "qkv_proj"),
            (attention, "out_proj"),
            (ff, "gate_up"),
            (ff, "linear2"),
        ):
            child = parent._modules[name]
            assert child is not None
            tree.append((parent._modules, name, child))
        hooked += [block, attention, ff, ff.activation, *modules.values()]
        norm1, eps1 = _norm(block.norm1, dim, watch, dtype, plus_one)
        norm2, eps2 = _norm(block.norm2, dim, watch, dtype, plus_one)
        linears = [
            _linear(modules[name], watch, dtype) for name in ("qkv", "out", "gate_up", "down")
        ]
        sizes = [(p.n, p.out) for p in linears]
        if sizes != [(dim, (H + 2 * K) * E), (H * E, dim), (dim, 2 * hidden), (hidden, dim)]:
            raise _UnsupportedError
        products += [modules[name] for name in ("qkv", "out", "gate_up", "down")]
        window = 0 if attention.window is None else int(attention.window)
        cap = 0.0 if attention.softcap is None else float(attention.softcap)
        q_norm, q_eps, k_norm, k_eps = None, 0.0, None, 0.0
        for name in ("q_norm", "k_norm"):  # (a norm set later is noticed too)
            tree.append((attention._modules, name, attention._modules.get(name)))
        if attention.q_norm is not None or attention.k_norm is not None:
            if attention.q_norm is None or attention.k_norm is None:
                raise _UnsupportedError
            q_norm, q_eps = _norm(attention.q_norm, E, watch, dtype, plus_one)
            k_norm, k_eps = _norm(attention.k_norm, E, watch, dtype, plus_one)
            hooked += [attention.q_norm, attention.k_norm]
        posts: list[tuple[int | None, float]] = []
        for name in ("post_attn_norm", "post_ffn_norm"):
            module = block._modules.get(name)
            posts.append(
                (None, 0.0) if module is None else _norm(module, dim, watch, dtype, plus_one)
            )
            tree.append((block._modules, name, module))
            if module is not None:
                hooked.append(module)
        (post1, post_eps1), (post2, post_eps2) = posts
        layers[i] = binding.StepLayer(
            norm1, norm2, eps1, eps2, window, cap, q_eps, q_norm, k_norm, k_eps,
            post_eps1, post1, post2, post_eps2, attention.rotary is not rotary, *linears,
        )  # fmt: skip
        held = (
            block,
            attention,
            ff,
            (block.norm1, block.norm2, attention.q_norm, attention.k_norm),
        )
        settings.append((held, _settings(*held)))
    assert shape is not None
    return FusedStep(layers, shape, (rotary, local), products, watch, tree, hooked, settings)


def _settings(block: Any, attention: Any, ff: Any, norms: tuple[Any, ...]) -> tuple[Any, ...]:
    """The plain attributes of a block and its modules that a plan copies (read from the
    modules themselves: the plan's module links are checked apart)."""
    return (
        block.norm_first,
        attention.window,
        attention.softcap,
        attention.scale,
        attention.kernel,
        attention.variant,
        attention.causal,
        attention.fused_qkv,
        ff.activation_name,
        *(None if n is None else n.eps for n in norms),
    )


#: Each model's plan, or the key of a model found without one (kept beside the model, not in
#: it: copies and pickles of a model carry no pointers).
_PLANS: weakref.WeakKeyDictionary[nn.Module, FusedStep | tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)


def plan_of(lm: nn.Module) -> FusedStep | None:
    """``lm``'s current plan, made again where the one kept is stale."""
    kept = _PLANS.get(lm)
    if isinstance(kept, FusedStep) and kept.current():
        return None if kept.hooked() else kept  # (a hook declines the step, not the plan)
    # (a model without a plan is asked again only after its first block's modules change:
    # preparing or quantizing it swaps them)
    key = _shape_key(lm)
    if kept is not None and not isinstance(kept, FusedStep) and kept == key:
        return None
    made = plan(lm)
    _PLANS[lm] = made if made is not None else key
    return None if made is None or made.hooked() else made


def _shape_key(lm: nn.Module) -> tuple[int, ...]:
    blocks = getattr(lm, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        return (id(blocks),)
    first = blocks[0]
    return (id(blocks), id(first), *(id(m) for m in first.modules()))


def _dense(
    step: FusedStep,
    kv_caches: Sequence[KVCache | AttendingCache],
    B: int,
    L: int,
    mask: Tensor | None,
) -> binding.StepCache | None:
    """An attnkit :class:`~attnkit.KVCache` per layer, appended to: every layer filled alike,
    room for ``L`` more; ``B`` sequences (one token each where ``B > 1``); a bool key mask
    ``(B or 1, 1, 1, length + L)`` or None."""
    first = kv_caches[0]
    if type(first) is not KVCache:
        return None
    length, ck, shape = first.length, first.k, step.shape
    if (
        ck.dtype != step.dtype
        or ck.shape[0] != B
        or ck.shape[1] != shape.kv_heads
        or ck.shape[3] != shape.head_dim
        or ck.stride(3) != 1
        or ck.stride(2) != shape.head_dim
        or length + L > first.capacity
    ):
        return None
    padding, padding_row, padding_key = None, 0, 0
    if mask is not None:
        if mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, B):
            return None
        if mask.shape[3] != length + L or not mask.is_cpu:
            return None
        padding, padding_key = mask.data_ptr(), mask.stride(3)
        padding_row = mask.stride(0) if mask.shape[0] == B and B > 1 else 0
    storage = (ctypes.c_void_p * (2 * step.count))()
    for i, cache in enumerate(kv_caches):
        if type(cache) is not KVCache or cache.length != length:
            return None
        k, v = cache.k, cache.v
        if k.dtype != step.dtype or v.dtype != step.dtype:
            return None
        if k.shape != ck.shape or k.stride() != ck.stride() or v.stride() != ck.stride():
            return None
        storage[2 * i], storage[2 * i + 1] = k.data_ptr(), v.data_ptr()
    return binding.StepCache(
        storage, ck.stride(1), shape.head_dim, length, first.capacity, None, None, 0, None, None,
        int(B > 1), ck.stride(0), padding, padding_row, padding_key,
    )  # fmt: skip


def _paged(
    step: FusedStep, kv_caches: Sequence[KVCache | AttendingCache], L: int
) -> tuple[binding.StepCache, tuple[Tensor, ...]] | None:
    """A serving engine's paged pool (an attending cache with a ``fused_step`` method) whose
    batch brings one token of each of ``L`` sequences; with the layout's tensors (kept alive
    for the call)."""
    layers = []
    for cache in kv_caches:
        describe = getattr(cache, "fused_step", None)
        layer = describe() if callable(describe) else None
        if layer is None:
            return None
        layers.append(layer)
    k_pool, _, slots, keys, first, count = layers[0]  # (the batch's layout: every layer's)
    shape = step.shape
    pool = (k_pool.shape[0], shape.kv_heads, shape.head_dim)
    if (
        slots.shape != (L,)
        or keys.dim() != 2
        or keys.shape[0] != L
        or keys.dtype != torch.int32
        or not slots.dtype == first.dtype == count.dtype == torch.int64
        or not all(t.is_contiguous() and t.is_cpu for t in (slots, keys, first, count))
    ):
        return None
    storage = (ctypes.c_void_p * (2 * step.count))()
    for i, layer in enumerate(layers):
        for j, t in enumerate(layer[:2]):
            if t.shape != pool or t.dtype != step.dtype or not t.is_contiguous() or not t.is_cpu:
                return None
            storage[2 * i + j] = t.data_ptr()
    cache = binding.StepCache(
        storage,
        shape.head_dim,
        shape.kv_heads * shape.head_dim,
        0,
        pool[0],
        slots.data_ptr(),
        keys.data_ptr(),
        keys.shape[1],
        first.data_ptr(),
        count.data_ptr(),
    )
    return cache, (slots, keys, first, count)


def run(
    lm: nn.Module,
    h: Tensor,
    positions: Tensor | None,
    kv_caches: Sequence[KVCache | AttendingCache],
    mask: Tensor | None = None,
) -> Tensor | None:
    """The stack's output for the new tokens' embeddings ``h`` ``(B, L, D)`` (before the final
    norm), their keys and values stored in ``kv_caches``; or None, having changed nothing, where
    the fused step does not serve this call (then the model's forward runs).

    The tokens are one sequence's (``B = 1``) or one of each sequence (``L = 1``, a batch's
    step) appended to an attnkit :class:`~attnkit.KVCache` per layer, whose slots a bool key mask
    ``(B or 1, 1, 1, S)`` may leave out (left padding); or one token each of ``L`` sequences
    packed in one row of a serving engine's paged pool (explicit ``positions``, no mask). The
    caller has checked what its forward knows: no ``cache_position``, no weights asked for,
    evaluation mode.
    """
    if torch.is_grad_enabled() or h.dim() != 3 or not h.is_cpu:
        return None
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():  # (torch's ops only)
        return None
    B, L = h.shape[:2]
    rows = B * L
    if not 1 <= rows <= MOST_ROWS or (B > 1 and L > 1):
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4):
        return None
    step = plan_of(lm)
    if step is None or h.dtype != step.dtype or len(kv_caches) != step.count:
        return None
    if not step.takes(rows):
        return None
    dense = _dense(step, kv_caches, B, L, mask)
    paged = None
    if dense is None and B == 1 and mask is None and positions is not None:
        paged = _paged(step, kv_caches, L)
    cache = dense if dense is not None else None if paged is None else paged[0]
    if cache is None:
        return None
    if positions is None:
        positions = torch.arange(cache.length, cache.length + L)
    cos, sin = step.rotary[0].step_rows(positions)
    local = (cos, sin) if step.rotary[1] is step.rotary[0] else step.rotary[1].step_rows(positions)
    rotations = [cos, sin, *local]  # (held until the call returns)
    if cos.shape[0] != rows:  # (one position for every sequence of a batch)
        rotations = [t.expand(rows, -1).contiguous() for t in rotations]
    tables = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in rotations))
    x = h.reshape(rows, -1).clone()
    result = build.library().attnkit_decoder_step(
        step.layers,
        step.count,
        ctypes.byref(step.shape),
        x.data_ptr(),
        rows,
        tables,
        ctypes.byref(cache),
        torch.get_num_threads(),
    )
    if result == _REDO:
        return None
    if result == _NO_MEMORY:
        raise MemoryError(f"the fused decoding step could not allocate scratch for {rows} tokens")
    if dense is not None:
        for layer in kv_caches:
            layer.__dict__["length"] = cache.length + L  # (as KVCache.update sets it)
    return x.view(B, L, -1)
