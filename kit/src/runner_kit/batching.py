"""Continuous batching for the policy server, batch-invariant by construction.

Concurrent calls share decode steps: a scheduler thread admits each new call between steps (its prefill runs
alone) and then runs one forward pass over every active call's next token. Each call keeps its own seeded
sampler, so its sampled ids and logprobs are bit-identical to sampling it alone, whatever else is in the
batch. Two things make the shared forward pass exact:

- every nn.Linear multiplies each row on its own: a BLAS gemm's rounding depends on how many rows it
  multiplies (on CPU one row takes the gemv path, two or three rows one kernel, four or more another), and
  a row alone is what one-at-a-time sampling multiplies. One batched matmul of one-row matrices against the
  weight (`torch.baddbmm` over a stride-0 view, no copy) does that for every row in one call, at a fraction
  of the cost of a Python loop over the rows, where it equals F.linear row by row bit for bit. That depends
  on the BLAS and the CPU (on one AVX2 machine every weight up to 4864 x 896 did; on an AVX-512 one, at two
  intra-op threads, MKL's batched kernel rounds a 642 x 128 lm_head otherwise), so each weight shape is
  checked on this machine at start, for 2 to 8, 16, 32 and 64 rows, and a shape that fails is multiplied one
  row at a time (F.linear per row: the very call one-at-a-time sampling makes);
- attention runs over each row's own keys (the batched cache is left-padded, and the padding never enters a
  reduction), one SDPA call for each run of rows of one length (a group's samples of one prompt stay in step)
  where this machine's SDPA computes a row in such a batch as it computes it alone (checked at start for
  2-8 rows and key counts to 2049), else one call per row.

Everything else in a decoder layer (norms, rotary embeddings, activations) is row-wise already, and so is
sampling: each call draws its noise from its own generator, and the arithmetic around the draws runs over
all rows at once (`sample`). Each sampler checks all this on its model before it batches: three prompts
decoded together (two of one length) must give the logits they give alone, bit for bit, or it samples one
call at a time and says why.

On CPU the sampler computes with one intra-op thread (CPU_THREADS), batched or not, so a call's tokens do not
depend on the machine's core count either (a BLAS splits a product otherwise across 1 and 2 threads: MKL's
one-row lm_head product on an AVX-512 machine does). On a small model the OpenMP fork and join around every op
costs more than a second thread gives, and the environment stack's processes need the other cores.

A call whose prompt the batcher prefilled a moment ago (another sample of the same group) starts from a
copy of that prefill: a prefill is a function of the prompt's ids and the weights alone, so the copy is
what the call would compute, bit for bit (`_SharedPrefills`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_ROWS = 64  # calls decoded together; more wait for a free row
CPU_THREADS = 1  # intra-op threads of the sampler's forward passes and sampling when the model is on CPU
SHARED_PREFILL_TOKENS = 32_768  # prompt tokens whose prefills are kept for the same prompt's other calls


def processed_logprobs(logits, temperature: float, top_p: float, top_k: int):
    """log-probabilities after temperature, top-k and top-p, in that order (transformers' warper order)."""
    import torch

    scores = logits / temperature
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def sample(calls: list[_Call], logits) -> list[bool]:
    """Samples each call's next token from its row of `logits` ([calls, vocab]) and records it; True for each
    call that is finished.

    A sampled row draws what torch.multinomial(p, 1) draws for one sample: Exp(1) noise over the vocabulary
    from the call's own generator, then argmax(p / noise). The arithmetic around the draws (temperature,
    log_softmax, exp, the division, argmax) runs once over the rows that sample alike; each of those ops
    computes a row as it computes the row alone, which the sampler's start-up check confirms."""
    import torch

    logits = logits.float().cpu()
    alike: dict[tuple, list[int]] = {}
    for row, call in enumerate(calls):
        alike.setdefault((call.greedy, call.temperature, call.top_p, call.top_k), []).append(row)
    if len(alike) == 1:
        scores = _processed(logits, *next(iter(alike)))
    else:
        scores = torch.empty_like(logits)
        for key, rows in alike.items():
            scores[rows] = _processed(logits[rows], *key)
    tokens = scores.argmax(dim=-1)
    hot = [row for row, call in enumerate(calls) if not call.greedy]
    if hot:
        probabilities = scores.exp() if len(hot) == len(calls) else scores[hot].exp()
        if math.isnan(float(probabilities.sum())):  # log_softmax of an inf or nan logit is nan
            raise RuntimeError("the policy's logits are not finite (inf or nan): nothing can be sampled from them")
        noise = torch.empty_like(probabilities)
        for row, call in zip(noise, (calls[row] for row in hot)):
            row.exponential_(1, generator=call.generator)
        drawn = (probabilities / noise).argmax(dim=-1)
        if len(hot) == len(calls):
            tokens = drawn
        else:
            tokens[hot] = drawn
    logprobs = scores.gather(1, tokens.unsqueeze(1)).view(-1)
    return [call.record(token, logprob) for call, token, logprob in zip(calls, tokens.tolist(), logprobs.tolist())]


def _processed(logits, greedy: bool, temperature: float, top_p: float, top_k: int):
    """Rows of log-probabilities to sample from: the logits' own for greedy rows, else after temperature, top-k
    and top-p (one op over all rows when only the temperature applies)."""
    import torch

    if greedy:
        return torch.log_softmax(logits, dim=-1)
    if top_p >= 1.0 and not 0 < top_k < logits.shape[-1]:
        return torch.log_softmax(logits / temperature, dim=-1)
    return torch.stack([processed_logprobs(row, temperature, top_p, top_k) for row in logits])


@contextlib.contextmanager
def _intra_op_threads(count: int):
    """The calling thread runs torch ops with `count` intra-op threads meanwhile. torch.set_num_threads sets the
    calling thread's OpenMP and MKL counts; threads that already ran a parallel op (the trainer's) keep theirs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Call:
    """One generation: its sampling parameters, its own seeded generator and what it has sampled so far."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    greedy: bool
    seed: int
    eos_ids: set[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    error: BaseException | None = None
    length: int = 0  # tokens in this call's KV cache
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        import torch

        self.generator = torch.Generator().manual_seed(self.seed)

    def record(self, token: int, logprob: float) -> bool:
        """Appends a sampled token; True when the call is finished (an eos id or max_new_tokens)."""
        self.ids.append(token)
        self.logprobs.append(min(0.0, logprob))
        if token in self.eos_ids:
            return self.end("stop")
        if len(self.ids) >= self.max_new_tokens:
            return self.end("length")
        return False

    def end(self, finish: str | None, error: BaseException | None = None) -> bool:
        """Records how the call ended. A batched call's caller wakes when the batcher sets `done`, after the
        decode step's inference mode is over: the trainer that waits for its episodes then finds the model
        in the mode it left it in (its recorder checks `model.training`)."""
        self.finish, self.error = finish, error
        return True

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None


class _SharedPrefills:
    """Recent prefills by prompt ids, at most `max_tokens` prompt tokens of them, least recently used first out.

    Kept only while the weights are the ones that computed them (each parameter's storage and version
    counter, which every in-place update bumps) and while the batcher has work: it clears them when it goes
    idle, which is when a trainer updates the weights between rollout batches (an update through `.data`
    bumps no counter)."""

    def __init__(self, model, max_tokens: int = SHARED_PREFILL_TOKENS):
        self.model, self.max_tokens = model, max_tokens
        self._kept: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        self._tokens = 0
        self._weights: tuple = ()

    def check_weights(self) -> None:
        """Forgets every kept prefill if the weights changed since the last check (once per admission round:
        they cannot change while the batcher holds the model)."""
        weights = tuple((p.data_ptr(), p._version) for p in self.model.parameters())
        if weights != self._weights:
            self.clear()
            self._weights = weights

    def get(self, prompt_ids: tuple[int, ...]) -> tuple | None:
        """(last position's logits, a KV cache of its own) of an earlier prefill of these ids, or None."""
        kept = self._kept.get(prompt_ids)
        if kept is None:
            return None
        self._kept.move_to_end(prompt_ids)
        return kept[0], _copy_cache(kept[1])

    def put(self, prompt_ids: tuple[int, ...], logits, cache) -> None:
        if len(prompt_ids) > self.max_tokens:
            return
        self._kept[prompt_ids] = (logits, _copy_cache(cache))
        self._tokens += len(prompt_ids)
        while self._tokens > self.max_tokens:
            oldest, _ = self._kept.popitem(last=False)
            self._tokens -= len(oldest)

    def clear(self) -> None:
        self._kept.clear()
        self._tokens = 0


def _copy_cache(cache):
    """A cache with layers of its own over the same tensors: updates replace a layer's tensors (torch.cat,
    index_select), never write into them, so neither copy sees the other's."""
    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    return clone


class _Rowwise:
    """While active (in the thread that activated it): linears one row at a time, attention per row."""

    name = "runner_rowwise"
    _registered = False

    def __init__(self, model) -> None:
        self.model = model
        self.forwards: list = []  # (linear, its row-wise forward), made once by choose_linears()
        self.looped: list[str] = []  # linears multiplied one row at a time: this BLAS's bmm rounds them otherwise
        self.attention_refused = "not checked"  # why rows of one length may not share an attention call; "" if they may
        self.thread: int | None = None
        self.runs: list[tuple[int, int, int]] = []  # (first row, row after the last, keys) of one attention call
        self.layers_attended = 0  # in the current forward pass: every layer's attention must come through here
        self._views: dict = {}  # linear -> its weight and bias as the batched product takes them

    def views_of(self, module) -> tuple:
        """`module`'s weight as a (1, in, out) view and its bias as (1, 1, out) (or None), made once per storage:
        three view ops fewer per linear and decode step. forget_views() when the batcher goes idle, so a storage
        the trainer replaces is not held."""
        views = self._views.get(module)
        if views is None or views[0].data_ptr() != module.weight.data_ptr():
            views = self._views[module] = _row_views(module)
        return views

    def forget_views(self) -> None:
        self._views.clear()

    def choose_linears(self, max_rows: int) -> None:
        """Each linear's row-wise forward: one bmm over the rows where, for its weight's shape, that equals
        F.linear row by row on this machine (random inputs, 2 to max_rows rows); else a loop over the rows."""
        import torch

        exact: dict[tuple, bool] = {}
        generator = torch.Generator().manual_seed(0)  # not the global stream: the trainer's
        counts = [rows for rows in (*range(2, 9), 16, 32, 64) if rows <= max_rows]
        self.forwards, self.looped = [], []
        for name, module in self.model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            shape = (tuple(module.weight.shape), module.bias is not None, module.weight.dtype, module.weight.device)
            if shape not in exact:
                exact[shape] = _bmm_equals_rows(module, counts, generator)
            self.forwards.append((module, _rowwise_linear(module, batched=exact[shape])))
            if not exact[shape]:
                self.looped.append(name)

    def choose_attention(self) -> None:
        """Rows of one length share an attention call where this machine's SDPA allows it exactly."""
        self.attention_refused = _attention_batch_invariance(self.model)

    def register(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        if not _Rowwise._registered:
            AttentionInterface.register(self.name, _rowwise_attention)
            AttentionMaskInterface.register(self.name, sdpa_mask)
            _Rowwise._registered = True

    @contextlib.contextmanager
    def active(self, lengths: list[int]):
        model = self.model
        implementation = model.config._attn_implementation
        for module, forward in self.forwards:
            module.forward = forward
        model.config._attn_implementation = self.name
        if not self.attention_refused:
            starts = [row for row in range(len(lengths)) if row == 0 or lengths[row] != lengths[row - 1]]
            self.runs = [(start, end, lengths[start]) for start, end in zip(starts, [*starts[1:], len(lengths)])]
        else:
            self.runs = [(row, row + 1, keys) for row, keys in enumerate(lengths)]
        self.thread, self.layers_attended = threading.get_ident(), 0
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.remove(self)
            self.thread = None
            model.config._attn_implementation = implementation
            for module, _ in self.forwards:
                del module.forward


_ACTIVE: list[_Rowwise] = []


def _active_here() -> _Rowwise | None:
    me = threading.get_ident()
    return next((rows for rows in _ACTIVE if rows.thread == me), None)


def _rowwise_linear(module, *, batched: bool):
    import torch
    import torch.nn.functional as F

    def forward(x):
        rows = x.shape[0]
        active = _active_here()
        if active is None or rows == 1:  # another thread (the trainer), or nothing to split
            return F.linear(x, module.weight, module.bias)
        if batched:
            return _bmm_rows(x, *active.views_of(module))
        return torch.cat([F.linear(x[row:row + 1], module.weight, module.bias) for row in range(rows)])

    return forward


def _row_views(module) -> tuple:
    return module.weight.t().unsqueeze(0), None if module.bias is None else module.bias.view(1, 1, -1)


def _bmm_rows(x, weight, bias):
    """A linear's output for a decode step's x (one token per row), each row multiplied as a one-row matrix;
    `weight` and `bias` as _row_views gives them."""
    import torch

    rows = x.shape[0]
    flat = x.reshape(rows, 1, x.shape[-1])
    if bias is None:
        out = torch.bmm(flat, weight.expand(rows, -1, -1))
    else:
        out = torch.baddbmm(bias.expand(rows, 1, -1), flat, weight.expand(rows, -1, -1))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _bmm_equals_rows(module, counts: list[int], generator) -> bool:
    """Whether one bmm over the first n of some random rows equals F.linear row by row, for each n in counts
    (a row alone does not depend on n: its product is computed once)."""
    import torch
    import torch.nn.functional as F

    weight = module.weight
    x = torch.randn(max(counts), 1, weight.shape[1], generator=generator, dtype=weight.dtype).to(weight.device)
    alone = torch.cat([F.linear(x[row:row + 1], weight, module.bias) for row in range(len(x))])
    return all(torch.equal(_bmm_rows(x[:rows], *_row_views(module)), alone[:rows]) for rows in counts)


def _rowwise_attention(module, query, key, value, attention_mask, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = _active_here()
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows.layers_attended += 1
    total = key.shape[2]
    outputs = [sdpa_attention_forward(module, query[start:end], key[start:end, :, total - n:],
                                      value[start:end, :, total - n:], None, **kwargs)[0]
               for start, end, n in rows.runs]
    return torch.cat(outputs, 0), None


# Key counts the attention check tries: every count to 64, then each side of every multiple of 64 to 2048 (the
# CPU kernel's key and query blocks are multiples of 32, so where a batch could change the split, it is there).
ATTENTION_CHECK_KEYS = (*range(1, 65), *(keys + step for keys in range(128, 2049, 64) for step in (-1, 0, 1)))


def _attention_batch_invariance(model) -> str:
    """Empty when SDPA computes each of 2, 3, 4 or 8 equal-length rows as it computes the row alone, for every
    key count in ATTENTION_CHECK_KEYS, in the model's head layout and over views of a left-padded cache (as
    decode steps call it); else why not."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = next((m for m in model.modules() if hasattr(m, "head_dim") and hasattr(m, "scaling")
                   and hasattr(m, "num_key_value_groups")), None)
    if module is None:
        return "no attention module with head_dim, scaling and num_key_value_groups"
    heads, head_dim = model.config.num_attention_heads, module.head_dim
    kv_heads = heads // module.num_key_value_groups
    parameter = next(model.parameters())
    generator = torch.Generator().manual_seed(0)
    pad = 3

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(parameter.device, parameter.dtype)

    def attend(query, key, value):
        return sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=module.scaling)[0]

    # one draw of the largest cache, viewed at each key count (as decode steps view theirs): drawing a fresh
    # cache per count cost ~0.4 s of every sampler's start
    longest = pad + max(ATTENTION_CHECK_KEYS)
    keys_drawn, values_drawn = random(8, kv_heads, longest, head_dim), random(8, kv_heads, longest, head_dim)
    for keys in ATTENTION_CHECK_KEYS:
        query = random(8, heads, 1, head_dim)
        key, value = keys_drawn[:, :, longest - pad - keys:], values_drawn[:, :, longest - pad - keys:]
        alone = torch.cat([attend(query[row:row + 1], key[row:row + 1, :, pad:], value[row:row + 1, :, pad:])
                           for row in range(8)])
        for rows in (2, 3, 4, 8):
            if not torch.equal(attend(query[:rows], key[:rows, :, pad:], value[:rows, :, pad:]), alone[:rows]):
                return f"SDPA over {rows} rows of {keys} keys computes a row otherwise than alone"
    return ""


class BatchingSampler:
    """Samples calls on `model` (shared with the trainer), batching concurrent calls when that is exact.

    `mode` is "batched" or "one at a time"; `reason` says why when it is not batched. `stats` counts calls,
    decode steps and the rows they carried (the evidence reports them)."""

    def __init__(self, model, eos_ids: set[int], *, max_rows: int = MAX_ROWS):
        import torch

        self.model, self.eos_ids, self.max_rows = model, eos_ids, max_rows
        self.threads = CPU_THREADS if model.device.type == "cpu" else torch.get_num_threads()
        self.stats = {"calls": 0, "decode_steps": 0, "rows_decoded": 0, "max_rows": 0, "prefills_shared": 0,
                      "attention_calls": 0, "model_s": 0.0, "model_cpu_s": 0.0}  # attention_calls: per layer
        self._rowwise = _Rowwise(model)
        self._shared = _SharedPrefills(model)
        self._buffer_modules = [module for module in model.modules() if module._buffers]
        self._cache_name = _cache_keyword(model)
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # one at a time: the model is shared
        self._stats_lock = threading.Lock()
        self.mode, self.reason = "one at a time", "max_rows is 1"
        if max_rows > 1:
            with _intra_op_threads(self.threads):
                self.reason = self._check()
            self.mode = "batched" if not self.reason else "one at a time"
        self._thread = threading.Thread(target=self._run, name="policy-batcher", daemon=True)
        if self.mode == "batched":
            self._thread.start()

    def evidence(self) -> dict[str, Any]:
        steps = self.stats["decode_steps"]
        return {"mode": self.mode, **({"reason": self.reason} if self.reason else {}), **self.stats,
                "intra_op_threads": self.threads,
                **({"linears_row_by_row": self._rowwise.looped} if self._rowwise.looped else {}),
                **({"attention": f"one row at a time: {self._rowwise.attention_refused}"
                    if self._rowwise.attention_refused else "rows of one length together"}
                   if self.mode == "batched" else {}),
                "model_s": round(self.stats["model_s"], 3), "model_cpu_s": round(self.stats["model_cpu_s"], 3),
                "mean_rows": round(self.stats["rows_decoded"] / steps, 2) if steps else 0.0,
                "mean_rows_per_attention_call": (round(self.stats["rows_decoded"] / self.stats["attention_calls"], 2)
                                                 if self.stats["attention_calls"] else 0.0)}

    def sample(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
               seed: int, greedy: bool) -> tuple[list[int], list[float], str]:
        """(sampled ids, their logprobs under the processed distribution, finish reason "stop" or "length")."""
        call = _Call(prompt_ids, max_new_tokens, temperature, top_p, top_k, greedy or temperature <= 0, seed,
                     self.eos_ids)
        with self._stats_lock:
            self.stats["calls"] += 1
        if max_new_tokens <= 0:
            call.end("length")
        elif self.mode == "batched":
            self._queue.put(call)
            call.done.wait()
        else:
            with self._lock, _intra_op_threads(self.threads), self._inference():
                started, cpu = time.monotonic(), time.thread_time()
                self._alone(call)
                self.stats["model_s"] += time.monotonic() - started
                self.stats["model_cpu_s"] += time.thread_time() - cpu
        if call.error is not None:
            raise call.error
        return call.ids, call.logprobs, call.finish or "length"

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)

    # --- one at a time: the reference every batched call equals ------------------------------------------

    def _alone(self, call: _Call) -> None:
        import torch

        logits, cache = self._prefill(call)
        while not sample([call], logits.unsqueeze(0))[0]:
            output, cache = self._forward(torch.tensor([[call.ids[-1]]], device=self.model.device), cache)
            logits = output.logits[0, -1]

    @contextlib.contextmanager
    def _inference(self):
        """The model in eval mode under torch.inference_mode (on the tiny policy ~10% less CPU a decode step than
        no_grad, with the same kernels), then in the trainer's mode again. A buffer the forward pass replaced
        meanwhile (a dynamic rotary embedding's inv_freq) would be an inference tensor, which the trainer's
        autograd refuses: it becomes an ordinary one."""
        import torch

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            for module in self._buffer_modules:
                for name, buffer in module._buffers.items():
                    if buffer is not None and buffer.is_inference():
                        module._buffers[name] = buffer.clone()  # outside inference mode: an ordinary tensor
            self.model.train(was_training)

    # --- batched -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        waiting: list[_Call] = []
        active: list[_Call] = []
        cache = None
        while True:
            if not active and not waiting:
                self._shared.clear()
                self._rowwise.forget_views()
                waiting.append(self._queue.get())
            with contextlib.suppress(queue.Empty):
                while True:
                    waiting.append(self._queue.get_nowait())
            if None in waiting:  # closed: nothing is left unanswered
                for call in active + waiting:
                    if call is not None:
                        call.end(None, RuntimeError("the policy server closed during the call"))
                        call.done.set()
                return
            started, cpu = time.monotonic(), time.thread_time()
            touched = list(active)
            with _intra_op_threads(self.threads), self._inference():
                admitted = []
                if waiting:
                    self._shared.check_weights()
                while waiting and len(active) + len(admitted) < self.max_rows:
                    call = waiting.pop(0)
                    touched.append(call)
                    try:
                        admitted.append((call, *self._prefilled(call)))
                    except Exception as error:  # noqa: BLE001 - answered to the caller, who reports it
                        call.end(None, error)
                if admitted:
                    try:
                        admitted = self._first_tokens(admitted)
                    except Exception as error:  # noqa: BLE001 - non-finite logits: answered to the callers
                        for call, _, _ in admitted:
                            call.end(None, error)
                        admitted = []
                if admitted:
                    cache = _join(cache, [prefilled for _, _, prefilled in admitted])
                    active.extend(call for call, _, _ in admitted)
                if active:
                    try:
                        cache = self._step(active, cache)
                    except Exception as error:  # noqa: BLE001
                        for call in active:
                            call.end(None, error)
                        active, cache = [], None
            self.stats["model_s"] += time.monotonic() - started
            self.stats["model_cpu_s"] += time.thread_time() - cpu
            for call in touched:  # answered once the model is back in the trainer's mode
                if call.ended:
                    call.done.set()

    def _prefilled(self, call: _Call) -> tuple:
        """(last-position logits, KV cache) of `call`'s prompt: prefilled alone, or a copy of the same prompt's
        recent prefill."""
        prompt = tuple(call.prompt_ids)
        shared = self._shared.get(prompt)
        if shared is not None:
            call.length = len(prompt)
            self.stats["prefills_shared"] += 1
            return shared
        logits, cache = self._prefill(call)
        self._shared.put(prompt, logits, cache)
        return logits, cache

    @staticmethod
    def _first_tokens(admitted: list[tuple]) -> list[tuple]:
        """Samples each admitted call's first token; the calls that go on, equal prompt lengths next to each
        other (rows of one length share attention)."""
        import torch

        finished = sample([call for call, _, _ in admitted], torch.stack([logits for _, logits, _ in admitted]))
        going_on = [entry for entry, done in zip(admitted, finished) if not done]
        return sorted(going_on, key=lambda entry: entry[0].length)

    def _prefill(self, call: _Call):
        """(the prompt's last-position logits, its KV cache)."""
        import torch

        call.length = len(call.prompt_ids)
        output, cache = self._forward(torch.tensor([call.prompt_ids], device=self.model.device))
        return output.logits[0, -1].clone(), cache

    def _forward(self, input_ids, cache=None, **inputs) -> tuple:
        """(the model's output for `input_ids` after `cache`, the cache that now includes them)."""
        output = self.model(input_ids=input_ids, use_cache=True, **inputs, **{self._cache_name: cache})
        return output, getattr(output, self._cache_name)

    def _decode(self, calls: list[_Call], tokens: list[int], cache):
        """One forward pass over `tokens`, each the next token of its call, row-wise: (its output, the cache)."""
        import torch

        device = self.model.device
        positions = torch.tensor([[call.length] for call in calls], device=device)
        with self._rowwise.active([call.length + 1 for call in calls]):
            output, cache = self._forward(torch.tensor([[t] for t in tokens], device=device), cache,
                                          position_ids=positions)
            if self._rowwise.layers_attended != self.model.config.num_hidden_layers:
                raise RuntimeError(f"the model's attention did not go through the attention interface "
                                   f"({self._rowwise.layers_attended} of {self.model.config.num_hidden_layers} layers)")
        for call in calls:
            call.length += 1
        return output, cache

    def _step(self, active: list[_Call], cache):
        """One decode step over every active call; finished calls leave the batch."""
        import torch

        output, cache = self._decode(active, [call.ids[-1] for call in active], cache)
        with self._stats_lock:
            self.stats["decode_steps"] += 1
            self.stats["rows_decoded"] += len(active)
            self.stats["attention_calls"] += len(self._rowwise.runs)
            self.stats["max_rows"] = max(self.stats["max_rows"], len(active))
        done = sample(active, output.logits[:, -1])
        if not any(done):
            return cache
        keep = [row for row, finished in enumerate(done) if not finished]
        active[:] = [active[row] for row in keep]
        if not keep:
            return None
        width = max(call.length for call in active)
        index = torch.tensor(keep, device=self.model.device)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, -width:]
            layer.values = layer.values.index_select(0, index)[:, :, -width:]
        return cache

    # --- the invariance check ----------------------------------------------------------------------------

    def _check(self) -> str:
        """Empty when batched decoding gives this model's one-at-a-time logits bit for bit; else why not."""
        try:
            return self._compare_batched_with_alone()
        except Exception as error:  # noqa: BLE001 - a model the check cannot run on is sampled one at a time
            return f"the batching check failed on this model: {type(error).__name__}: {error}"

    def _compare_batched_with_alone(self) -> str:
        import torch

        try:
            from transformers.cache_utils import DynamicLayer
        except ImportError as error:
            return f"transformers without DynamicLayer ({error})"
        if self.model.config._attn_implementation != "sdpa":
            return f"attention implementation {self.model.config._attn_implementation!r} (batching needs 'sdpa')"
        self._rowwise.register()
        with self._inference():
            self._rowwise.choose_linears(self.max_rows)
            self._rowwise.choose_attention()
            compared, refused = self.check_logits()
        if refused:
            return refused
        for batched, alone in compared:
            if not torch.equal(batched, alone):
                difference = max(float((b - a).abs().max()) for b, a in compared)
                return f"batched logits differ from one-at-a-time ones by up to {difference:.3g}"
        return _sampling_batch_invariance(self.model.config.vocab_size)

    def check_logits(self) -> tuple[list[tuple], str]:
        """([(a row's logits in a batched decode step, the same call's decoded alone)] for three calls, two of
        one length, over three steps; "") or ([], why this model's cache cannot be batched). In inference mode."""
        import torch
        from transformers.cache_utils import DynamicLayer

        vocab = self.model.config.vocab_size
        calls = [_Call([(7 * i + 3) % vocab for i in range(9)], 4, 1.0, 1.0, 0, True, 0, set()),
                 _Call([(13 * i + 1) % vocab for i in range(9)], 4, 1.0, 1.0, 0, True, 0, set()),
                 _Call([(11 * i + 5) % vocab for i in range(5)], 4, 1.0, 1.0, 0, True, 0, set())]
        steps = 3
        alone = []
        for call in calls:
            _, cache = self._prefill(call)
            logits = []
            for step in range(steps):
                output, cache = self._forward(torch.tensor([[call.prompt_ids[step]]], device=self.model.device),
                                              cache)
                logits.append(output.logits[0, -1])
            alone.append(logits)
        prefilled = [self._prefill(call)[1] for call in calls]
        if not all(type(layer) is DynamicLayer for cache in prefilled for layer in cache.layers):
            return [], "the model's KV cache is not a plain DynamicCache (sliding window or static)"
        cache, compared = _join(None, prefilled), []
        for step in range(steps):
            output, cache = self._decode(calls, [call.prompt_ids[step] for call in calls], cache)
            compared += [(output.logits[row, -1], alone[row][step]) for row in range(len(calls))]
        return compared, ""


# (temperature, top_p, top_k, greedy) of the rows the sampling checks draw for, each for a call of its own seed
SAMPLING_CHECK_ROWS = ((1.0, 1.0, 0, True), (1.0, 1.0, 0, False), (1.0, 1.0, 0, False), (0.7, 1.0, 0, False),
                       (1.3, 1.0, 20, False), (0.9, 0.8, 0, False), (1.0, 0.95, 50, False))


def sampling_check_calls() -> list[_Call]:
    """Calls that never finish, one per SAMPLING_CHECK_ROWS entry, seeded by their row."""
    return [_Call([0], 1 << 30, temperature, top_p, top_k, greedy, row, set())
            for row, (temperature, top_p, top_k, greedy) in enumerate(SAMPLING_CHECK_ROWS)]


def sampling_differences(vocab: int, steps: int, reference: Callable) -> tuple[int, int]:
    """(rows compared, rows whose token or logprob differ): `steps` batches of random logits, one row per
    SAMPLING_CHECK_ROWS entry, sampled together by `sample`, each row against `reference(row, its logits as a
    [1, vocab] tensor)` -> (token, logprob as recorded)."""
    import torch

    generator = torch.Generator().manual_seed(vocab)
    calls = sampling_check_calls()
    compared = differing = 0
    for _ in range(steps):
        logits = torch.randn(len(calls), vocab, generator=generator) * 4
        sample(calls, logits)
        for row, call in enumerate(calls):
            compared += 1
            differing += (call.ids[-1], call.logprobs[-1]) != reference(row, logits[row:row + 1])
    return compared, differing


def _sampling_batch_invariance(vocab: int) -> str:
    """Empty when `sample` draws each row of a batch (greedy, temperature, top-k and top-p rows mixed) as it
    draws the row alone; else why not."""
    alone = sampling_check_calls()

    def one(row: int, logits) -> tuple[int, float]:
        sample([alone[row]], logits)
        return alone[row].ids[-1], alone[row].logprobs[-1]

    if sampling_differences(vocab, 4, one)[1]:
        return "rows sampled together draw otherwise than each row alone"
    return ""


def _cache_keyword(model) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.24 (where `past_key_values` logs a
    deprecation per process and goes in 5.40), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _join(cache, added: list):
    """The batch's cache (None when empty) with each of `added` (prefilled caches, one call each) as further
    rows, all left-padded to the longest: one copy of the batch per admission round, not one per call."""
    import torch

    base = added[0] if cache is None else cache
    rows = added[1:] if cache is None else added
    if not rows:
        return base
    width = max(c.layers[0].keys.shape[2] for c in [base, *rows])
    for index, layer in enumerate(base.layers):
        layer.keys = torch.cat([_left_pad(layer.keys, width)] + [_left_pad(c.layers[index].keys, width) for c in rows])
        layer.values = torch.cat([_left_pad(layer.values, width)]
                                 + [_left_pad(c.layers[index].values, width) for c in rows])
    return base


def _left_pad(tensor, width: int):
    import torch.nn.functional as F

    return tensor if tensor.shape[2] == width else F.pad(tensor, (0, 0, width - tensor.shape[2], 0))
