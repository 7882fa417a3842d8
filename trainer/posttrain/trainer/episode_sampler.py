"""Sampling the turns of a batch of episodes with one KV cache kept across their turns.

An episode's context only grows: the prompt, the model's turn, the tool message, the next
turn. Tunix's sampler starts every call from an empty cache, so each turn would prefill
the whole context again. ``EpisodeSampler`` keeps the keys and values of what each row
has already been through and prefills only what came since (the tool message, and the
end of the last turn when it was never fed back), then decodes the turn in one compiled
loop that stops when every row has ended.

The cache is one block of slots shared by the rows, written at a common index (Tunix's
``end_index``); which slots hold a row's tokens is kept per row (``valid``), and the
attention mask lets each row see only its own. Before a turn, each row's slots are
gathered to the end of the cached region (so the space past it is free), the new tokens
are prefilled left-padded in one block after it, and the turn decodes after that. A
context that does not continue what the row has cached starts that row over; a turn that
would not fit the cache starts every row over from its whole context, and so does every
turn of a model whose sliding window (Gemma) is shorter than the cache.

Tokens are sampled from softmax(logits / temperature) (greedy without a temperature),
keyed by (the turn's key, step), so the same key gives the same turn.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.capacity import EPISODE_PREFILL_BLOCK
from posttrain.trainer import models
from posttrain.trainer.models.generation import beside_params, on_host

# Prefill widths are multiples of this, so the prefill compiles a few times (the episode's
# cache holds one block's padding: capacity.rollout_cache_length).
BLOCK = EPISODE_PREFILL_BLOCK


class EpisodeSampler:
    """The turns of `rows` episodes on `model`, in a cache of `cache_size` slots.

    One per batch of episodes (the cache holds keys and values of the weights it was
    filled with): ``turn`` takes each row's whole context (None: the row has ended) and
    returns the tokens it wrote, its EOS included when it wrote one, at most
    `turn_length`."""

    def __init__(
        self,
        model: Any,
        rows: int,
        cache_size: int,
        turn_length: int,
        *,
        eos: int,
        pad: int,
        temperature: float | None,
    ):
        self.size, self.turn_length = int(cache_size), int(turn_length)
        # The module's graph walked once, not at every call (nnx.jit's walk of a 30-layer
        # model costs about 0.2 s a call on CPU).
        self._prefill_step = nnx.cached_partial(models.next_logits, model)
        self._decode = nnx.cached_partial(_decode, model)
        self.eos, self.pad = int(eos), int(pad)
        self.temperature = temperature  # None: greedy
        self.put = beside_params(model)
        self.cache = self.put(models.init_cache(model, rows, self.size))
        self.cached: list[list[int]] = [[] for _ in range(rows)]  # ids in the cache, in order
        self.valid = np.zeros((rows, self.size), bool)  # the slots that hold them
        self.prefilled = 0  # tokens prefilled (padding included), for tests and benches
        # Sliding-window layers (Gemma) measure their window in cache slots, between which
        # a kept cache leaves gaps: rows keep their cache across turns only where the
        # window spans the whole cache, and otherwise start over every turn.
        window = getattr(model.config, "sliding_window_size", None)
        self.keeps = window is None or self.size <= window

    def turn(self, contexts: Sequence[Sequence[int] | None], key: Any) -> list[list[int]]:
        rows = len(self.cached)
        if len(contexts) != rows:
            raise ValueError(f"{len(contexts)} contexts for a sampler of {rows} rows")
        contexts = [None if c is None else [int(t) for t in c] for c in contexts]
        for b, context in enumerate(contexts):
            have = self.cached[b]
            if (
                not self.keeps
                or context is None  # ended
                or len(context) <= len(have)
                or context[: len(have)] != have  # not a continuation
            ):
                self._forget(b)
        new = [[] if c is None else c[len(self.cached[b]) :] for b, c in enumerate(contexts)]
        end = max(len(c) for c in self.cached)
        width = self._width(max(len(n) for n in new))
        if end + width + self.turn_length > self.size:
            for b in range(rows):  # no room after what is cached: start over
                self._forget(b)
            new = [c or [] for c in contexts]
            end, width = 0, self._width(max(len(n) for n in new))
            if width + self.turn_length > self.size:
                raise ValueError(
                    f"a context of {max(len(n) for n in new)} tokens and a turn of "
                    f"{self.turn_length} do not fit a cache of {self.size}"
                )
        self._compact(end)
        logits = self._prefill(new, end, width)
        done = np.asarray([c is None for c in contexts])
        positions = np.asarray([len(c) for c in self.cached], np.int32)
        tokens, lengths, fed, valid, self.cache = self._decode(
            logits,
            self.cache,
            *self.put((self.valid, positions, done, np.asarray(key))),
            np.float32(self.temperature or 0.0),  # 0: greedy (one program for both)
            steps=self.turn_length,
            eos=self.eos,
            pad=self.pad,
        )
        tokens, lengths, fed = on_host(tokens), on_host(lengths), on_host(fed)
        self.valid = np.array(on_host(valid))
        written = []
        for b in range(rows):
            row = tokens[b, : lengths[b]].tolist()
            self.cached[b] += row[: fed[b]]
            written.append(row)
        return written

    def _width(self, longest: int) -> int:
        """The prefill block's width: `longest` rounded up to BLOCK, within the cache."""
        return max(longest, min(-(-longest // BLOCK) * BLOCK, self.size - self.turn_length))

    def _forget(self, b: int) -> None:
        self.cached[b] = []
        self.valid[b] = False

    def _compact(self, end: int) -> None:
        """Gather each row's cached slots to end at slot `end`, in order."""
        index = np.zeros(self.valid.shape, np.int32)
        for b, ids in enumerate(self.cached):
            if ids:
                index[b, end - len(ids) : end] = np.flatnonzero(self.valid[b])
        self.valid[:] = False
        for b, ids in enumerate(self.cached):
            self.valid[b, end - len(ids) : end] = True
        self.cache = _gather_slots(self.cache, *self.put((index, np.int32(end))))

    def _prefill(self, new: list[list[int]], end: int, width: int) -> jax.Array:
        """Prefill each row's new tokens, left-padded, in slots [end, end + width): each
        sees its own cached slots and its new tokens up to itself. The last position's
        logits, for the first token of the turn. Rows with the same cache and new tokens
        (a GRPO group's first turn: one prompt, numGenerations rows) are prefilled once,
        and the others get a copy of that row's cache."""
        rows = len(new)
        tokens = np.full((rows, width), self.pad, np.int32)
        positions = np.zeros((rows, width), np.int32)
        start = np.empty(rows, np.int64)
        for b, ids in enumerate(new):
            start[b] = end + width - len(ids)
            if ids:
                tokens[b, width - len(ids) :] = ids
                positions[b, width - len(ids) :] = len(self.cached[b]) + np.arange(len(ids))
        slot = np.arange(self.size)
        query = end + np.arange(width)
        block = (slot[None, None, :] >= start[:, None, None]) & (
            slot[None, None, :] <= query[None, :, None]
        )
        mask = self.valid[:, None, :] | block
        first: dict[tuple, int] = {}
        same = [first.setdefault((tuple(self.cached[b]), tuple(new[b])), b) for b in range(rows)]
        unique = sorted(first.values())
        if len(unique) < rows:  # prefill the unique rows, then copy each to its likes
            back = self.put(np.asarray([unique.index(b) for b in same], np.int32))
            unique = np.asarray(unique)
            cache = _take_rows(self.cache, self.put(unique))
            tokens, positions, mask = tokens[unique], positions[unique], mask[unique]
        else:
            back, cache = None, self.cache
        logits, cache = self._prefill_step(*self.put((tokens, positions)), cache, self.put(mask))
        if back is not None:
            logits, cache = _take_rows((logits, cache), back)
        self.cache = cache
        for b, ids in enumerate(new):
            self.valid[b, start[b] : end + width] = True
            self.cached[b] += ids
        self.prefilled += len(unique) * width
        return logits


@jax.jit
def _take_rows(tree: Any, index: jax.Array) -> Any:
    """The rows `index` of every array in `tree` (the batch is each one's first axis)."""
    return jax.tree.map(lambda x: x[index], tree)


@jax.jit
def _gather_slots(cache: dict, index: jax.Array, end: jax.Array) -> dict:
    def gather(layer: dict) -> dict:
        def take(x: jax.Array) -> jax.Array:
            return jnp.take_along_axis(x, index[:, :, None, None], axis=1)

        return {
            **layer,
            "k": take(layer["k"]),
            "v": take(layer["v"]),
            "end_index": jnp.full_like(layer["end_index"], end),
        }

    return {name: gather(layer) for name, layer in cache.items()}


@functools.partial(nnx.jit, static_argnames=("steps", "eos", "pad"))
def _decode(model, logits, cache, valid, positions, done, key, temperature, *, steps, eos, pad):
    """Up to `steps` tokens a row, from the prefill's `logits`: each step samples every
    row (greedy at temperature 0), then (while a row is still going and steps remain) feeds the tokens at the cache's
    next slot, marking it valid for the rows whose token was their own. Stops when every
    row has written its EOS. Returns tokens [rows, steps], each row's count, how many of
    them were fed (their keys and values are cached), the valid slots and the cache."""
    graphdef, state = nnx.split(models.compute_view(model))
    rows = logits.shape[0]

    def body(carry):
        t, logits, cache, valid, positions, done, out, lengths, fed = carry
        drawn = jax.random.categorical(
            jax.random.fold_in(key, t), logits / jnp.maximum(temperature, 1e-6)
        )
        token = jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
        own = ~done
        out = out.at[:, t].set(jnp.where(own, token, pad))
        lengths = lengths + own
        done = done | (token == eos)

        def feed(args):
            cache, valid, positions, fed = args
            slot = cache["layer_0"]["end_index"][0]
            valid = valid.at[:, slot].set(own)
            step_logits, cache = nnx.merge(graphdef, state)(
                token[:, None], positions[:, None], cache, valid[:, None, :]
            )
            return step_logits[:, -1].astype(jnp.float32), cache, valid, positions + own, fed + own

        def stop(args):
            return (logits, *args)

        going = (t + 1 < steps) & jnp.any(~done)
        logits, cache, valid, positions, fed = jax.lax.cond(
            going, feed, stop, (cache, valid, positions, fed)
        )
        return t + 1, logits, cache, valid, positions, done, out, lengths, fed

    def cond(carry):
        t, done = carry[0], carry[5]
        return (t < steps) & jnp.any(~done)

    zeros = jnp.zeros((rows,), jnp.int32)
    out = jnp.full((rows, steps), pad, jnp.int32)
    carry = (jnp.int32(0), logits, cache, valid, positions, done, out, zeros, zeros)
    carry = jax.lax.while_loop(cond, body, carry)
    _, _, cache, valid, _, _, out, lengths, fed = carry
    return out, lengths, fed, valid, cache
