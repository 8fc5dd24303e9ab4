"""FLOPs and memory of multi-head attention and a transformer block, per component, with formulas.

Pure functions that return frozen dataclasses; nothing here runs a model. Every number is
computed by evaluating the formula text that is reported next to it, so the text and the value
cannot disagree.

Symbols (the shape legend of the package, plus two):
    B batch, L query length, S key length, D model dim, H query heads, K key/value heads,
    E head dim, F feed-forward width, P allowed (query, key) pairs under the causal mask.

Conventions:
    * A multiply-add is 2 FLOPs, so ``x @ W`` with ``x`` of shape (M, N) and ``W`` of shape
      (N, P) costs ``2*M*N*P``. Bias adds are not counted (``torch.utils.flop_counter`` does not
      count them either); they are ``O(B*L*D)``.
    * Softmax is counted as 5 FLOPs per score (max, subtract, exp, sum, divide), the ReLU as 1
      per element and each add-and-LayerNorm as 8 per element (residual add, mean, centre,
      square, sum, scale by rstd, gamma, beta). These are conventions: no FLOP counter agrees on
      elementwise work. The 1/sqrt(E) scale is ``O(B*H*L*E)`` and not counted.
    * Causal attention: ``flops`` is what a dense kernel does (the masked half is computed and
      thrown away), ``useful_flops`` counts only the P allowed pairs. Queries are aligned to the
      end of the keys (query i sees keys ``0 .. i + S - L``), so ``P = L*(L+1)/2 + L*(S-L)``,
      which is ``L*(L+1)/2`` for self-attention: about half.
    * Grouped-query attention: the attention matmuls run over H query heads whatever K is (the
      K key/value heads are shared, not fewer matmuls); only the k/v projections shrink.

Memory, in elements (times the dtype size for bytes):
    * textbook path (``softmax(q @ k^T) @ v`` written out): the scores and the weights are each
      ``B*H*L*S``. The forward peak holds both while softmax runs (``2*B*H*L*S``); for backward
      only the weights are kept (softmax's gradient needs its output, ``q @ k^T``'s needs q and
      k, not the scores), so ``B*H*L*S`` per layer stays alive.
    * fused path (flash / memory-efficient kernels): no L x S matrix is stored; besides the
      output the kernel keeps one logsumexp per query and head, ``B*H*L``: linear in L.

The crossover: with ``L = S = n``, the projections cost ``a*n`` and the two attention matmuls
``b*n^2``, so the ``n^2`` terms overtake the ``n*d^2`` terms at ``n* = a / b``. For standard
self-attention (K = H, H*E = D): ``a = 4 * 2*D*H*E = 8*D^2`` and ``b = 2 * 2*H*E = 4*D``, hence
``n* = 2*D``. :func:`crossover_seq_len` computes ``a`` and ``b`` by evaluating the component
formulas, it does not use this closed form.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Component",
    "CostBreakdown",
    "CostOptions",
    "attention_cost",
    "crossover_seq_len",
    "dtype_size",
    "evaluate_formula",
    "transformer_cost",
]

SOFTMAX_FLOPS_PER_SCORE = 5
ADD_NORM_FLOPS_PER_ELEMENT = 8

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate_formula(formula: str, symbols: Mapping[str, int]) -> int:
    """Evaluate a formula such as ``"2*B*L*S*H*E"`` exactly, in integers.

    Only ``+ - * /``, parentheses, integer literals and the given symbols are allowed; ``/`` must
    divide exactly (as in ``L*(L+1)/2``).

    Args:
        formula: The expression.
        symbols: Values of the symbols it uses.

    Returns:
        The exact integer value.

    Raises:
        ValueError: If the formula uses anything else or a division is not exact.
    """

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.Name) and node.id in symbols:
            return Fraction(int(symbols[node.id]))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported element {ast.dump(node)} in formula {formula!r}")

    value = ev(ast.parse(formula, mode="eval"))
    if value.denominator != 1:
        raise ValueError(f"formula {formula!r} is not an integer ({value}) for {dict(symbols)}")
    return int(value)


def dtype_size(dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype or of a name such as ``"bf16"`` or ``"float32"``."""
    return _as_dtype(dtype).itemsize


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}")


@dataclass(frozen=True)
class Component:
    """Cost of one component of the layer (per layer, for the whole batch).

    Attributes:
        name: Short identifier, e.g. ``"scores"``.
        description: What it computes, e.g. ``"Q K^T"``.
        flops: FLOPs a dense kernel performs.
        useful_flops: FLOPs on allowed (query, key) pairs; equals ``flops`` unless causal.
        flops_formula: ``flops`` as text in the symbols B, L, S, D, H, K, E, F.
        useful_flops_formula: ``useful_flops`` as text (may use P).
        matmul: Whether it is a matrix multiplication (what FLOP counters count).
        quadratic: Whether it scales with L*S (the "n^2" terms).
        params: Number of parameters (weights and biases).
        params_formula: ``params`` as text.
        activations: Elements of the component's output on the textbook path.
        activations_formula: ``activations`` as text.
    """

    name: str
    description: str
    flops: int
    useful_flops: int
    flops_formula: str
    useful_flops_formula: str
    matmul: bool
    quadratic: bool
    params: int
    params_formula: str
    activations: int
    activations_formula: str

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the fields (JSON-serialisable)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CostBreakdown:
    """FLOPs and memory of an attention layer or transformer block, with per-component rows.

    Component costs are per layer; totals (``flops``, ``params``, ...) multiply by
    ``num_layers``. Create it with :func:`attention_cost` or :func:`transformer_cost`.

    Attributes:
        batch: B.
        seq_len: L, the query length.
        kv_len: S, the key length (equals L for self-attention).
        dim: D, the model dim (input and output of the layer).
        num_heads: H.
        num_kv_heads: K.
        head_dim: E.
        ffn_dim: F, or None for an attention layer alone.
        num_layers: Number of identical layers.
        causal: Whether a causal mask is applied.
        bias: Whether the linear layers have biases.
        dtype: Name of the element type, e.g. ``"float32"``.
        bytes_per_element: Size of that type in bytes.
        components: Per-component costs, in execution order.
        crossover_seq_len: Smallest n (with L = S = n) at which the L*S matmul FLOPs reach the
            other matmul FLOPs of the layer (dense count). See :func:`crossover_seq_len`.
        crossover_exact: The exact ratio ``a / b`` behind ``crossover_seq_len`` (may be
            fractional).
    """

    batch: int
    seq_len: int
    kv_len: int
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int | None
    num_layers: int
    causal: bool
    bias: bool
    dtype: str
    bytes_per_element: int
    components: tuple[Component, ...]
    crossover_seq_len: int
    crossover_exact: Fraction

    # --- totals ------------------------------------------------------------------------------
    @property
    def symbols(self) -> dict[str, int]:
        """Values of the formula symbols for this configuration."""
        return _symbols(
            self.batch,
            self.seq_len,
            self.kv_len,
            self.dim,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.ffn_dim,
        )

    @property
    def flops(self) -> int:
        """Total FLOPs a dense kernel performs, all components and layers."""
        return self.num_layers * sum(c.flops for c in self.components)

    @property
    def useful_flops(self) -> int:
        """Total FLOPs on allowed pairs (less than ``flops`` only when causal)."""
        return self.num_layers * sum(c.useful_flops for c in self.components)

    @property
    def matmul_flops(self) -> int:
        """Total matmul FLOPs: what ``torch.utils.flop_counter.FlopCounterMode`` counts."""
        return self.num_layers * sum(c.flops for c in self.components if c.matmul)

    @property
    def quadratic_flops(self) -> int:
        """FLOPs of the terms that scale with L*S (scores, softmax, weighted sum)."""
        return self.num_layers * sum(c.flops for c in self.components if c.quadratic)

    @property
    def linear_flops(self) -> int:
        """FLOPs of the terms linear in the sequence length (projections, FFN, norms)."""
        return self.flops - self.quadratic_flops

    @property
    def dominant(self) -> str:
        """Name of the component with the most FLOPs."""
        return max(self.components, key=lambda c: c.flops).name

    @property
    def dominant_term(self) -> str:
        """``"n^2"`` if the L*S terms have more FLOPs than the rest, else ``"n*d^2"``."""
        return "n^2" if self.quadratic_flops > self.linear_flops else "n*d^2"

    @property
    def params(self) -> int:
        """Parameters of all layers."""
        return self.num_layers * sum(c.params for c in self.components)

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters in ``dtype``."""
        return self.params * self.bytes_per_element

    @property
    def attn_matrix_elements(self) -> int:
        """Elements of one L x S attention matrix for all heads: ``B*H*L*S`` (one layer)."""
        return self.batch * self.num_heads * self.seq_len * self.kv_len

    @property
    def textbook_peak_attn_bytes(self) -> int:
        """Forward peak of the textbook path's L x S matrices (scores + weights), one layer."""
        return 2 * self.attn_matrix_elements * self.bytes_per_element

    @property
    def textbook_saved_attn_bytes(self) -> int:
        """Bytes of L x S matrices kept for backward on the textbook path (weights), all layers."""
        return self.num_layers * self.attn_matrix_elements * self.bytes_per_element

    @property
    def fused_attn_elements(self) -> int:
        """Per-query statistics a fused kernel keeps instead (logsumexp): ``B*H*L``, one layer."""
        return self.batch * self.num_heads * self.seq_len

    @property
    def fused_saved_attn_bytes(self) -> int:
        """Bytes kept for backward by a fused kernel in place of the weights, all layers."""
        return self.num_layers * self.fused_attn_elements * self.bytes_per_element

    @property
    def linear_activation_elements(self) -> int:
        """Elements of the component outputs other than the L x S matrices, all layers."""
        return self.num_layers * sum(
            c.activations for c in self.components if c.activations_formula != "B*H*L*S"
        )

    @property
    def memory_crossover_exact(self) -> Fraction:
        """n (with L = S = n) at which one ``B*H*L*S`` matrix reaches the other activations.

        The other component outputs grow as ``c*n`` and the matrix as ``B*H*n^2``, so they are
        equal at ``n = c / (B*H)``: ``(3*H*E + 2*K*E + D) / H`` for attention, or ``E*(3 +
        2*K/H) + D/H``, far below the FLOPs crossover.
        """
        one = _symbols(
            1, 1, 1, self.dim, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn_dim
        )
        comps = _components(one, causal=False, bias=self.bias)
        c = sum(x.activations for x in comps if x.activations_formula != "B*H*L*S")
        return Fraction(c, self.num_heads)

    # --- export ------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One dict per component (per layer), plus its share of the layer's FLOPs."""
        total = sum(c.flops for c in self.components) or 1
        return [{**c.to_dict(), "flops_share": c.flops / total} for c in self.components]

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-serialisable values: configuration, rows and totals."""
        return {
            "config": {
                f.name: getattr(self, f.name) for f in fields(self) if f.name not in _DERIVED_FIELDS
            },
            "symbols": self.symbols,
            "components": self.rows(),
            "flops": self.flops,
            "useful_flops": self.useful_flops,
            "matmul_flops": self.matmul_flops,
            "quadratic_flops": self.quadratic_flops,
            "linear_flops": self.linear_flops,
            "dominant": self.dominant,
            "dominant_term": self.dominant_term,
            "crossover_seq_len": self.crossover_seq_len,
            "crossover_exact": str(self.crossover_exact),
            "memory_crossover_exact": str(self.memory_crossover_exact),
            "memory": {
                "params": self.params,
                "param_bytes": self.param_bytes,
                "attn_matrix_elements": self.attn_matrix_elements,
                "attn_matrix_formula": "B*H*L*S",
                "textbook_peak_attn_bytes": self.textbook_peak_attn_bytes,
                "textbook_saved_attn_bytes": self.textbook_saved_attn_bytes,
                "fused_attn_elements": self.fused_attn_elements,
                "fused_attn_formula": "B*H*L",
                "fused_saved_attn_bytes": self.fused_saved_attn_bytes,
                "linear_activation_elements": self.linear_activation_elements,
                "linear_activation_bytes": self.linear_activation_elements * self.bytes_per_element,
            },
        }


# Fields of CostBreakdown computed from the configuration: exported as rows and totals, not config.
_DERIVED_FIELDS = ("components", "crossover_seq_len", "crossover_exact")


# --- building blocks -------------------------------------------------------------------------
def _symbols(
    b: int, l: int, s: int, d: int, h: int, k: int, e: int, f: int | None
) -> dict[str, int]:
    # P: allowed (query, key) pairs of a causal mask aligned to the end of the keys: query i
    # (0-based) sees max(0, min(S, i + S - L + 1)) keys; for L > S the first L - S rows see none.
    p = l * (l + 1) // 2 + l * (s - l) if l <= s else s * (s + 1) // 2
    symbols = {"B": b, "L": l, "S": s, "D": d, "H": h, "K": k, "E": e, "P": p}
    if f is not None:
        symbols["F"] = f
    return symbols


# name, description, flops, useful flops (None: same), matmul, quadratic, params, activations
_ATTENTION_SPEC: tuple[tuple[str, str, str, str | None, bool, bool, str, str], ...] = (
    ("q_proj", "x W_q", "2*B*L*D*H*E", None, True, False, "D*H*E", "B*L*H*E"),
    ("k_proj", "x W_k", "2*B*S*D*K*E", None, True, False, "D*K*E", "B*S*K*E"),
    ("v_proj", "x W_v", "2*B*S*D*K*E", None, True, False, "D*K*E", "B*S*K*E"),
    ("scores", "Q K^T", "2*B*H*L*S*E", "2*B*H*P*E", True, True, "0", "B*H*L*S"),
    ("softmax", "softmax(scores)", "5*B*H*L*S", "5*B*H*P", False, True, "0", "B*H*L*S"),
    ("weighted_sum", "weights V", "2*B*H*L*S*E", "2*B*H*P*E", True, True, "0", "B*L*H*E"),
    ("out_proj", "o W_o", "2*B*L*H*E*D", None, True, False, "H*E*D", "B*L*D"),
)
_BLOCK_SPEC: tuple[tuple[str, str, str, str | None, bool, bool, str, str], ...] = (
    ("ffn_up", "x W_1", "2*B*L*D*F", None, True, False, "D*F", "B*L*F"),
    ("ffn_act", "relu", "B*L*F", None, False, False, "0", "B*L*F"),
    ("ffn_down", "h W_2", "2*B*L*F*D", None, True, False, "F*D", "B*L*D"),
    ("norms", "2 x add & LayerNorm", "16*B*L*D", None, False, False, "4*D", "2*B*L*D"),
)
_BIASES = {
    "q_proj": "H*E",
    "k_proj": "K*E",
    "v_proj": "K*E",
    "out_proj": "D",
    "ffn_up": "F",
    "ffn_down": "D",
}


def _components(symbols: Mapping[str, int], *, causal: bool, bias: bool) -> tuple[Component, ...]:
    spec = _ATTENTION_SPEC + (_BLOCK_SPEC if "F" in symbols else ())
    out = []
    for name, description, flops, useful, matmul, quadratic, params, acts in spec:
        useful = useful if (causal and useful is not None) else flops
        if bias and name in _BIASES:
            params = f"{params} + {_BIASES[name]}"
        out.append(
            Component(
                name=name,
                description=description,
                flops=evaluate_formula(flops, symbols),
                useful_flops=evaluate_formula(useful, symbols),
                flops_formula=flops,
                useful_flops_formula=useful,
                matmul=matmul,
                quadratic=quadratic,
                params=evaluate_formula(params, symbols),
                params_formula=params,
                activations=evaluate_formula(acts, symbols),
                activations_formula=acts,
            )
        )
    return tuple(out)


def _check_positive(**sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {name}={value}")


def _resolve_heads(
    dim: int, num_heads: int, head_dim: int | None, num_kv_heads: int | None
) -> tuple[int, int]:
    _check_positive(dim=dim, num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads)
    if head_dim is None:
        if dim % num_heads:
            raise ValueError(
                f"dim ({dim}) must be divisible by num_heads ({num_heads}), or pass head_dim"
            )
        head_dim = dim // num_heads
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    return head_dim, num_kv_heads


# --- public functions ------------------------------------------------------------------------
def crossover_seq_len(
    dim: int,
    num_heads: int,
    *,
    head_dim: int | None = None,
    num_kv_heads: int | None = None,
    ffn_dim: int | None = None,
) -> tuple[int, Fraction]:
    """Sequence length at which the L*S matmul FLOPs overtake the other matmul FLOPs.

    With ``L = S = n`` the projections (and the feed-forward, if ``ffn_dim`` is given) cost
    ``a*n`` FLOPs and the two attention matmuls ``b*n^2``; they are equal at ``n* = a / b``.
    ``a`` and ``b`` are read off the component formulas evaluated at ``n = 1``; the batch
    cancels. For standard self-attention (K = H, H*E = D) this gives ``n* = 2*D``; with a
    ``4*D`` feed-forward it gives ``6*D``; grouped-query attention lowers it to ``D*(1 + K/H)``.
    The count is dense (a causal kernel's useful half moves it to about ``2*n*``).

    Args:
        dim: D.
        num_heads: H.
        head_dim: E; defaults to ``dim // num_heads``.
        num_kv_heads: K; defaults to ``num_heads``.
        ffn_dim: F, to include a feed-forward in the linear terms.

    Returns:
        ``(n, exact)``: the smallest integer n with ``b*n^2 >= a*n``, and the exact ``a / b``.

    Raises:
        ValueError: For non-positive sizes or heads that do not divide.
    """
    _check_positive(ffn_dim=ffn_dim)
    head_dim, num_kv_heads = _resolve_heads(dim, num_heads, head_dim, num_kv_heads)
    symbols = _symbols(1, 1, 1, dim, num_heads, num_kv_heads, head_dim, ffn_dim)
    comps = [c for c in _components(symbols, causal=False, bias=False) if c.matmul]
    a = sum(c.flops for c in comps if not c.quadratic)  # per token
    b = sum(c.flops for c in comps if c.quadratic)  # per (query, key) pair
    exact = Fraction(a, b)
    n = exact.numerator // exact.denominator
    return (n if n * exact.denominator == exact.numerator else n + 1), exact


class CostOptions(TypedDict, total=False):
    """The keyword options :func:`attention_cost` and :func:`transformer_cost` share.

    Attributes:
        batch: B (default 1).
        kv_len: S, the key length for cross-attention; defaults to ``seq_len``.
        head_dim: E; defaults to ``dim // num_heads``.
        num_kv_heads: K, key/value heads (grouped-query attention); defaults to ``num_heads``.
        causal: Whether a causal mask is applied (changes ``useful_flops`` only; default
            ``False``).
        dtype: Element type for byte counts (``torch.dtype`` or a name like ``"bf16"``; default
            ``float32``).
        bias: Whether the linear layers have biases (changes ``params`` only; default ``True``).
    """

    batch: int
    kv_len: int | None
    head_dim: int | None
    num_kv_heads: int | None
    causal: bool
    dtype: torch.dtype | str
    bias: bool


def attention_cost(
    seq_len: int, dim: int, num_heads: int, **options: Unpack[CostOptions]
) -> CostBreakdown:
    """FLOPs and memory of one multi-head attention layer, per component.

    The layer is ``MultiHeadAttention(dim, num_heads, head_dim=head_dim,
    num_kv_heads=num_kv_heads)`` applied to a query ``(B, L, D)`` and, for cross-attention, a
    key/value input ``(B, S, D)``; with the defaults it is the seed's
    ``MultiHeadSelfAttention(D, D, D, H)``. ``matmul_flops`` of the result equals what
    ``torch.utils.flop_counter.FlopCounterMode`` counts for its forward with torch's math SDPA
    backend (or on the meta device).

    Args:
        seq_len: L, the query length.
        dim: D, the model dim.
        num_heads: H, query heads.
        **options: ``batch``, ``kv_len``, ``head_dim``, ``num_kv_heads``, ``causal``, ``dtype``,
            ``bias`` (see :class:`CostOptions`).

    Returns:
        A :class:`CostBreakdown` with ``ffn_dim=None`` and ``num_layers=1``.

    Raises:
        ValueError: For non-positive sizes, ``dim`` not divisible by ``num_heads`` (without
            ``head_dim``), ``num_heads`` not divisible by ``num_kv_heads``, or an unknown dtype.
        TypeError: For sizes that are not ints, or unknown options.
    """
    return _cost(seq_len, dim, num_heads, ffn_dim=None, num_layers=1, **options)


def transformer_cost(
    seq_len: int,
    dim: int,
    num_heads: int,
    *,
    ffn_dim: int | None = None,
    num_layers: int = 1,
    **options: Unpack[CostOptions],
) -> CostBreakdown:
    """FLOPs and memory of a stack of transformer blocks (attention, feed-forward, two norms).

    One block is the seed's ``TransformerBlock``: ``norm1(x + attn(x))`` then
    ``norm2(x + ffn(x))`` with ``ffn = Linear(D, F) -> ReLU -> Linear(F, D)``. Embeddings and
    the output head are not included.

    Args:
        seq_len: L.
        dim: D.
        num_heads: H.
        ffn_dim: F; defaults to ``4 * dim``.
        num_layers: Number of blocks; totals are multiplied by it.
        **options: As :func:`attention_cost` (see :class:`CostOptions`).

    Returns:
        A :class:`CostBreakdown` whose components include ``ffn_up``, ``ffn_act``, ``ffn_down``
        and ``norms``; its crossover includes the feed-forward in the linear terms.

    Raises:
        ValueError: As :func:`attention_cost`, and for non-positive ``ffn_dim``/``num_layers``.
        TypeError: For sizes that are not ints, or unknown options.
    """
    ffn_dim = 4 * dim if ffn_dim is None else ffn_dim
    return _cost(seq_len, dim, num_heads, ffn_dim=ffn_dim, num_layers=num_layers, **options)


def _cost(
    seq_len: int,
    dim: int,
    num_heads: int,
    *,
    ffn_dim: int | None,
    num_layers: int,
    batch: int = 1,
    kv_len: int | None = None,
    head_dim: int | None = None,
    num_kv_heads: int | None = None,
    causal: bool = False,
    dtype: torch.dtype | str = torch.float32,
    bias: bool = True,
) -> CostBreakdown:
    _check_positive(
        seq_len=seq_len, batch=batch, kv_len=kv_len, ffn_dim=ffn_dim, num_layers=num_layers
    )
    head_dim, num_kv_heads = _resolve_heads(dim, num_heads, head_dim, num_kv_heads)
    kv_len = seq_len if kv_len is None else kv_len
    torch_dtype = _as_dtype(dtype)
    symbols = _symbols(batch, seq_len, kv_len, dim, num_heads, num_kv_heads, head_dim, ffn_dim)
    n, exact = crossover_seq_len(
        dim, num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, ffn_dim=ffn_dim
    )
    return CostBreakdown(
        batch=batch,
        seq_len=seq_len,
        kv_len=kv_len,
        dim=dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        num_layers=num_layers,
        causal=bool(causal),
        bias=bool(bias),
        dtype=str(torch_dtype).removeprefix("torch."),
        bytes_per_element=torch_dtype.itemsize,
        components=_components(symbols, causal=causal, bias=bias),
        crossover_seq_len=n,
        crossover_exact=exact,
    )
