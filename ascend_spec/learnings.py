"""What adaptive K learned in a run (acceptance per draft position, step costs per bucket and K), kept across runs.
Entries of the compile cache's folder, keyed by model, K_max, dtype, backend, buckets, host and caller.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch

from .adaptive import LEARN_STEPS, AdaptiveK
from .graph.backends.aot_graphs import device_capability
from .graph.backends.compile_cache import (BadEntry, CacheKey, CompileCache, atomic_write, decode_entry,
                                           encode_entry)
from .graph.backends.cache_entry import DIGEST_CHARS, read_file_header
from .k_policy import ACCEPTANCE_WINDOW, AcceptanceTracker, KPolicy

__all__ = ["Learnings", "LearningsStore", "learnings_key"]

log = logging.getLogger(__name__)

#: the payload's own format (the file's header has the entry format); a change misses every older entry
_FORMAT = 1
#: drafts of the first position an earlier run's counts weigh at most against this run's (positions scaled alike)
_KEEP_DRAFTS = 512
#: steps an earlier run's between-steps figure of a (bucket, K) weighs at most
_KEEP_STEPS = 256
#: parameters whose values the weights' fingerprint samples (evenly spread over their names), and values of each
_SAMPLED_TENSORS = 64
_SAMPLED_VALUES = 16
#: bytes read at the start, middle and end of each checkpoint file for a folder's fingerprint
_SAMPLED_BYTES = 1 << 16
_FLAVOUR_CHARS = 40


@dataclass
class Learnings:
    """A run's acceptance totals per draft position and its step figures per bucket (seconds per step and between
    steps, with the steps behind each), as a fresh :class:`KPolicy` is seeded from and as saved."""

    #: ``CacheKey.what`` of every learnings entry starts so (``ascend-spec cache info`` lists them apart)
    LABEL_PREFIX: ClassVar[str] = "learnings."

    k_max: int
    #: per draft position over the run: drafts verified, and accepted (a_j's counts, see ``AcceptanceTracker``)
    offered: list[int]
    accepted: list[int]
    #: bucket -> K -> seconds of one step (measured figures only: interpolated ones are left out)
    step_seconds: dict[int, dict[int, float]]
    #: bucket -> K -> mean seconds between two steps (prefills, the loop), and the steps behind it
    between_seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    steps: dict[int, dict[int, int]] = field(default_factory=dict)
    #: steps the policy drafted while it learned acceptance (at most ``LEARN_STEPS``)
    learning_steps: int = 0

    def __post_init__(self) -> None:
        _check(self)

    @property
    def drafts(self) -> int:
        """First-position drafts recorded."""
        return self.offered[0] if self.offered else 0

    @classmethod
    def from_policy(cls, policy: KPolicy) -> "Learnings":
        return cls.from_parts(policy.acceptance, policy.costs, policy.learning_steps)

    @classmethod
    def from_parts(cls, acceptance: AcceptanceTracker, costs: AdaptiveK, learning_steps: int = 0) -> "Learnings":
        """What ``acceptance`` and ``costs`` hold now (copies)."""
        step_seconds = {b: {k: s for k, s in c.items() if k not in costs.pending and _positive(s)}
                        for b, c in costs.step_seconds.items()}
        between, steps = {}, {}
        for b, counts in costs.between_steps.items():
            sums = costs.between_seconds.get(b, {})
            kept = {k: n for k, n in counts.items() if n > 0 and math.isfinite(sums.get(k, math.nan))}
            if kept:
                between[b] = {k: max(0.0, sums[k] / n) for k, n in kept.items()}
                steps[b] = kept
        return cls(costs.k_max, list(acceptance.offered), list(acceptance.accepted),
                   {b: c for b, c in step_seconds.items() if c}, between, steps, min(learning_steps, LEARN_STEPS))

    def learned_anything(self) -> bool:
        return bool(self.drafts or self.step_seconds or self.steps)

    def seed(self, policy: KPolicy, acceptance: bool = True) -> None:
        """Seed ``policy`` (of this ``k_max``): its acceptance counts and recent window (an earlier run weighs at most
        ``_KEEP_DRAFTS`` first-position drafts, so this run's soon outweigh it), its learning steps and between-steps
        figures; and, in each bucket warm-up timed, the step costs (:func:`_blend`). ``acceptance`` False: the costs
        only (after a later warm-up, over figures the run already holds)."""
        if policy.k_max != self.k_max:
            raise ValueError(f"Learnings.seed: k_max={self.k_max} into a policy of k_max={policy.k_max}; allowed: "
                             "the same K_max (the key holds it)")
        costs = policy.costs
        if acceptance:
            self._seed_acceptance(policy)
            # a start: each bucket resumes the K the earlier run ran most (ties: the smaller K)
            for bucket, ran in self.steps.items():
                if ran:
                    costs.resume(bucket, max(sorted(ran), key=ran.__getitem__))
        for bucket, warm in costs.step_seconds.items():
            if self.step_seconds.get(bucket):
                costs.step_seconds[bucket] = _blend(self.step_seconds[bucket], warm)

    def _seed_acceptance(self, policy: KPolicy) -> None:
        keep = min(1.0, _KEEP_DRAFTS / self.drafts) if self.drafts else 0.0
        tracker = policy.acceptance
        for j, (o, a) in enumerate(zip(self.offered, self.accepted)):
            offered, accepted = round(keep * o), round(keep * a)
            tracker.offered[j] += offered
            tracker.accepted[j] += accepted
            # the recent window as a steady run at the position's rate would leave it (its mass tends to the window)
            recent = min(float(offered), float(ACCEPTANCE_WINDOW))
            tracker.recent_offered[j] += recent
            tracker.recent_accepted[j] += recent * accepted / offered if offered else 0.0
        policy.learning_steps = max(policy.learning_steps, self.learning_steps)
        costs = policy.costs
        for b, means in self.between_seconds.items():
            sums, counts = costs.between_seconds.setdefault(b, {}), costs.between_steps.setdefault(b, {})
            for k, mean in means.items():
                n = min(self.steps[b][k], _KEEP_STEPS)
                sums[k] = sums.get(k, 0.0) + mean * n
                counts[k] = counts.get(k, 0) + n

    def merge(self, earlier: "Learnings") -> "Learnings":
        """This run's learnings combined with an ``earlier`` entry it was not seeded from: counts added, the earlier
        ones capped as :meth:`seed` caps them; this run's step figures, the earlier's where this run has none."""
        if earlier.k_max != self.k_max:
            return self
        keep = min(1.0, _KEEP_DRAFTS / earlier.drafts) if earlier.drafts else 0.0
        offered = [o + round(keep * e) for o, e in zip(self.offered, earlier.offered)]
        accepted = [a + round(keep * e) for a, e in zip(self.accepted, earlier.accepted)]
        step_seconds = {b: {**earlier.step_seconds.get(b, {}), **self.step_seconds.get(b, {})}
                        for b in self.step_seconds.keys() | earlier.step_seconds.keys()}
        between: dict[int, dict[int, float]] = {}
        steps: dict[int, dict[int, int]] = {}
        for b in self.steps.keys() | earlier.steps.keys():
            for k in self.steps.get(b, {}).keys() | earlier.steps.get(b, {}).keys():
                n_new, n_old = self.steps.get(b, {}).get(k, 0), min(earlier.steps.get(b, {}).get(k, 0), _KEEP_STEPS)
                mean = (n_new * self.between_seconds.get(b, {}).get(k, 0.0)
                        + n_old * earlier.between_seconds.get(b, {}).get(k, 0.0)) / (n_new + n_old)
                between.setdefault(b, {})[k] = mean
                steps.setdefault(b, {})[k] = n_new + n_old
        return Learnings(self.k_max, offered, accepted, step_seconds, between, steps,
                         max(self.learning_steps, earlier.learning_steps))

    # -- the payload ------------------------------------------------------------------------------------
    def to_json(self) -> bytes:
        def keyed(d: dict) -> dict:
            return {str(b): {str(k): v for k, v in sorted(inner.items())} for b, inner in sorted(d.items())}

        return json.dumps({"format": _FORMAT, "k_max": self.k_max, "offered": self.offered, "accepted": self.accepted,
                           "step_seconds": keyed(self.step_seconds), "between_seconds": keyed(self.between_seconds),
                           "steps": keyed(self.steps), "learning_steps": self.learning_steps},
                          sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> "Learnings":
        """Raises ValueError naming what is wrong."""
        try:
            data = json.loads(payload)
        except ValueError as exc:
            raise ValueError(f"unreadable payload ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"payload format {data.get('format') if isinstance(data, dict) else None!r}, this build "
                             f"reads {_FORMAT}")

        def nested(name: str, kind: type) -> dict[int, dict[int, Any]]:
            value = data.get(name, {})
            try:
                out = {int(b): {int(k): v for k, v in inner.items()} for b, inner in value.items()}
            except (AttributeError, TypeError, ValueError):
                out = None
            if out is None or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                  for inner in out.values() for v in inner.values()):
                raise ValueError(f"{name}: allowed: bucket -> K -> number")
            return {b: {k: kind(v) for k, v in inner.items()} for b, inner in out.items()}

        try:
            return cls(data["k_max"], data["offered"], data["accepted"], nested("step_seconds", float),
                       nested("between_seconds", float), nested("steps", int), data.get("learning_steps", 0))
        except KeyError as exc:
            raise ValueError(f"payload lacks {exc}") from None

    @classmethod
    def from_entry_file(cls, path: Path) -> "Learnings":
        """The learnings in the entry file at ``path``, for showing them (``ascend-spec cache info``): the payload's
        checksum is checked, the key is not. Raises ValueError (and OSError)."""
        header, start = read_file_header(path)
        payload = path.read_bytes()[start:]
        if len(payload) != header["payload_len"] or hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            raise ValueError("corrupt: payload does not match the header")
        return cls.from_json(payload)


def _positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check(learned: Learnings) -> None:
    """Raises ValueError naming the field that is out of range."""
    k = learned.k_max
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k_max={k!r}; allowed: an int >= 1")
    for name in ("offered", "accepted"):
        counts = getattr(learned, name)
        if (not isinstance(counts, list) or len(counts) != k
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)):
            raise ValueError(f"{name}={counts!r}; allowed: {k} ints >= 0, one per draft position")
    if any(a > o for a, o in zip(learned.accepted, learned.offered)):
        raise ValueError(f"accepted={learned.accepted} exceeds offered={learned.offered} at some position")
    for b, costs in learned.step_seconds.items():
        if b < 1 or any(not 0 <= j <= k or not _positive(s) for j, s in costs.items()):
            raise ValueError(f"step_seconds[{b}]={costs}; allowed: K in 0..{k} -> seconds > 0, buckets >= 1")
    for b, means in learned.between_seconds.items():
        counts = learned.steps.get(b, {})
        if means.keys() != counts.keys() or any(not math.isfinite(s) or s < 0 for s in means.values()) \
                or any(n < 1 for n in counts.values()) or any(not 0 <= j <= k for j in means):
            raise ValueError(f"between_seconds[{b}]={means} with steps {counts}; allowed: the same K values in "
                             f"0..{k}, seconds >= 0, steps >= 1")
    if learned.steps.keys() != learned.between_seconds.keys():
        raise ValueError("steps and between_seconds: allowed: the same buckets")
    n = learned.learning_steps
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= LEARN_STEPS:
        raise ValueError(f"learning_steps={n!r}; allowed: an int in 0..{LEARN_STEPS}")


def _blend(learned: dict[int, float], warm: dict[int, float]) -> dict[int, float]:
    """A bucket's step costs from a learned set and warm-up's: warm-up times short contexts on inert batches and
    errs low, a run's steps are what a step costs, so each learned figure stands; a K only warm-up timed is set on
    the learned scale (its figure × the median learned ÷ warm-up ratio of the K values both hold). The K values are
    warm-up's: those the run compiled or may compile."""
    shared = [k for k in warm if k in learned and warm[k] > 0]
    scale = statistics.median(learned[k] / warm[k] for k in shared) if shared else 1.0
    return {k: learned[k] if k in learned else w * scale for k, w in warm.items()}


# --------------------------------------------------------------------------- the key


def learnings_key(model_config: dict[str, Any], weights: str | os.PathLike | torch.nn.Module, *, k_max: int,
                  dtype: torch.dtype | str, backend: str, batch_sizes: Sequence[int], flavour: str,
                  device: torch.device | str = "cpu") -> CacheKey:
    """The key of a run's learnings: what makes its figures hold for another run. The model (its config, as graph
    entries key it, and its weights: a string the caller computed, a checkpoint folder or a loaded module, see
    :func:`_weights_id`), K_max, dtype, backend, batch buckets, the host (CPU model, vector ISA, cores, torch's
    threads; the accelerator) and ``flavour`` (the caller: ``engine``, ``vllm-v1`` ...); the graph code, torch and
    Python versions join as in every :class:`CacheKey`."""
    if not isinstance(flavour, str) or not flavour or len(flavour) > _FLAVOUR_CHARS \
            or not all(c.isalnum() or c in "-_" for c in flavour):
        raise ValueError(f"flavour={flavour!r}; allowed: 1-{_FLAVOUR_CHARS} characters of [A-Za-z0-9_-]")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max={k_max!r}; allowed: an int >= 1 (learnings are adaptive K's)")
    device = torch.device(device)
    return CacheKey(what=f"{Learnings.LABEL_PREFIX}{flavour}", model_config=dict(model_config), backend=backend,
                    backend_options={"format": _FORMAT, "weights": _weights_id(weights), "k_max": k_max,
                                     "dtype": str(dtype).removeprefix("torch."),
                                     "batch_sizes": sorted(int(b) for b in batch_sizes), "flavour": flavour,
                                     "device": device.type, "host": _host(device)})


def _weights_id(weights: str | os.PathLike | torch.nn.Module) -> str:
    """A string as given; a checkpoint folder: a digest of its files' names, sizes and bytes at their start, middle
    and end (safetensors' headers and samples of their data: reading a large checkpoint whole would cost minutes);
    a module: a digest of its parameters' names, shapes and dtypes and of values sampled from up to
    ``_SAMPLED_TENSORS`` of them (one host copy)."""
    if isinstance(weights, torch.nn.Module):
        return _module_digest(weights)
    if isinstance(weights, os.PathLike):
        return _folder_digest(Path(weights))
    if isinstance(weights, str) and weights:
        return weights
    raise ValueError(f"weights={weights!r}; allowed: an identity string, a checkpoint folder or a loaded module")


def _folder_digest(folder: Path) -> str:
    if not folder.is_dir():
        raise ValueError(f"weights={str(folder)!r}: no such folder; allowed: a checkpoint folder")
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json", ".bin")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for at in sorted({0, max(0, size // 2 - _SAMPLED_BYTES // 2), max(0, size - _SAMPLED_BYTES)}):
                f.seek(at)
                h.update(f.read(_SAMPLED_BYTES))
    return h.hexdigest()[:DIGEST_CHARS]


def _module_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    params = sorted(model.named_parameters(), key=lambda p: p[0])
    for name, p in params:
        h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
    real = [(name, p) for name, p in params if p.device.type != "meta" and p.numel()]
    step = max(1, len(real) // _SAMPLED_TENSORS)
    samples = []
    with torch.no_grad():
        for _, p in real[::step][:_SAMPLED_TENSORS]:
            flat = p.detach().reshape(-1)
            samples.append(flat[:: max(1, flat.numel() // _SAMPLED_VALUES)][:_SAMPLED_VALUES].float())
        if samples:
            h.update(torch.cat(samples).cpu().numpy().tobytes())
    return h.hexdigest()[:DIGEST_CHARS]


def _host(device: torch.device) -> dict[str, Any]:
    """What sets a step's cost besides the model and the graphs: the CPU, its cores and torch's threads, the
    accelerator where one runs the steps."""
    names = []
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    host = {"cpu": names[0] if names else platform.processor() or platform.machine(),
            "isa": device_capability(torch.device("cpu")), "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    if device.type != "cpu":
        host["accelerator"] = device_capability(device)
    return host


# --------------------------------------------------------------------------- the store


class LearningsStore:
    """Learnings as entries of the compile cache's folder (its file format and atomic writes, a JSON payload). A
    corrupt or mismatched entry warns once, naming the file and why, is removed and reads as a miss. ``cache``
    None: nothing is kept (the compile cache is off)."""

    def __init__(self, cache: CompileCache | None) -> None:
        self.cache = cache

    def path_for(self, key: CacheKey) -> Path | None:
        return None if self.cache is None else self.cache.path_for(key)

    def load(self, key: CacheKey) -> Learnings | None:
        path = self.path_for(key)
        if path is None:
            return None
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            log.info("learnings: none for %s (%s)", key.what, key.digest)
            return None
        except OSError as exc:
            return self._discard(path, f"unreadable ({exc})")
        try:
            learned = Learnings.from_json(decode_entry(blob, key))
        except (BadEntry, ValueError) as exc:
            return self._discard(path, str(exc))
        if learned.k_max != key.backend_options.get("k_max"):
            return self._discard(path, f"k_max={learned.k_max}, the key's is {key.backend_options.get('k_max')}")
        log.info("learnings: loaded %s (%s, %d drafts)", key.what, path, learned.drafts)
        return learned

    def save(self, key: CacheKey, learned: Learnings) -> Path | None:
        """Write ``learned`` under ``key`` (replacing what was there); None when nothing is kept."""
        path = self.path_for(key)
        if path is None:
            return None
        atomic_write(path, encode_entry(key, learned.to_json()))
        log.info("learnings: saved %s (%s, %d drafts)", key.what, path, learned.drafts)
        return path

    def _discard(self, path: Path, reason: str) -> None:
        self.cache.discard(path, reason, instead="learning afresh")
        return None
