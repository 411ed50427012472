"""Request traces for the simulator: loaders, time and rate scaling, seeded generators.

A ``Trace`` is a set of numpy columns, one row per request, sorted by arrival time (seconds from
the trace start). Loaders read a file line by line into compact arrays, never keeping one Python
object per row, so a multi-million-row trace costs a few tens of bytes per request.

Formats:

- **Azure LLM inference trace 2023** (Splitwise, ISCA'24): CSV with header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; wall-clock timestamps such as
  ``2023-11-16 18:17:03.9799600`` (7 fractional digits; a ``+00:00`` or ``Z`` suffix, as in the
  2024 trace, is accepted).
- **Mooncake FAST'25**: JSON lines with ``timestamp`` (milliseconds), ``input_length``,
  ``output_length`` and ``hash_ids``, one id per 512-token prompt block, equal ids meaning a
  reusable KV prefix. ``engine_block_hashes`` maps them onto the engine's block size
  (``prefix_chunks``: per trace block, as the simulator's prefix caches keep them).

Scaling: ``time_scale`` stretches or compresses inter-arrival times (same requests);
``rate_scale`` multiplies the arrival rate (thinning below 1; above 1, replaying jittered copies).
Generators: ``synthetic_trace`` (Poisson arrivals, sampled lengths) and ``DayDemand`` (a 24-hour
envelope with a peak-to-trough ratio plus bursts, sizes drawn from a trace).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np

from pdserve.common.errors import InvalidArgumentError

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""

_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """Requests as columns; row ``i`` is request ``i`` in arrival order.

    ``arrival_s``: float64[n], non-decreasing, seconds from the trace start.
    ``prompt_tokens`` / ``output_tokens``: int64[n], both >= 1.
    Prefix hashes (optional, Mooncake): request ``i`` has the ids
    ``hash_ids[hash_offsets[r]:hash_offsets[r + 1]]`` with ``r = hash_row[i]`` (-1: none), one
    per ``hash_block_tokens`` prompt tokens; ``hash_salt[i]`` separates replayed copies (0 for
    the original) so that a copy does not reuse its original's cache.
    ``tenant`` (optional): object[n] of tenant names, what the router's admission policy
    shares capacity by (None: every request is the default tenant ``""``).
    """

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_row: np.ndarray | None = None
    hash_salt: np.ndarray | None = None
    hash_offsets: np.ndarray | None = None
    hash_ids: np.ndarray | None = None
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    name: str = ""
    tenant: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if self.tenant is not None and len(self.tenant) != n:
            raise InvalidArgumentError("trace tenant must have one entry per request",
                                       field="tenant")
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise InvalidArgumentError(
                f"trace columns differ in length: {n} arrivals, {len(self.prompt_tokens)} "
                f"prompts, {len(self.output_tokens)} outputs", field="trace")
        hash_parts = (self.hash_row, self.hash_salt, self.hash_offsets, self.hash_ids)
        if any(p is None for p in hash_parts) and not all(p is None for p in hash_parts):
            raise InvalidArgumentError("trace prefix hashes need all four hash columns",
                                       field="trace")
        if self.hash_row is not None and self.hash_salt is not None and (
                len(self.hash_row) != n or len(self.hash_salt) != n):
            raise InvalidArgumentError("trace hash_row/hash_salt must have one entry per request",
                                       field="trace")
        if n and (int(self.prompt_tokens.min()) < 1 or int(self.output_tokens.min()) < 1):
            raise InvalidArgumentError("trace prompt and output lengths must be >= 1",
                                       field="trace")

    # -- shape --------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival (0 for fewer than two requests)."""
        if self.num_requests < 2:
            return 0.0
        return float(self.arrival_s[-1] - self.arrival_s[0])

    @property
    def mean_rate_per_s(self) -> float:
        duration = self.duration_s
        return (self.num_requests - 1) / duration if duration > 0 else 0.0

    @property
    def has_prefix_hashes(self) -> bool:
        return self.hash_row is not None

    def take(self, index: np.ndarray) -> Trace:
        """Rows ``index`` (ascending integer indices or a boolean mask), hash tables shared."""
        return Trace(
            self.arrival_s[index], self.prompt_tokens[index], self.output_tokens[index],
            None if self.hash_row is None else self.hash_row[index],
            None if self.hash_salt is None else self.hash_salt[index],
            self.hash_offsets, self.hash_ids, self.hash_block_tokens, self.name,
            None if self.tenant is None else self.tenant[index],
        )

    def head(self, num_requests: int) -> Trace:
        return self.take(np.arange(min(num_requests, self.num_requests)))

    def window(self, start_s: float, end_s: float) -> Trace:
        """Requests arriving in ``[start_s, end_s)``, times shifted so ``start_s`` becomes 0."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        part = self.take(np.arange(lo, hi))
        return _with_arrivals(part, part.arrival_s - start_s)

    # -- prefix hashes ------------------------------------------------------------------------

    def engine_block_hashes(self, index: int, block_size_tokens: int) -> list[int]:
        """Chained 64-bit hashes of request ``index``'s full engine blocks (empty if none).

        Each ``hash_block_tokens`` trace block ``c`` with id ``h_c`` first extends a chain
        ``H_c = mix(H_{c-1}, h_c, salt)``, so ``H_c`` names the whole prefix up to block ``c``;
        engine block ``s`` inside it gets ``mix(H_c, s)``. Two requests whose leading trace ids
        agree therefore share exactly the corresponding leading engine blocks. A partial last
        engine block is not hashed (as ``prefix_block_hashes`` does for real tokens).
        ``hash_block_tokens`` must be a multiple of ``block_size_tokens``.
        """
        chain, counts = self.prefix_chunks(index, block_size_tokens)
        if not chain:
            return []
        per_chunk = self.hash_block_tokens // block_size_tokens
        heads = np.asarray(chain, dtype=np.uint64)[:, None]
        subs = (np.arange(1, per_chunk + 1, dtype=np.uint64) * np.uint64(_GOLDEN64))[None, :]
        return _mix64_array((heads ^ subs).ravel()[:sum(counts)]).tolist()

    def prefix_chunks(self, index: int, block_size_tokens: int) -> tuple[list[int], list[int]]:
        """Request ``index``'s prompt as trace blocks: the chain hash ``H_c`` of each trace block
        holding at least one full engine block, and how many full engine blocks it holds
        (``hash_block_tokens / block_size_tokens``, fewer in the last). ``engine_block_hashes``
        expands the same chain into one hash per engine block; the simulator's prefix caches
        (``prefix_cache``) keep whole trace blocks, so a prompt costs one step per trace block
        rather than one per engine block. Both empty without hashes.
        """
        return self.prefix_chunk_batch(index, index + 1, block_size_tokens)[0]

    def prefix_chunk_batch(self, start: int, stop: int,
                           block_size_tokens: int) -> list[tuple[list[int], list[int]]]:
        """``prefix_chunks`` of requests ``start`` to ``stop - 1``, the chains computed together
        (one numpy step per trace-block position across the requests, not one Python hash per
        trace block)."""
        num = stop - start
        if self.hash_row is None:
            return [([], [])] * num
        if block_size_tokens < 1 or self.hash_block_tokens % block_size_tokens:
            raise InvalidArgumentError(
                f"block_size_tokens {block_size_tokens} must divide the trace's hash block of "
                f"{self.hash_block_tokens} tokens", field="block_size_tokens")
        assert (self.hash_offsets is not None and self.hash_ids is not None
                and self.hash_salt is not None)
        per_chunk = self.hash_block_tokens // block_size_tokens
        rows = self.hash_row[start:stop]
        has_row = rows >= 0
        rows = np.where(has_row, rows, 0)
        first_id = self.hash_offsets[rows]
        num_full = self.prompt_tokens[start:stop] // block_size_tokens
        num_chunks = np.where(has_row, np.minimum(self.hash_offsets[rows + 1] - first_id,
                                                  -(-num_full // per_chunk)), 0)
        # Longest first, so the requests still extending their chain at position c are a prefix.
        order = np.argsort(-num_chunks, kind="stable")
        sorted_chunks = num_chunks[order]
        first_id = first_id[order]
        max_chunks = int(sorted_chunks[0]) if num else 0
        num_active = np.searchsorted(-sorted_chunks, -np.arange(max_chunks), side="left")
        parent = self.hash_salt[start:stop][order].astype(np.uint64) * np.uint64(_GOLDEN64)
        chains = np.empty((num, max_chunks), dtype=np.uint64)
        for c in range(max_chunks):
            active = int(num_active[c])
            values = _mix64_array(self.hash_ids[first_id[:active] + c].astype(np.uint64))
            parent[:active] = _mix64_array(parent[:active] ^ values)
            chains[:active, c] = parent[:active]
        out: list[tuple[list[int], list[int]]] = [([], [])] * num
        for position, i in enumerate(order.tolist()):
            count = int(sorted_chunks[position])
            if not count:
                break
            counts = [per_chunk] * count
            counts[-1] = min(per_chunk, int(num_full[i]) - per_chunk * (count - 1))
            out[i] = (chains[position, :count].tolist(), counts)
        return out


def _with_arrivals(trace: Trace, arrival_s: np.ndarray) -> Trace:
    return Trace(arrival_s, trace.prompt_tokens, trace.output_tokens, trace.hash_row,
                 trace.hash_salt, trace.hash_offsets, trace.hash_ids, trace.hash_block_tokens,
                 trace.name, trace.tenant)


def _mix64_array(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (numpy's uint64 arithmetic wraps modulo 2**64): a
    fixed, well-mixing bijection of 64-bit integers."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


# -- loaders ------------------------------------------------------------------------------------


def load_trace(path: str | Path, trace_format: str = "", *, max_requests: int = 0) -> Trace:
    """Load ``path`` as ``trace_format`` (``azure`` or ``mooncake``; by file suffix if empty)."""
    path = Path(path)
    fmt = trace_format or ("mooncake" if path.suffix in (".jsonl", ".json") else "azure")
    if fmt == "azure":
        return load_azure_csv(path, max_requests=max_requests)
    if fmt == "mooncake":
        return load_mooncake_jsonl(path, max_requests=max_requests)
    raise InvalidArgumentError(f"trace format {fmt!r} is not one of azure, mooncake",
                               field="format")


def load_azure_csv(path: str | Path, *, max_requests: int = 0) -> Trace:
    """The Azure 2023 CSV format; times relative to the first row. ``max_requests`` > 0 stops
    early. A malformed row raises ``InvalidArgumentError`` naming its line (1-based, header = 1).
    """
    path = Path(path)
    with path.open("r", encoding="utf-8", newline="") as handle:
        return parse_azure_csv(handle, name=path.name, max_requests=max_requests)


def parse_azure_csv(lines: Iterable[str], *, name: str = "", max_requests: int = 0) -> Trace:
    """``load_azure_csv`` over any iterable of lines."""
    arrivals = array("d")
    prompts = array("q")
    outputs = array("q")
    day_cache: dict[str, int] = {}
    columns: tuple[int, int, int] | None = None
    first_day: int | None = None
    for line_number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        cells = text.split(",")
        if columns is None:
            columns = _azure_columns(cells, line_number)
            continue
        try:
            ts_cell, ctx_cell, gen_cell = (cells[i] for i in columns)
            day, seconds = _parse_wall_clock(ts_cell, day_cache)
            num_prompt = int(ctx_cell)
            num_output = int(gen_cell)
        except (ValueError, IndexError) as exc:
            raise InvalidArgumentError(
                f"trace line {line_number}: malformed row {text[:80]!r} ({exc})",
                field="trace") from None
        if num_prompt < 1 or num_output < 1:
            raise InvalidArgumentError(
                f"trace line {line_number}: ContextTokens and GeneratedTokens must be >= 1, got "
                f"{num_prompt} and {num_output}", field="trace")
        if first_day is None:
            first_day = day
        arrivals.append((day - first_day) * 86400.0 + seconds)
        prompts.append(num_prompt)
        outputs.append(num_output)
        if max_requests and len(prompts) >= max_requests:
            break
    if columns is None:
        raise InvalidArgumentError("trace: empty file, expected a header line", field="trace")
    return _sorted_trace(arrivals, prompts, outputs, name=name)


def _azure_columns(cells: list[str], line_number: int) -> tuple[int, int, int]:
    names = [c.strip().lower() for c in cells]
    try:
        return (names.index("timestamp"), names.index("contexttokens"),
                names.index("generatedtokens"))
    except ValueError:
        raise InvalidArgumentError(
            f"trace line {line_number}: expected header TIMESTAMP,ContextTokens,GeneratedTokens, "
            f"got {','.join(cells)[:80]!r}", field="trace") from None


def _parse_wall_clock(text: str, day_cache: dict[str, int]) -> tuple[int, float]:
    """``YYYY-MM-DD HH:MM:SS[.fffffff][+00:00|Z]`` -> (day ordinal, seconds into the day).

    Seconds keep every fractional digit (float of a number below 86,400: ~1e-11 s resolution).
    """
    text = text.strip()
    day_text, separator, clock = text.partition(" ")
    if not separator:
        day_text, separator, clock = text.partition("T")
    if not separator:
        raise ValueError("no time of day")
    clock = clock.removesuffix("Z")
    for sign in ("+", "-"):
        where = clock.find(sign)
        if where > 0:
            if clock[where:] not in ("+00:00", "-00:00", "+0000", "+00"):
                raise ValueError(f"only UTC offsets are supported, got {clock[where:]!r}")
            clock = clock[:where]
    day = day_cache.get(day_text)
    if day is None:
        day = day_cache[day_text] = date.fromisoformat(day_text).toordinal()
    hours, minutes, seconds = clock.split(":")
    value = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    if not 0.0 <= value < 86400.0 + 1.0:  # a leap second is tolerated
        raise ValueError(f"time of day out of range: {clock!r}")
    return day, value


def load_mooncake_jsonl(path: str | Path, *, max_requests: int = 0) -> Trace:
    """The Mooncake FAST'25 JSONL format; times relative to the first row.

    ``hash_ids`` may hold fewer ids than ``ceil(input_length / 512)`` (the prompt tail is then
    unique content), never more. A malformed row raises ``InvalidArgumentError`` naming its line.
    """
    path = Path(path)
    with path.open("r", encoding="utf-8") as handle:
        return parse_mooncake_jsonl(handle, name=path.name, max_requests=max_requests)


def parse_mooncake_jsonl(lines: Iterable[str], *, name: str = "",
                         max_requests: int = 0) -> Trace:
    """``load_mooncake_jsonl`` over any iterable of lines."""
    arrivals = array("d")
    prompts = array("q")
    outputs = array("q")
    offsets = array("q", [0])
    ids = array("q")
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            timestamp_ms = float(row["timestamp"])
            num_prompt = _whole(row["input_length"])
            num_output = _whole(row["output_length"])
            hashes = row.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise ValueError("hash_ids must be a list of integers")
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(
                f"trace line {line_number}: malformed row {line.strip()[:80]!r} "
                f"({type(exc).__name__}: {exc})", field="trace") from None
        if num_prompt < 1 or num_output < 1 or not math.isfinite(timestamp_ms):
            raise InvalidArgumentError(
                f"trace line {line_number}: input_length and output_length must be >= 1 and "
                f"timestamp finite, got {num_prompt}, {num_output}, {timestamp_ms}",
                field="trace")
        if len(hashes) > -(-num_prompt // MOONCAKE_BLOCK_TOKENS):
            raise InvalidArgumentError(
                f"trace line {line_number}: {len(hashes)} hash_ids for {num_prompt} tokens "
                f"(at most one per {MOONCAKE_BLOCK_TOKENS} tokens)", field="trace")
        arrivals.append(timestamp_ms / 1000.0)
        prompts.append(num_prompt)
        outputs.append(num_output)
        ids.extend(hashes)
        offsets.append(len(ids))
        if max_requests and len(prompts) >= max_requests:
            break
    num = len(prompts)
    return _sorted_trace(
        arrivals, prompts, outputs, name=name,
        hash_row=np.arange(num, dtype=np.int64), hash_salt=np.zeros(num, dtype=np.int64),
        hash_offsets=np.frombuffer(offsets, dtype=np.int64).copy(),
        hash_ids=np.frombuffer(ids, dtype=np.int64).copy(),
    )


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"expected a whole number, got {value!r}")
    return int(value)


def _sorted_trace(arrivals: array, prompts: array, outputs: array, *, name: str,
                  hash_row: np.ndarray | None = None, hash_salt: np.ndarray | None = None,
                  hash_offsets: np.ndarray | None = None,
                  hash_ids: np.ndarray | None = None) -> Trace:
    arrival_s = np.frombuffer(arrivals, dtype=np.float64).copy() if arrivals else np.zeros(0)
    prompt = np.frombuffer(prompts, dtype=np.int64).copy() if prompts else np.zeros(0, np.int64)
    output = np.frombuffer(outputs, dtype=np.int64).copy() if outputs else np.zeros(0, np.int64)
    if len(arrival_s):
        arrival_s -= arrival_s[0]
    trace = Trace(arrival_s, prompt, output, hash_row, hash_salt, hash_offsets, hash_ids,
                  name=name)
    if len(arrival_s) > 1 and bool(np.any(np.diff(arrival_s) < 0)):
        trace = trace.take(np.argsort(arrival_s, kind="stable"))
        trace = _with_arrivals(trace, trace.arrival_s - trace.arrival_s[0])
    return trace


# -- scaling ------------------------------------------------------------------------------------


def time_scale(trace: Trace, factor: float) -> Trace:
    """Arrival times multiplied by ``factor``: 0.5 halves every gap (twice the rate, same
    requests), 2.0 doubles them."""
    if not factor > 0:
        raise InvalidArgumentError(f"time scale must be > 0, got {factor}", field="time_scale")
    return _with_arrivals(trace, trace.arrival_s * factor)


def rate_scale(trace: Trace, factor: float, *, seed: int = 0, jitter_s: float = 60.0) -> Trace:
    """The arrival rate multiplied by ``factor`` over the same time span.

    Below 1: seeded thinning (each request kept with probability ``factor``). Above 1: the
    trace plus ``floor(factor) - 1`` replayed copies and one thinned copy for the fraction; every
    request of a copy is shifted by its own uniform offset in ``[0, jitter_s)`` (wrapping at the
    end of the trace), which keeps the trace's envelope at scales above ``jitter_s`` while
    de-synchronising the copies. Copies carry their copy number as ``hash_salt``, so they do not
    share prefix-cache blocks with their original.
    """
    if not factor > 0:
        raise InvalidArgumentError(f"rate scale must be > 0, got {factor}", field="rate_scale")
    rng = np.random.default_rng(seed)
    n = trace.num_requests
    if factor <= 1.0:
        return trace.take(np.flatnonzero(rng.random(n) < factor))
    span = max(trace.duration_s, 1e-9)
    num_whole = math.floor(factor)
    fraction = factor - num_whole
    parts_index = [np.arange(n)]
    parts_time = [trace.arrival_s]
    parts_copy = [np.zeros(n, dtype=np.int64)]
    for copy in range(1, num_whole + (1 if fraction > 1e-12 else 0)):
        keep = np.arange(n) if copy < num_whole else np.flatnonzero(rng.random(n) < fraction)
        offsets = rng.random(len(keep)) * jitter_s
        parts_index.append(keep)
        parts_time.append((trace.arrival_s[keep] + offsets) % span)
        parts_copy.append(np.full(len(keep), copy, dtype=np.int64))
    index = np.concatenate(parts_index)
    times = np.concatenate(parts_time)
    copies = np.concatenate(parts_copy)
    order = np.argsort(times, kind="stable")
    index, times, copies = index[order], times[order], copies[order]
    hash_row = hash_salt = None
    if trace.hash_row is not None and trace.hash_salt is not None:
        hash_row = trace.hash_row[index]
        hash_salt = trace.hash_salt[index] * (num_whole + 2) + copies
    return Trace(times, trace.prompt_tokens[index], trace.output_tokens[index], hash_row,
                 hash_salt, trace.hash_offsets, trace.hash_ids, trace.hash_block_tokens,
                 trace.name)


# -- generators ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A token-length distribution: log-normal with ``mean_tokens`` and coefficient of
    variation ``cv`` (0 = always ``mean_tokens``), clipped to ``[min_tokens, max_tokens]``."""

    mean_tokens: float
    cv: float = 0.0
    min_tokens: int = 1
    max_tokens: int = 1 << 20

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
        if self.cv <= 0:
            values = np.full(num, self.mean_tokens)
        else:
            sigma2 = math.log1p(self.cv * self.cv)
            mu = math.log(self.mean_tokens) - sigma2 / 2
            values = rng.lognormal(mu, math.sqrt(sigma2), num)
        return np.clip(np.rint(values), self.min_tokens, self.max_tokens).astype(np.int64)


def synthetic_trace(num_requests: int, rate_per_s: float, *, seed: int = 0,
                    prompt: LengthSpec = LengthSpec(1024), output: LengthSpec = LengthSpec(128),
                    sizes: Trace | None = None) -> Trace:
    """Poisson arrivals at ``rate_per_s``; lengths from ``prompt``/``output`` or, when ``sizes``
    is given, (prompt, output) pairs drawn with replacement from its rows. Seeded."""
    if num_requests < 0 or not rate_per_s > 0:
        raise InvalidArgumentError("synthetic trace needs num_requests >= 0 and rate_per_s > 0",
                                   field="rate_per_s")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_per_s, num_requests)
    arrival_s = np.cumsum(gaps) - (gaps[0] if num_requests else 0.0)
    prompts, outputs = _sample_sizes(rng, num_requests, prompt, output, sizes)
    return Trace(arrival_s, prompts, outputs, name=f"poisson({rate_per_s:g}/s, seed {seed})")


def _sample_sizes(rng: np.random.Generator, num: int, prompt: LengthSpec, output: LengthSpec,
                  sizes: Trace | None) -> tuple[np.ndarray, np.ndarray]:
    if sizes is not None:
        if sizes.num_requests == 0:
            raise InvalidArgumentError("sizes trace is empty", field="sizes")
        rows = rng.integers(0, sizes.num_requests, num)
        return sizes.prompt_tokens[rows].copy(), sizes.output_tokens[rows].copy()
    return prompt.sample(rng, num), output.sample(rng, num)


@dataclass(frozen=True, slots=True)
class DayShape:
    """A day of demand: a smooth 24-hour envelope plus bursts.

    Base rate: ``trough + (peak - trough) x (1 + cos(2 pi (t/3600 - peak_hour) / 24)) / 2``, so
    the rate is ``peak_rate_per_s`` at ``peak_hour`` and ``peak_rate_per_s / peak_to_trough``
    twelve hours later. Each burst multiplies it by ``1 + burst_rise x b(t)``, where ``b`` rises
    linearly from 0 to 1 over ``burst_ramp_s``, holds until ``burst_duration_s`` after the burst
    began, then falls back to 0 over ``burst_ramp_s``.
    """

    peak_rate_per_s: float
    peak_to_trough: float = 10.0
    peak_hour: float = 14.0
    num_bursts: int = 2
    burst_rise: float = 0.6
    burst_ramp_s: float = 600.0
    burst_duration_s: float = 1800.0
    duration_s: float = 86400.0

    def __post_init__(self) -> None:
        if not self.peak_rate_per_s > 0 or not self.peak_to_trough >= 1:
            raise InvalidArgumentError(
                "DayShape needs peak_rate_per_s > 0 and peak_to_trough >= 1", field="day_shape")
        if self.burst_duration_s < self.burst_ramp_s or self.num_bursts < 0:
            raise InvalidArgumentError(
                "DayShape needs burst_duration_s >= burst_ramp_s and num_bursts >= 0",
                field="day_shape")

    def base_rate_per_s(self, t_s: np.ndarray) -> np.ndarray:
        trough = self.peak_rate_per_s / self.peak_to_trough
        phase = 2 * np.pi * (np.asarray(t_s) / 3600.0 - self.peak_hour) / 24.0
        return trough + (self.peak_rate_per_s - trough) * (1 + np.cos(phase)) / 2


@dataclass(frozen=True, slots=True)
class DayDemand:
    """A ``DayShape`` with its bursts placed (``burst_starts_s``): the exact rate at any time,
    which a perfect-foresight baseline may read, and a seeded sampler of requests."""

    shape: DayShape
    burst_starts_s: tuple[float, ...] = field(default=())

    @staticmethod
    def with_random_bursts(shape: DayShape, seed: int = 0) -> DayDemand:
        """Bursts at seeded uniform times that neither overlap each other nor the day's end."""
        rng = np.random.default_rng(seed)
        span = shape.burst_duration_s + shape.burst_ramp_s
        for _ in range(1000):
            starts = np.sort(rng.uniform(0, shape.duration_s - span, shape.num_bursts))
            if shape.num_bursts < 2 or bool(np.all(np.diff(starts) > span)):
                return DayDemand(shape, tuple(float(s) for s in starts))
        raise InvalidArgumentError("bursts do not fit in the day", field="num_bursts")

    def rate_per_s(self, t_s: np.ndarray | float) -> np.ndarray:
        """Requests per second at ``t_s`` (vectorised)."""
        t = np.asarray(t_s, dtype=np.float64)
        shape = self.shape
        boost = np.zeros_like(t)
        for start in self.burst_starts_s:
            rise = (t - start) / shape.burst_ramp_s
            fall = (start + shape.burst_duration_s + shape.burst_ramp_s - t) / shape.burst_ramp_s
            boost = np.maximum(boost, np.clip(np.minimum(rise, fall), 0.0, 1.0))
        return shape.base_rate_per_s(t) * (1.0 + shape.burst_rise * boost)

    def sample(self, sizes: Trace, *, seed: int = 0, grid_s: float = 1.0) -> Trace:
        """A non-homogeneous Poisson process with this rate (time-transformed from a unit-rate
        one over a ``grid_s`` grid of the cumulative rate); (prompt, output) pairs drawn with
        replacement from ``sizes``. Seeded."""
        rng = np.random.default_rng(seed)
        grid = np.arange(0.0, self.shape.duration_s + grid_s, grid_s)
        grid[-1] = min(grid[-1], self.shape.duration_s)
        rates = self.rate_per_s(grid)
        steps = (rates[1:] + rates[:-1]) / 2 * np.diff(grid)
        cumulative = np.concatenate(([0.0], np.cumsum(steps)))
        num = int(rng.poisson(cumulative[-1]))
        arrival_s = np.interp(np.sort(rng.uniform(0.0, cumulative[-1], num)), cumulative, grid)
        prompts, outputs = _sample_sizes(rng, num, LengthSpec(1), LengthSpec(1), sizes)
        return Trace(arrival_s, prompts, outputs,
                     name=f"day({self.shape.peak_rate_per_s:g}/s peak)")


def iter_chunks(trace: Trace, chunk: int = 1 << 16
                ) -> Iterator[tuple[int, list[float], list[int], list[int]]]:
    """``(start, arrivals, prompts, outputs)`` as Python lists, ``chunk`` rows at a time: the
    simulator's hot loop reads lists (fast scalar access) without converting a whole trace."""
    for start in range(0, trace.num_requests, chunk):
        stop = start + chunk
        yield (start, trace.arrival_s[start:stop].tolist(),
               trace.prompt_tokens[start:stop].tolist(), trace.output_tokens[start:stop].tolist())
