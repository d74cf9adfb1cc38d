"""Self-distillation: the target writes the drafter's training data.

Prompts come from JSONL (`{"prompt": ...}` or ShareGPT-style
`{"conversations": [{"from": "human", "value": ...}, ...]}`), get the chat
template, and are decoded in batches by a `DecodingSession` (plain decoding
when no drafter is given). Every row of a batch is prefilled to its longest
prompt and decodes until its longest reply ends, so `length_batches` sorts each
window of a few batches by prompt length first. Each finished batch becomes one shard,
`shard-XXXXX.npz`, written to a temporary name, fsync'd and renamed into place,
so the folder only ever holds complete shards. A restarted run reads the ids
already present in the shards and continues with the rest: an interruption
loses at most the batch in flight.

Shard arrays (R records):
  ids (R,) str: the record ids (the JSONL `id`, else `line-<n>`).
  tokens (sum of lengths,) uint16/int32: prompt + completion of every record, concatenated.
  lengths (R,) int32: tokens per record; prompt_lengths (R,) int32: of which prompt.
  finish (R,) int8: 1 when the completion ended with EOS (the EOS id is kept), 0 at the limit.

`manifest.json` holds the settings; resuming with different settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import PLAIN_DECODING, SamplingConfig, TreeConfig
from .drafter import Drafter
from .files import fsync_path, match_umask
from .prompts import PromptRecord, encode_prompt
from .session import DecodingSession, Request, stop_config

MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.npz"


def _stable_rank(text: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{text}".encode()).hexdigest()


def balanced_order(
    records: Sequence[PromptRecord], weights: dict[str, float] | None = None, seed: int = 0
) -> list[PromptRecord]:
    """Interleave sources so every prefix of the result follows the source weights.

    Within a source the order is a seeded shuffle. A source missing from
    `weights` has weight 1; weight 0 drops it. A source that runs out leaves the
    others to fill the rest.
    """
    weights = weights or {}
    groups: dict[str, list[PromptRecord]] = {}
    for record in records:
        groups.setdefault(record.source, []).append(record)
    for source in groups:
        groups[source].sort(key=lambda r: _stable_rank(r.id, seed))
    active = {s: w for s in groups if (w := float(weights.get(s, 1.0))) > 0}
    served = dict.fromkeys(active, 0)
    order: list[PromptRecord] = []
    while active:
        # The source furthest behind its share goes next (ties: name order).
        source = min(sorted(active), key=lambda s: (served[s] + 1) / active[s])
        order.append(groups[source][served[source]])
        served[source] += 1
        if served[source] == len(groups[source]):
            del active[source]
    return order


def length_batches(lengths: Sequence[int], batch_size: int, window: int) -> list[list[int]]:
    """Split positions 0..R-1 into batches, sorting each window of `window` batches by length.

    lengths: (R,) prompt lengths in the order the records should be served.
    Returns batches of indices into `lengths`: consecutive runs of `batch_size`
    when `window` is 1; otherwise each run of `window * batch_size` records is
    sorted by length (stable) before it is cut, so the order across windows,
    and with it the source mix of every prefix, is kept at window granularity.
    """
    if batch_size < 1 or window < 1:
        raise ValueError(f"batch size and window must be >= 1, got {batch_size} and {window}")
    span = batch_size * window
    batches: list[list[int]] = []
    for start in range(0, len(lengths), span):
        rows = list(range(start, min(start + span, len(lengths))))
        if window > 1:
            rows.sort(key=lambda i: lengths[i])
        batches.extend(rows[i : i + batch_size] for i in range(0, len(rows), batch_size))
    return batches


@dataclass(frozen=True)
class DistillConfig:
    """Settings of a distillation run (stored in the manifest)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chat_template: bool = True
    model: str = "default"


@dataclass
class Shard:
    """The records of one shard, in memory."""

    ids: list[str]
    sequences: list[list[int]]
    prompt_lengths: list[int]
    finish: list[int]


def write_shard(folder: Path, index: int, shard: Shard, prefix: str = "") -> Path:
    """Write `shard-<prefix><index>.npz` atomically (temp file, fsync, rename)."""
    flat = [t for seq in shard.sequences for t in seq]
    dtype = np.uint16 if max(flat, default=0) < 2**16 else np.int32
    arrays = {
        "ids": np.array(shard.ids, dtype=np.str_),
        "tokens": np.array(flat, dtype=dtype),
        "lengths": np.array([len(s) for s in shard.sequences], dtype=np.int32),
        "prompt_lengths": np.array(shard.prompt_lengths, dtype=np.int32),
        "finish": np.array(shard.finish, dtype=np.int8),
    }
    target = folder / f"shard-{prefix}{index:05d}.npz"
    fd, temp = tempfile.mkstemp(prefix=".shard-", suffix=".npz.partial", dir=folder)
    try:
        match_umask(temp)
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_path(folder)
    return target


def read_shard(path: Path) -> Shard:
    with np.load(path, allow_pickle=False) as data:
        tokens = data["tokens"].astype(np.int64)
        lengths = data["lengths"].tolist()
        ends = np.cumsum(lengths).tolist()
        starts = [e - n for e, n in zip(ends, lengths)]
        return Shard(
            ids=[str(i) for i in data["ids"].tolist()],
            sequences=[tokens[s:e].tolist() for s, e in zip(starts, ends)],
            prompt_lengths=data["prompt_lengths"].tolist(),
            finish=data["finish"].tolist(),
        )


def shard_paths(folder: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(folder).glob(SHARD_GLOB))


class DistilledSequence(NamedTuple):
    id: str
    tokens: list[int]
    prompt_length: int


def load_distilled(folders: Sequence[str | os.PathLike[str]]) -> list[DistilledSequence]:
    """Every record in the shards of the given folders, in shard order."""
    sequences: list[DistilledSequence] = []
    for folder in folders:
        path = Path(folder)
        if not path.is_dir():
            raise FileNotFoundError(f"no distilled data folder at {path}")
        paths = shard_paths(path)
        if not paths:
            raise ValueError(f"{path} holds no {SHARD_GLOB} shards: run `mlx-redrafter distill`")
        for shard_path in paths:
            shard = read_shard(shard_path)
            for record_id, tokens, prompt_length in zip(
                shard.ids, shard.sequences, shard.prompt_lengths
            ):
                sequences.append(DistilledSequence(record_id, tokens, prompt_length))
    return sequences


def _check_manifest(folder: Path, config: DistillConfig) -> None:
    path = folder / MANIFEST
    wanted = asdict(config)
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        different = {k: (stored.get(k), v) for k, v in wanted.items() if stored.get(k) != v}
        if different:
            detail = ", ".join(f"{k}: stored {a!r}, now {b!r}" for k, (a, b) in different.items())
            raise ValueError(
                f"{folder} was distilled with other settings ({detail}); "
                "use another --output folder or the same settings"
            )
        return
    fd, temp = tempfile.mkstemp(prefix=".manifest-", dir=folder)
    match_umask(temp)
    with os.fdopen(fd, "w") as f:
        json.dump(wanted, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    fsync_path(folder)


def distill(
    model: nn.Module,
    tokenizer: Any,
    records: Sequence[PromptRecord],
    output: str | os.PathLike[str],
    config: DistillConfig,
    *,
    batch_size: int = 32,
    length_window: int = 8,
    limit: int | None = None,
    worker: tuple[int, int] = (0, 1),
    drafter: Drafter | None = None,
    tree: TreeConfig | str | None = None,
    progress: bool = True,
) -> Generator[Path, None, None]:
    """Decode the records not yet in `output`, one shard per batch; yields each shard's path.

    `records` is taken in order (use `balanced_order` first); `limit` caps the
    number of records the folder should hold in total. `worker=(i, n)` lets n
    processes fill one folder together: worker i decodes every n-th wanted
    record and names its shards `shard-w<i>-XXXXX.npz`. Batches come from
    `length_batches(..., length_window)` over the worker's whole share, so a
    restarted run forms the same batches and skips the finished ones (greedy
    replies do not depend on the batching; sampled ones do, as on batch_size).
    """
    index, count = worker
    if not 0 <= index < count:
        raise ValueError(f"worker must be i/n with 0 <= i < n, got {index}/{count}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if config.max_tokens < 1:
        raise ValueError(f"max tokens must be >= 1, got {config.max_tokens}")
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    _check_manifest(folder, config)
    existing = shard_paths(folder)
    done = _done_ids(existing)
    wanted = list(records) if limit is None else list(records)[:limit]
    # Worker i owns every n-th record of the wanted list (stable across restarts).
    share = wanted[index::count]
    prompts = [encode_prompt(tokenizer, r.messages, config.chat_template) for r in share]
    tree = tree if drafter is not None and tree is not None else PLAIN_DECODING
    session = DecodingSession(model, drafter, tree=tree)
    unusable = _unusable(session, share, prompts)
    batches = [
        [i for i in rows if share[i].id not in done and i not in unusable]
        for rows in length_batches([len(p) for p in prompts], batch_size, length_window)
    ]
    batches = [rows for rows in batches if rows]
    prefix = f"w{index}-" if count > 1 else ""
    next_index = _next_shard_index(existing, prefix)
    replies = _Replies(session, tokenizer, config)
    bar = _progress(len(done) + sum(len(rows) for rows in batches), len(done), progress)
    try:
        for rows in batches:
            batch = [share[i] for i in rows]
            shard = replies.decode(batch, [prompts[i] for i in rows], bar)
            path = write_shard(folder, next_index, shard, prefix)
            next_index += 1
            bar.update(len(batch))
            yield path
    finally:
        bar.close()


def _unusable(
    session: DecodingSession, records: Sequence[PromptRecord], prompts: Sequence[list[int]]
) -> set[int]:
    """The prompts the model cannot take (empty, or as long as its context), reported
    on stderr and skipped."""
    unusable = set()
    for index, prompt in enumerate(prompts):
        problem = session.check_prompt(prompt)
        if problem is not None:
            print(f"note: record {records[index].id} skipped: {problem}", file=sys.stderr)
            unusable.add(index)
    return unusable


def _done_ids(shards: Sequence[Path]) -> set[str]:
    """The record ids the shards already hold."""
    done: set[str] = set()
    for path in shards:
        with np.load(path, allow_pickle=False) as data:
            done.update(str(i) for i in data["ids"].tolist())
    return done


def _next_shard_index(existing: Sequence[Path], prefix: str) -> int:
    """The number of this worker's next shard (after its highest one)."""
    if prefix:
        mine = [p for p in existing if p.stem[len("shard-") :].startswith(prefix)]
    else:
        mine = [p for p in existing if p.stem[len("shard-") :].isdigit()]
    return 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in mine), default=-1)


class _Replies:
    """Decodes one batch of records into a shard with a `DecodingSession`."""

    def __init__(self, session: DecodingSession, tokenizer: Any, config: DistillConfig):
        self.session, self.config = session, config
        self.sampling = SamplingConfig(config.temperature, config.top_p, config.top_k)
        self.stop = stop_config(tokenizer, config.max_tokens, None)
        eos, eos_id = self.stop.eos_token_ids, getattr(tokenizer, "eos_token_id", None)
        self.eos_id = min(eos) if eos_id is None and eos else eos_id

    def _keys(self, batch: list[PromptRecord]) -> list[mx.array | None]:
        """Per-record sampling keys, from the seed and the batch's first id (None: greedy)."""
        if self.sampling.greedy:
            return [None] * len(batch)
        digest = hashlib.sha256(f"{self.config.seed}:{batch[0].id}".encode()).digest()
        key = mx.random.key(int.from_bytes(digest[:4], "little"))
        return list(mx.random.split(key, len(batch)))

    def decode(self, batch: list[PromptRecord], prompts: list[list[int]], bar: Any) -> Shard:
        """The shard of one batch: prompt + reply (+ EOS when the reply ended on it)."""
        outputs: list[list[int]] = [[] for _ in batch]
        finish = [0] * len(batch)
        keys = self._keys(batch)
        requests = [Request(p, self.sampling, self.stop, k) for p, k in zip(prompts, keys)]
        for update in self.session.run(requests, ids=range(len(requests))):
            outputs[update.request].extend(update.tokens)
            bar.tokens += len(update.tokens)
            finish[update.request] = int(update.finish_reason == "stop")
            bar.refresh()
        sequences = []
        for prompt, completion, ended in zip(prompts, outputs, finish):
            stop_token = [self.eos_id] if ended and self.eos_id is not None else []
            sequences.append(prompt + completion + stop_token)
        return Shard([r.id for r in batch], sequences, [len(p) for p in prompts], finish)


class _Progress:
    """A tqdm bar over records, with generated tokens/s in the postfix (stderr)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="prompt",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.tokens = 0
        self.started = time.perf_counter()
        self.last = 0.0

    def refresh(self) -> None:
        now = time.perf_counter()
        if now - self.last > 2.0:
            self.last = now
            rate = self.tokens / max(now - self.started, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens} tokens, {rate:.0f} tok/s", refresh=True)

    def update(self, count: int) -> None:
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, initial: int, enabled: bool) -> _Progress:
    return _Progress(total, initial, enabled)
