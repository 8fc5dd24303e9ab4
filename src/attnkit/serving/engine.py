"""The serving engine: continuous batching over a paged key/value cache with prefix caching.

One loop (:meth:`Engine.step`) runs every running request together through the model's own
forward, packed along the length dim: each decoding request brings its last token, each request
still reading its prompt brings a chunk of it (at most ``prefill_chunk`` prompt tokens a step over
all of them, so a long prompt does not stall the others). A new request joins at the next step, a
finished or aborted one leaves at once and its blocks go back to the pool.

Keys and values live in a :class:`attnkit.serving.paged.PagedKVCache`. When the pool cannot hold
the next step, the youngest running request is preempted: its blocks are released and it waits
at the head of the queue, to recompute its prompt and the tokens it already generated later.
New requests are admitted only while the pool has room. Full blocks of a prompt are found again
by their prefix hash, so a repeated system prompt is read from the cache instead of recomputed.

Every request runs at its own positions and attends only its own keys, so a greedy request gets
the tokens it gets alone with :meth:`attnkit.TransformerLM.generate` (up to float ties: the
matrix products see other rows).

Threads: :meth:`Engine.add_request` and :meth:`Engine.abort` may be called from any thread;
:meth:`Engine.start` runs the loop in a daemon thread that sleeps on a condition while idle.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import Tensor, nn

from attnkit.serving.paged import PagedKVCache, SequenceSlice, block_hash
from attnkit.serving.sampling import LogitsProcessor, SamplingParams, choose

__all__ = [
    "DEFAULT_TOKENS_PER_SEQUENCE",
    "Engine",
    "EngineStats",
    "EventCallback",
    "TokenEvent",
]

logger = logging.getLogger(__name__)

#: Without ``kv_cache_tokens`` the pool holds ``max_batch`` sequences of this many tokens (or of
#: the model's context, if shorter).
DEFAULT_TOKENS_PER_SEQUENCE = 2048


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of a request (or its end).

    Attributes:
        request_id: The request.
        token_id: The token; ``-1`` for an ``"abort"`` event, which carries none.
        logprob: Its log-probability, when the request asked for logprobs.
        top_logprobs: The top alternatives ``(token, logprob)``, when asked.
        finish_reason: ``None`` while running; ``"stop"`` (a stop token, this one), ``"length"``
            (``max_tokens`` or the context reached) or ``"abort"``.
        prompt_tokens: Tokens of the prompt.
        completion_tokens: Tokens generated so far, this one included.
        cached_tokens: Prompt tokens read from the prefix cache.
    """

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


#: Called by the engine's thread with each event of a request: must return quickly.
EventCallback = Callable[[TokenEvent], None]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for metrics.

    Attributes:
        running: Requests holding blocks (reading their prompt or decoding).
        waiting: Requests queued (new or preempted).
        kv_blocks_used: Blocks held by requests.
        kv_blocks_free: Blocks that can be handed out (cached prefixes nobody holds included).
        kv_block_size: Token slots per block.
        prefix_cache_hits: Prompt blocks found in the prefix cache, in total.
        prefix_cache_queries: Prompt blocks looked up, in total.
        preemptions: Requests preempted for lack of blocks, in total.
        kv_bytes_used: Bytes of the blocks held.
        kv_tokens: Tokens whose keys/values the running requests hold.
        kv_bytes_per_token: Bytes one token's keys/values take over every layer.
    """

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_block_size: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    preemptions: int
    kv_bytes_used: int
    kv_tokens: int
    kv_bytes_per_token: int


class _ModelConfig(Protocol):
    """The sizes the engine reads from its model's ``config`` (a
    :class:`attnkit.TransformerConfig`)."""

    max_seq_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None
    head_dim: int | None
    dim: int


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    processor: LogitsProcessor | None
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # prefix keys of the full blocks
    computed: int = 0  # positions whose keys/values are in the blocks
    cached_tokens: int = 0
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


class Engine:
    """Continuous batching of a causal LM over a paged KV cache (see the module docstring).

    Args:
        model: A :class:`attnkit.TransformerLM` (any module with its ``forward`` keywords
            ``positions``, ``kv_caches``, ``logits_at`` and its ``config``).
        max_batch: Most requests running at once.
        kv_cache_tokens: Token slots of the pool (rounded up to whole blocks); default
            ``max_batch * min(max_context, DEFAULT_TOKENS_PER_SEQUENCE)``.
        block_size: Token slots per block.
        prefill_chunk: Most prompt tokens read per step, over all requests.
        prefix_caching: Share full prompt blocks between requests by prefix hash.
        logits_processor_factory: Unused by the engine; kept for the server, which builds
            per-request processors with it.

    Raises:
        ValueError: For sizes that are not positive ints.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch: int = 16,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = 256,
        prefix_caching: bool = True,
        logits_processor_factory: Callable[..., LogitsProcessor] | None = None,
    ) -> None:
        sizes = {"max_batch": max_batch, "block_size": block_size, "prefill_chunk": prefill_chunk}
        if kv_cache_tokens is not None:
            sizes["kv_cache_tokens"] = kv_cache_tokens
        bad: dict[str, int] = {
            k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int)
        }
        bad |= {k: v for k, v in sizes.items() if k not in bad and v < 1}
        if bad:
            raise ValueError(f"Engine sizes must be positive ints, got {bad}")
        config = cast(_ModelConfig, model.config)
        self.model = model.eval()
        self.max_context: int = int(config.max_seq_len)
        self.vocab_size: int = int(config.vocab_size)
        self.max_batch, self.block_size, self.prefill_chunk = max_batch, block_size, prefill_chunk
        self.prefix_caching = prefix_caching
        self.logits_processor_factory = logits_processor_factory
        if kv_cache_tokens is None:
            kv_cache_tokens = max_batch * min(self.max_context, DEFAULT_TOKENS_PER_SEQUENCE)
        weight = next(model.parameters())
        self.cache = PagedKVCache(
            num_layers=int(config.num_layers),
            num_blocks=-(-kv_cache_tokens // block_size),
            block_size=block_size,
            num_kv_heads=int(config.num_kv_heads or config.num_heads),
            head_dim=int(config.head_dim or config.dim // config.num_heads),
            dtype=weight.dtype if weight.dtype.is_floating_point else torch.float32,
            device=weight.device,
        )
        self.device = weight.device
        self._requests: dict[str, _Request] = {}
        self._listeners: dict[str, list[EventCallback]] = {}
        self._intake: deque[_Request] = deque()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # admission order: the last is the youngest
        self._cond = threading.Condition(threading.Lock())  # guards _intake/_requests
        self._step_lock = threading.Lock()  # one step (or abort) at a time
        self._aborts: set[str] = set()  # asked for during a step
        self._thread: threading.Thread | None = None
        self._stopping = self._cancel = False
        self._hits = self._queries = self._preemptions = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        logits_processor: LogitsProcessor | None = None,
        on_event: EventCallback | None = None,
    ) -> str:
        """Queue a request; it joins the running batch at the next step. Thread-safe.

        Args:
            prompt_ids: The prompt's token ids.
            params: How to decode it.
            request_id: Its id (default: a fresh one).
            logits_processor: ``processor(generated_ids, logits)`` -> logits, called on this
                request's ``(V,)`` logits before each token is chosen.
            on_event: Called (by the engine's thread) with each :class:`TokenEvent`.

        Returns:
            The request id.

        Raises:
            ValueError: For an empty prompt, ids outside the vocabulary, a prompt that leaves no
                room in the context, a request the whole pool cannot hold, or an id in use.
            TypeError: For params that are not :class:`SamplingParams`.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, the context holds {self.max_context}: "
                "no room for a token"
            )
        longest = min(len(prompt) + params.max_tokens, self.max_context)
        blocks = -(-longest // self.block_size)
        if blocks > self.cache.pool.num_blocks:
            raise ValueError(
                f"the request needs up to {longest} tokens ({blocks} blocks), the KV cache holds "
                f"{self.cache.pool.num_blocks} blocks of {self.block_size}"
            )
        generator = None
        if not params.greedy:
            generator = torch.Generator(device="cpu")
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        req = _Request(rid, prompt, params, logits_processor, generator)
        req.tokens = list(prompt)
        with self._cond:
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self._requests[rid] = req
            self._listeners[rid] = [on_event] if on_event is not None else []
            self._intake.append(req)
            self._cond.notify_all()
        return rid

    def subscribe(self, request_id: str) -> queue.Queue[TokenEvent]:
        """A queue that receives the request's events from now on.

        Raises:
            KeyError: For an unknown (or finished) request.
        """
        events: queue.Queue[TokenEvent] = queue.Queue()
        with self._cond:
            if request_id not in self._requests:
                raise KeyError(f"no running request {request_id!r}")
            self._listeners[request_id].append(events.put)
        return events

    def abort(self, request_id: str) -> None:
        """End a request: its blocks are freed and it gets an ``"abort"`` event. Unknown or
        finished ids are ignored (a client may cancel after the end). Thread-safe and never
        waits for a step: during a step the request ends as soon as that step does."""
        with self._cond:
            if request_id not in self._requests:
                return
            self._aborts.add(request_id)
            self._cond.notify_all()
        if self._step_lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self._step_lock.release()

    def _apply_aborts(self) -> list[TokenEvent]:
        """End the requests :meth:`abort` asked for (the step lock held); their events."""
        with self._cond:
            ids, self._aborts = self._aborts, set()
            reqs = [self._requests[i] for i in ids if i in self._requests]
            for req in reqs:
                if req in self._intake:
                    self._intake.remove(req)
        events = []
        for req in reqs:
            if req in self._waiting:
                self._waiting.remove(req)
            if req in self._running:
                self._running.remove(req)
            events.append(self._finish(req, -1, None, None, "abort"))
        self._emit(events)
        return events

    def has_work(self) -> bool:
        """Whether any request is queued or running (or an abort is pending)."""
        return bool(self._intake or self._waiting or self._running or self._aborts)

    def stats(self) -> EngineStats:
        """Counts for metrics. Read without waiting for a step in progress (a scrape never
        stalls), so a snapshot taken during a step may mix counts from before and after it."""
        pool = self.cache.pool
        used = pool.num_used
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting) + len(self._intake),
            kv_blocks_used=used,
            kv_blocks_free=pool.num_blocks - used,
            kv_block_size=self.block_size,
            prefix_cache_hits=self._hits,
            prefix_cache_queries=self._queries,
            preemptions=self._preemptions,
            kv_bytes_used=used * self.cache.bytes_per_block,
            kv_tokens=sum(r.computed for r in list(self._running)),
            kv_bytes_per_token=self.cache.bytes_per_token,
        )

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[TokenEvent]:
        """One iteration: admit what fits, run one packed forward, emit the new tokens.

        Returns:
            The events of this step (also sent to each request's listeners).
        """
        with self._step_lock:
            events = self._apply_aborts()
            with self._cond:
                self._waiting.extend(self._intake)
                self._intake.clear()
            parts = self._schedule()
            if parts:
                tokens = self._run(parts)
                self._emit(tokens)
                events += tokens
            return events + self._apply_aborts()  # (those asked for during the forward)

    def _schedule(self) -> list[tuple[_Request, int]]:
        """``(request, new tokens)`` of the next forward, one-token requests first."""
        budget = self.prefill_chunk
        parts: list[tuple[_Request, int]] = []
        for req in list(self._running):
            if req not in self._running:  # preempted for an older one
                continue
            remaining = len(req.tokens) - req.computed
            n = 1 if remaining == 1 else min(remaining, budget)
            if n == 0:
                continue
            if not self._reserve(req, req.computed + n):
                continue  # preempted itself
            if remaining > 1:
                budget -= n
            parts.append((req, n))
        while self._waiting and len(self._running) < self.max_batch and budget > 0:
            req = self._waiting[0]
            if not req.blocks and self.prefix_caching:
                self._reuse_prefix(req)
            remaining = len(req.tokens) - req.computed
            n = 1 if remaining == 1 else min(remaining, budget)
            need = -(-(req.computed + n) // self.block_size) - len(req.blocks)
            if need > self.cache.pool.num_free:
                self._release(req)  # the hits go back to the cache; retried next step
                break
            self._waiting.popleft()
            self._running.append(req)
            self._reserve(req, req.computed + n)
            if remaining > 1:
                budget -= n
            parts.append((req, n))
        parts.sort(key=lambda p: p[1] != 1)  # stable: one-token parts first
        return parts

    def _reuse_prefix(self, req: _Request) -> None:
        """Take the cached full blocks of the request's first tokens (all but its last token
        are eligible: the last one's logits must be computed)."""
        pool, bs = self.cache.pool, self.block_size
        parent: int | None = None
        for i in range((len(req.tokens) - 1) // bs):
            key = block_hash(parent, req.tokens[i * bs : (i + 1) * bs])
            self._queries += 1
            block = pool.lookup(key)
            if block is None:
                break
            self._hits += 1
            req.blocks.append(block)
            req.hashes.append(key)
            parent = key
        req.computed = len(req.blocks) * bs
        if not req.generated:
            req.cached_tokens = req.computed

    def _reserve(self, req: _Request, positions: int) -> bool:
        """Give ``req`` blocks for ``positions``, preempting the youngest running requests
        while the pool is short. False when ``req`` itself was preempted."""
        pool = self.cache.pool
        while len(req.blocks) * self.block_size < positions:
            block = pool.allocate()
            if block is not None:
                req.blocks.append(block)
                continue
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self._release(req)
        self._waiting.appendleft(req)
        self._preemptions += 1

    def _release(self, req: _Request) -> None:
        for block in req.blocks:
            self.cache.pool.release(block)
        req.blocks, req.hashes, req.computed = [], [], 0

    @torch.no_grad()
    def _run(self, parts: list[tuple[_Request, int]]) -> list[TokenEvent]:
        """One packed forward of ``parts`` and the tokens it yields."""
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []  # packed index of each part's last token, where it ends the tokens
        slices = []
        for req, n in parts:
            start = req.computed
            ids += req.tokens[start : start + n]
            positions += range(start, start + n)
            slices.append(SequenceSlice(req.blocks, start, n))
            if start + n == len(req.tokens):
                last.append(len(ids) - 1)
        self.cache.plan(slices)
        device = self.device
        with torch.inference_mode():
            logits = self.model(
                torch.tensor([ids], device=device),
                positions=torch.tensor([positions], device=device),
                kv_caches=self.cache.layers(),
                logits_at=torch.tensor(last, dtype=torch.long, device=device),
            )[0]  # (rows, V)
        self.cache.batch = None
        events = []
        row = 0
        for req, n in parts:
            req.computed += n
            self._register_full_blocks(req)
            if req.computed < len(req.tokens):
                continue
            try:
                events.append(self._next_token(req, logits[row]))
            except Exception:  # its logits processor failed: that request ends, not the others
                logger.exception("choosing the next token of request %s failed", req.id)
                if req in self._running:
                    self._running.remove(req)
                events.append(self._finish(req, -1, None, None, "abort"))
            row += 1
        return events

    def _register_full_blocks(self, req: _Request) -> None:
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(req.hashes) < req.computed // bs:
            i = len(req.hashes)
            parent = req.hashes[-1] if req.hashes else None
            key = block_hash(parent, req.tokens[i * bs : (i + 1) * bs])
            self.cache.pool.register(req.blocks[i], key)
            req.hashes.append(key)

    def _next_token(self, req: _Request, logits: Tensor) -> TokenEvent:
        params = req.params
        if req.processor is not None:
            logits = req.processor(req.generated, logits)
        pick = choose(logits, params, req.generator)
        req.tokens.append(pick.token_id)
        reason = None
        if pick.token_id in params.stop_token_ids and not params.ignore_eos:
            reason = "stop"
        elif len(req.generated) >= params.max_tokens or len(req.tokens) >= self.max_context:
            reason = "length"
        if reason is None:
            return self._event(req, pick.token_id, pick.logprob, pick.top_logprobs, None)
        self._running.remove(req)
        return self._finish(req, pick.token_id, pick.logprob, pick.top_logprobs, reason)

    def _event(
        self,
        req: _Request,
        token: int,
        logprob: float | None,
        top: tuple[tuple[int, float], ...] | None,
        reason: str | None,
    ) -> TokenEvent:
        return TokenEvent(
            req.id,
            token,
            logprob,
            top,
            reason,
            len(req.prompt),
            len(req.generated),
            req.cached_tokens,
        )

    def _finish(
        self,
        req: _Request,
        token: int,
        logprob: float | None,
        top: tuple[tuple[int, float], ...] | None,
        reason: str,
    ) -> TokenEvent:
        """Free the request's blocks and forget it; its last event."""
        self._release(req)
        req.done = True
        with self._cond:
            self._requests.pop(req.id, None)
        return self._event(req, token, logprob, top, reason)

    def _emit(self, events: list[TokenEvent] | TokenEvent) -> None:
        for event in events if isinstance(events, list) else [events]:
            with self._cond:
                if event.finish_reason is None:
                    listeners = list(self._listeners.get(event.request_id, ()))
                else:
                    listeners = self._listeners.pop(event.request_id, [])
            for listener in listeners:
                try:
                    listener(event)
                except Exception:
                    logger.exception("an event listener of request %s failed", event.request_id)

    # ------------------------------------------------------------------ background use
    def start(self) -> None:
        """Run the loop in a daemon thread: steps while there is work, sleeps on a condition
        while idle (woken by :meth:`add_request` and :meth:`stop`).

        Raises:
            RuntimeError: If the loop already runs.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the engine loop is already running")
        self._stopping = False
        self._cancel = False
        self._thread = threading.Thread(target=self._loop, name="attnkit-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.has_work():
                    self._cond.wait()
                if self._stopping and (self._cancel or not self.has_work()):
                    return
            try:
                self.step()
            except Exception:  # a failed step ends its requests, not the server
                logger.exception("an engine step failed; aborting the running requests")
                self._abort_all()

    def _abort_all(self) -> None:
        with self._cond:
            ids = list(self._requests)
        for rid in ids:
            self.abort(rid)

    def stop(self, *, cancel: bool = True, timeout: float | None = None) -> None:
        """Stop the loop: abort every request (``cancel``) or let them finish first; waits up to
        ``timeout`` seconds for the thread."""
        with self._cond:
            self._stopping, self._cancel = True, cancel
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if not thread.is_alive():
                self._thread = None
        if cancel:
            self._abort_all()

    @property
    def running(self) -> bool:
        """Whether the background loop runs."""
        return self._thread is not None and self._thread.is_alive()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[int]]:
        """Run the prompts to completion together; their generated ids (synchronous: steps
        here, or waits for the background loop when it runs).

        Raises:
            ValueError: As :meth:`add_request`, or for a params list of another length.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params)} params")
        outputs: dict[str, list[int]] = {}
        finished: queue.Queue[str] = queue.Queue()

        def collect(event: TokenEvent) -> None:
            if event.token_id >= 0:
                outputs[event.request_id].append(event.token_id)
            if event.finish_reason is not None:
                finished.put(event.request_id)

        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = uuid.uuid4().hex
            outputs[rid] = []
            ids.append(self.add_request(prompt, p, request_id=rid, on_event=collect))
        if self.running:
            for _ in ids:
                finished.get()
        else:
            while finished.qsize() < len(ids):
                self.step()
        return [outputs[rid] for rid in ids]
