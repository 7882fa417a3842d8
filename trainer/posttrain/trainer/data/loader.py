"""The ``DataLoader``: this host's share of each global batch, streamed on Grain, and its
position (``get_state``/``set_state``) that checkpoints save.

The global order of examples is a Grain index dataset: ``MapDataset.range(n)``,
shuffled by a Feistel permutation per epoch (``.shuffle(seed)``: nothing kept per row)
and repeated forever; global position g is example ``order[g]``. Each step consumes
the next batch_size positions. Rows are read, formatted and tokenized only when a batch
needs them, in Grain's prefetch threads.

Unpacked rows: host p of P takes positions [g + p*b, g + (p+1)*b) of the step starting
at g (b = batch_size / P), so it reads only its own rows. The position is one number,
global examples consumed; it means the same thing on any number of hosts.

Packed rows (``packing=True``): the global order is cut into windows of ``window``
examples; windows are dealt to hosts round-robin (host p packs windows p, p+P, ...),
each host tokenizes and best-fit packs only its own windows (``pack_examples``) and
emits b rows a step. A host's position is its queue of windows (with the rows of a
partly used window already emitted); ``get_state`` gathers every host's queue (a small
all-gather, at checkpoints only). Resuming on the same host count continues each host
exactly; on another count the unfinished windows are dealt anew, so no example is
repeated or skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from posttrain.api.batching import batch_split_error
from posttrain.trainer.data.errors import DataError
from posttrain.trainer.data.mixing import mixed_counts, parts_of
from posttrain.trainer.data.rows import Batch, Rows, SftBatcher, build_rows, pack_examples
from posttrain.trainer.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    import grain

log = logging.getLogger(__name__)

HUGE = 1 << 62  # steps (or windows) of a stream: unbounded in practice
PACK_WINDOW = 512  # examples packed together (bounded by the dataset's size)
Gather = Callable[[Any], list[Any]]


def _allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, in process order (a collective)."""
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([len(raw)], np.int32)))
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: len(raw)] = raw
    every = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(bytes(every[i, : int(sizes[i, 0])])) for i in range(len(every))]


class DataLoader:
    """Per-host batches of a global batch, forever (see the module doc).

    Every unpacked batch carries 'row_index' int32 [b], the rows it holds (indices into
    rows.records); packed SFT batches carry 'example_rows' [b, max_length]. A batch may
    span the end of one epoch and the start of the next.
    """

    def __init__(
        self,
        rows: Rows,
        batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        gradient_accumulation: int = 1,
        *,
        packing: bool = False,
        window: int = PACK_WINDOW,
        threads: int = 2,
        prefetch: int = 2,
        gather: Gather | None = None,
        max_bad_rows: int = 0,
        max_steps: int | None = None,
    ) -> None:
        B, P = batch_size, process_count
        if not 0 <= process_index < P:
            raise ValueError(f"process_index {process_index} not in [0, {P})")
        if B < 1:
            raise DataError(f"spec.training.batchSize ({B}) must be at least 1")
        if problem := batch_split_error(B, gradient_accumulation, P):
            raise DataError(problem)
        if len(rows) < B and not packing:
            raise DataError(row_count_error(len(rows), B))
        if packing and not rows.packable:
            raise DataError("spec.data.packing: only sft and distill rows of text are packed")
        self.rows = rows
        self.batch_size = B
        self.process_index, self.process_count = process_index, P
        self.seed, self.shuffle = seed, shuffle
        self.packing = packing
        self.window = min(window, len(rows))
        self.threads, self.prefetch = threads, prefetch
        self.gather = gather or (_allgather_json if P > 1 else (lambda v: [v]))
        self.parts, self.names, self.weights = parts_of(rows)
        self.base = [0] * len(self.parts)  # rows of each source drawn before position 0
        self.order = self._order()
        self.rows_emitted = 0
        self.real_tokens = 0
        self.max_bad_rows, self.bad_rows = max_bad_rows, 0
        self.max_steps = max_steps  # unpacked: prefetch nothing past this step
        self._it: Iterator[Any] | None = None
        self._position = 0  # unpacked: global examples consumed
        self._queue: list[list[int]] = []  # packed: windows to do first, as [w, rows done]
        self._next, self._stride = process_index, P  # packed: then windows next, next+stride

    def _order(self) -> grain.MapDataset:
        """(source, row) at each global position: every source's rows shuffled per epoch
        (seed + source) and repeated, from its base; mixed by weight."""
        import grain  # here, not at import: grain imports orbax, which sets up logging

        orders = []
        for s, part in enumerate(self.parts):
            order = grain.MapDataset.range(len(part))
            if self.shuffle:
                order = order.shuffle(seed=self.seed + s)
            order = order.repeat()
            if self.base[s]:
                order = order[self.base[s] :]
            orders.append(order.map(lambda i, s=s: (s, int(i))))
        if self.weights is None:
            return orders[0]
        return grain.MapDataset.mix(orders, self.weights)

    def source_counts(self) -> dict[str, int]:
        """Rows drawn from each source so far (all hosts; unpacked: exact)."""
        position = self._position if not self.packing else self._packed_position()
        if self.weights is None:
            counts = [position]
        else:
            counts = mixed_counts(position, self.weights)
        return {n: b + c for n, b, c in zip(self.names, self.base, counts, strict=True)}

    def _packed_position(self) -> int:
        """The start of the first window this host has not finished (packed)."""
        first = min([q[0] for q in self._queue] + [self._next])
        return first * self.window

    # ----------------------------------------------------------------- geometry

    @property
    def per_host_batch_size(self) -> int:
        return self.batch_size // self.process_count

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one pass over the rows (unpacked)."""
        return len(self.rows) // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The rows in the order of an epoch (the same on every host); for tests and
        small data of one source only: it holds one index per row."""
        n = len(self.rows)
        return np.fromiter((self.order[epoch * n + i][1] for i in range(n)), np.int64, count=n)

    def host_keys(self, position: int) -> list[tuple[int, int]]:
        """(source, row) this host takes for the (unpacked) step starting at global
        `position`."""
        b = self.per_host_batch_size
        start = position + self.process_index * b
        return [self.order[start + j] for j in range(b)]

    def read(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        """The rows of (source, row) keys, in order; each source's read in one batch."""
        out: list[Any] = [None] * len(keys)
        by_source: dict[int, list[int]] = {}
        for k, (s, _) in enumerate(keys):
            by_source.setdefault(s, []).append(k)
        for s, ks in by_source.items():
            rows = self.parts[s].records.read_many([keys[k][1] for k in ks])
            for k, row in zip(ks, rows, strict=True):
                out[k] = row
        return out

    def draw(self, key: Sequence[int]) -> Batch:
        """A host batch of rows drawn at random from the whole dataset (a mixture: by
        weight), seeded by `key` and the host, apart from the epoch's order: the extra
        prompts of DAPO's dynamic sampling. Random access by index: a function of `key`
        alone, so a resumed run draws what the first run drew; the position is unchanged."""
        rng = np.random.default_rng([*key, self.process_index])
        positions = rng.integers(0, len(self.rows), self.per_host_batch_size)
        keys = [self.order[int(p)] for p in positions]
        errors: list[DataError] = []
        batch = self._batch(self._read_guarded(keys, errors), errors)
        self._skip(errors)
        batch["row_index"] = np.asarray([i for _, i in keys], dtype=np.int32)
        return batch

    # ------------------------------------------------------------------ batches

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.packing:
            return self._next_packed()
        if self._it is None:
            self._it = self._stream(self._position)
        try:
            batch, errors = next(self._it)
        except StopIteration:  # past max_steps (a resume with another batch size): go on
            self._it = self._stream(self._position, bounded=False)
            batch, errors = next(self._it)
        self._skip(errors)
        self._position += self.batch_size
        self.rows_emitted += len(batch["row_index"])
        self.real_tokens += int((batch["segment_ids"] > 0).sum()) if "segment_ids" in batch else 0
        return batch

    def take(self, steps: int) -> Iterator[Batch]:
        """The next `steps` batches."""
        for _ in range(steps):
            yield next(self)

    def _read_options(self) -> grain.ReadOptions:
        import grain

        return grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.prefetch)

    def _stream(
        self, position: int, bounded: bool = True
    ) -> Iterator[tuple[Batch, list[DataError]]]:
        import grain

        B = self.batch_size
        stop = HUGE
        if bounded and self.max_steps is not None:
            stop = max(0, self.max_steps - position // B)
        steps = grain.MapDataset.range(0, stop).map(lambda s: self._host_batch(position + s * B))
        if self.threads == 0:
            return (steps[s] for s in range(stop))
        return iter(steps.to_iter_dataset(self._read_options()))

    # ---------------------------------------------------------------- bad rows

    # Prefetching threads only collect a batch's malformed rows; they are counted here,
    # as the batch is taken, so the row that goes over the limit is the same every run
    # and rows of batches never taken are not counted.

    def _skip(self, errors: list[DataError]) -> None:
        """Count a batch's malformed rows, in order; DataError at the first one past
        max_bad_rows."""
        for error in errors:
            self.bad_rows += 1
            if self.bad_rows > self.max_bad_rows:
                raise DataError(
                    f"{error} ({self.bad_rows} malformed rows, more than spec.data.maxBadRows="
                    f"{self.max_bad_rows})"
                ) from None
            log.warning(
                "%s; skipped (%d of spec.data.maxBadRows=%d)",
                error,
                self.bad_rows,
                self.max_bad_rows,
            )

    def _read_guarded(self, keys: Sequence[tuple[int, int]], errors: list[DataError]) -> list[Any]:
        """read(keys), with None for the rows that cannot be read (added to errors)."""
        try:
            return self.read(keys)
        except DataError:
            if not self.max_bad_rows:
                raise
        out = []
        for key in keys:
            try:
                out.extend(self.read([key]))
            except DataError as e:
                errors.append(e)
                out.append(None)
        return out

    def _usable(
        self, rows: list[Any], fn: Callable[[list[Any]], Any], errors: list[DataError]
    ) -> list[Any]:
        """rows with None for each that `fn` refuses alone (added to errors)."""
        out = []
        for row in rows:
            if row is not None:
                try:
                    fn([row])
                except DataError as e:
                    errors.append(e)
                    row = None
            out.append(row)
        return out

    def _batch(self, rows: list[Any], errors: list[DataError], **kw: Any) -> Batch:
        """The batcher's batch of rows; a malformed row (with spec.data.maxBadRows) is a
        row of padding for sft, a copy of the batch's first good row otherwise."""
        batcher = self.rows.batcher
        for attempt in range(2):
            if None in rows and not getattr(batcher, "pads_missing_rows", False):
                good = next((r for r in rows if r is not None), None)
                if good is None:
                    raise DataError("every row of a batch is malformed (spec.data.maxBadRows)")
                rows = [r if r is not None else good for r in rows]
            try:
                return batcher.batch(rows, **kw)
            except DataError:
                if not self.max_bad_rows or attempt:
                    raise
            rows = self._usable(rows, lambda rs: batcher.batch(rs, **kw), errors)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ batches

    def _host_batch(self, position: int) -> tuple[Batch, list[DataError]]:
        keys = self.host_keys(position)
        errors: list[DataError] = []
        rows = self._read_guarded(keys, errors)
        batcher = self.rows.batcher
        if hasattr(batcher, "image_count"):  # every host pads to the step's most images
            B = self.batch_size
            counts = []
            for j in range(B):  # other hosts' rows too (their bad rows are theirs to count)
                try:
                    counts.append(batcher.image_count(self.read([self.order[position + j]])[0]))
                except DataError:
                    continue
            batch = self._batch(rows, errors, max_images=max([*counts, 1]))
        else:
            batch = self._batch(rows, errors)
        batch["row_index"] = np.asarray([i for _, i in keys], dtype=np.int32)
        if self.weights is not None:
            batch["source_index"] = np.asarray([s for s, _ in keys], dtype=np.int32)
        return batch, errors

    # ------------------------------------------------------------------ packing

    def window_rows(self, w: int, errors: list[DataError] | None = None) -> list[list[Any]]:
        """Window w packed: its examples' rows, best fit, in order of first example;
        its malformed rows (with spec.data.maxBadRows) are added to `errors`."""
        W = self.window
        errors = [] if errors is None else errors
        rows = self._read_guarded([self.order[w * W + j] for j in range(W)], errors)
        batcher: SftBatcher = self.rows.batcher
        try:
            examples = batcher.tokenize([r for r in rows if r is not None])
        except DataError:
            if not self.max_bad_rows:
                raise
            rows = self._usable(rows, batcher.tokenize, errors)
            examples = batcher.tokenize([r for r in rows if r is not None])
        examples = [e for e in examples if e is not None]
        packed = pack_examples([len(e) for e in examples], batcher.max_length)
        return [[examples[k] for k in members] for members in packed]

    def _windows(self) -> Iterator[tuple[int, int, list[list[Any]], list[DataError]]]:
        """(window, rows to skip, packed rows, malformed rows) of this host's windows,
        in order, prefetched by Grain."""
        queue, start, stride = list(self._queue), self._next, self._stride

        def window_of(k: int) -> tuple[int, int]:
            if k < len(queue):
                return queue[k][0], queue[k][1]
            return start + (k - len(queue)) * stride, 0

        import grain

        def window(k: int) -> tuple[int, int, list[list[Any]], list[DataError]]:
            w, skip = window_of(k)
            errors: list[DataError] = []
            return w, skip, self.window_rows(w, errors), errors

        windows = grain.MapDataset.range(0, HUGE).map(window)
        if self.threads == 0:
            return (windows[k] for k in range(HUGE))
        return iter(windows.to_iter_dataset(self._read_options()))

    def _next_packed(self) -> Batch:
        if self._it is None:
            self._it = self._packed_rows()
        members = [next(self._it) for _ in range(self.per_host_batch_size)]
        batcher: SftBatcher = self.rows.batcher
        batch = batcher.packed(members)
        self.rows_emitted += len(members)
        self.real_tokens += sum(len(e) for row in members for e in row)
        return batch

    def _packed_rows(self) -> Iterator[list[Any]]:
        """This host's packed rows; keeps _queue/_next at the row about to be emitted."""
        for w, skip, packed, errors in self._windows():
            self._skip(errors)
            # the window now being emitted heads the queue
            if self._queue and self._queue[0][0] == w:
                self._queue.pop(0)
            else:
                self._next = w + self._stride
            self._queue.insert(0, [w, skip])
            for r in range(skip, len(packed)):
                self._queue[0][1] = r
                yield packed[r]
            self._queue.pop(0)

    # -------------------------------------------------------------------- state

    def host_state(self) -> dict[str, Any]:
        """This host's packing position (its window queue)."""
        queue = [list(q) for q in self._queue]
        if queue and self._it is not None:
            queue[0][1] += 1  # the head's row r has been emitted once it is yielded
        return {"queue": queue, "next": self._next, "stride": self._stride}

    def get_state(self) -> dict[str, Any]:
        """The position of the next batch (JSON; the same on every host). Packed: an
        all-gather of every host's window queue (every host must call it)."""
        state: dict[str, Any] = {"num_rows": len(self.rows), "batch_size": self.batch_size}
        if self.weights is not None:
            state["mixture"] = {"names": self.names, "weights": self.weights, "base": self.base}
        if not self.packing:
            return {**state, "position": self._position}
        hosts = self.gather(self.host_state())
        return {**state, "packing": {"window": self.window, "hosts": hosts}}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a position returned by get_state() (on any host, any count)."""
        try:
            rows_then = state.get("num_rows")
            if "epoch" in state:  # written before streaming: epoch and index
                position = int(state["epoch"]) * int(rows_then) + int(state["index"])
            elif "position" in state:
                position = int(state["position"])
            else:
                position = None
                packing = state["packing"]
                window, hosts = int(packing["window"]), list(packing["hosts"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a data loader state: {state!r}") from e
        if "mixture" in state or self.weights is not None:
            position = self._continue_mixture(state, position, hosts if position is None else None)
        elif rows_then is not None and int(rows_then) != len(self.rows):
            log.warning(
                "the data has %d rows but the checkpoint was taken with %d: the data "
                "changed, so training cannot resume at the same examples",
                len(self.rows),
                rows_then,
            )
        self.close()
        if position is not None:
            if position < 0:
                raise ValueError(f"not a data loader state: {state!r}")
            if self.packing:  # from unpacked to packed: start at the next whole window
                self._queue, self._next = [], -(-position // self.window) + self.process_index
                self._stride = self.process_count
            else:
                self._position = position
            return
        if not self.packing:
            log.warning("the checkpoint was packed, this run is not: the data restarts")
            self._position = 0
            return
        if window != self.window:
            log.warning("packing window changed (%d -> %d): the data restarts", window, self.window)
            return
        self._queue, self._next, self._stride = _deal(hosts, self.process_index, self.process_count)

    def _continue_mixture(
        self, state: Mapping[str, Any], position: int | None, hosts: list | None
    ) -> int | None:
        """Take a mixture's per-source position from `state`; returns the global position
        to continue from (None: the packed hosts' queues stand as saved). With other
        weights or sources, every source continues from the rows it had drawn."""
        mixture = state.get("mixture") or {"names": ["data"], "weights": [1.0], "base": [0]}
        names, weights = list(mixture["names"]), [float(w) for w in mixture["weights"]]
        if names == self.names and weights == (self.weights or [1.0]):
            self.base = [int(b) for b in mixture["base"]]
            self.order = self._order()
            return position
        if position is None:  # packed: from the first window any host left unfinished
            first = min(min([q[0] for q in h["queue"]] + [h["next"]]) for h in hosts)
            position = first * int(state["packing"]["window"])
            log.warning("the mixture changed while packing: rows of partly used windows may repeat")
        drawn = dict(zip(names, mixture["base"], strict=True))
        for name, count in zip(names, mixed_counts(position, weights), strict=True):
            drawn[name] = int(drawn[name]) + count
        log.info("mixture changed %s -> %s: continuing every source", weights, self.weights)
        self.base = [int(drawn.get(name, 0)) for name in self.names]
        self.order = self._order()
        return 0

    def close(self) -> None:
        """Stop prefetching; the next batch asked for starts the stream again at the
        loader's position."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        self._it = None

    def metrics(self) -> dict[str, float]:
        """Numbers for TensorBoard: fill_ratio (share of row tokens that are real), and
        rows drawn from each source of a mixture (source/<name>)."""
        out: dict[str, float] = {}
        if self.rows_emitted and isinstance(self.rows.batcher, SftBatcher):
            length = self.rows.batcher.max_length
            out["fill_ratio"] = self.real_tokens / (self.rows_emitted * length)
        if self.weights is not None:
            out.update({f"source/{k}": float(v) for k, v in self.source_counts().items()})
        if self.max_bad_rows:
            out["bad_rows"] = float(self.bad_rows)
        return out


def _deal(hosts: Sequence[Mapping[str, Any]], p: int, count: int) -> tuple[list, int, int]:
    """Host p's (queue, next, stride) of `count` hosts continuing `hosts`' packing
    positions: the same host's own when the count is unchanged, else every unfinished
    window (queues, and progression windows below the frontier) dealt round-robin, then
    the windows from the frontier on."""
    if len(hosts) == count:
        h = hosts[p]
        return [list(q) for q in h["queue"]], int(h["next"]), int(h["stride"])
    frontier = max(int(h["next"]) for h in hosts)
    pending: list[list[int]] = []
    for h in hosts:
        pending.extend(list(q) for q in h["queue"])
        pending.extend([w, 0] for w in range(int(h["next"]), frontier, int(h["stride"])))
    pending.sort()
    return pending[p::count], frontier + p, count


def row_count_error(rows: int, batch_size: int) -> str:
    """Why `rows` rows cannot fill a step of `batch_size` (unpacked)."""
    return (
        f"the dataset has {rows} rows, fewer than spec.training.batchSize "
        f"({batch_size}); use more data or a smaller batchSize"
    )


def build_loader(
    spec: Any,
    tokenizer: Tokenizer,
    *,
    process_index: int = 0,
    process_count: int = 1,
    rows: Rows | None = None,
    gather: Gather | None = None,
) -> DataLoader:
    """A DataLoader for a PostTrainJobSpec on host process_index of process_count."""
    rows = rows if rows is not None else build_rows(spec, tokenizer)
    return DataLoader(
        rows,
        batch_size=spec.training.batch_size,
        process_index=process_index,
        process_count=process_count,
        seed=spec.training.seed,
        shuffle=spec.data.shuffle,
        gradient_accumulation=spec.training.gradient_accumulation,
        packing=spec.data.packing and rows.packable,
        gather=gather,
        max_bad_rows=spec.data.max_bad_rows,
        max_steps=spec.training.steps,
    )
