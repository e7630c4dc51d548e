"""Event names, their perf_event types, and sampling periods.

Pure: parsing ``-e`` specifications and turning a rate into a period.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace

from cyclescope.errors import UsageError
from cyclescope.perf.abi import (
    HW_CACHE_DTLB,
    HW_CACHE_ITLB,
    HW_CACHE_L1I,
    HW_CACHE_OP_READ,
    HW_CACHE_RESULT_MISS,
    EventType,
    HwId,
    SwId,
    hw_cache_config,
)

# Hard ceiling per CPU on these VMs: 100 kHz soft-locked a CPU; 20 kHz costs the
# target about 60%. Above this we refuse unless forced.
SAFE_MAX_RATE_HZ = 20_000
DEFAULT_BAND = 1 / 16  # DCPI: periods uniform in [60K, 64K] for a 64K nominal period


@dataclass(frozen=True)
class EventSpec:
    name: str
    type: int
    config: int
    time_based: bool  # the period is nanoseconds
    hardware: bool
    default_period: int  # used when no rate is given (events per sample)
    exclude_user: bool = False
    exclude_kernel: bool = False
    period: int | None = None  # explicit /period=N/

    @property
    def label(self) -> str:
        suffix = ""
        if self.exclude_kernel and not self.exclude_user:
            suffix = ":u"
        elif self.exclude_user and not self.exclude_kernel:
            suffix = ":k"
        return self.name + suffix


_KNOWN: dict[str, EventSpec] = {
    "cpu-clock": EventSpec("cpu-clock", EventType.SOFTWARE, SwId.CPU_CLOCK, True, False, 200_000),
    "task-clock": EventSpec("task-clock", EventType.SOFTWARE, SwId.TASK_CLOCK, True, False, 200_000),
    "page-faults": EventSpec("page-faults", EventType.SOFTWARE, SwId.PAGE_FAULTS, False, False, 100),
    "context-switches": EventSpec("context-switches", EventType.SOFTWARE, SwId.CONTEXT_SWITCHES, False, False, 10),
    "cycles": EventSpec("cycles", EventType.HARDWARE, HwId.CPU_CYCLES, False, True, 600_000),
    "instructions": EventSpec("instructions", EventType.HARDWARE, HwId.INSTRUCTIONS, False, True, 600_000),
    "cache-references": EventSpec("cache-references", EventType.HARDWARE, HwId.CACHE_REFERENCES, False, True, 20_011),
    "cache-misses": EventSpec("cache-misses", EventType.HARDWARE, HwId.CACHE_MISSES, False, True, 5_003),
    "branches": EventSpec("branches", EventType.HARDWARE, HwId.BRANCH_INSTRUCTIONS, False, True, 100_003),
    "branch-misses": EventSpec("branch-misses", EventType.HARDWARE, HwId.BRANCH_MISSES, False, True, 5_003),
    "ref-cycles": EventSpec("ref-cycles", EventType.HARDWARE, HwId.REF_CPU_CYCLES, False, True, 600_000),
    "l1i-misses": EventSpec(
        "l1i-misses", EventType.HW_CACHE, hw_cache_config(HW_CACHE_L1I, HW_CACHE_OP_READ, HW_CACHE_RESULT_MISS),
        False, True, 2_003,
    ),
    "dtlb-misses": EventSpec(
        "dtlb-misses", EventType.HW_CACHE, hw_cache_config(HW_CACHE_DTLB, HW_CACHE_OP_READ, HW_CACHE_RESULT_MISS),
        False, True, 2_003,
    ),
    "itlb-misses": EventSpec(
        "itlb-misses", EventType.HW_CACHE, hw_cache_config(HW_CACHE_ITLB, HW_CACHE_OP_READ, HW_CACHE_RESULT_MISS),
        False, True, 2_003,
    ),
}
_ALIASES = {
    "cpu-cycles": "cycles", "clock": "cpu-clock", "faults": "page-faults", "cs": "context-switches",
    "branch-instructions": "branches", "imiss": "l1i-misses", "icache-misses": "l1i-misses",
    "L1-icache-load-misses": "l1i-misses", "dTLB-load-misses": "dtlb-misses", "iTLB-load-misses": "itlb-misses",
}

KNOWN_EVENTS = tuple(_KNOWN)

_SPEC_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(?:/(?P<terms>[^/]*)/)?(?::(?P<mods>[uk]+))?$")


def parse_event(text: str) -> EventSpec:
    """``name``, ``name:u``, ``name:k``, ``name/period=N/``."""
    m = _SPEC_RE.match(text.strip())
    if not m:
        raise UsageError(f"cannot parse event '{text}' (expected NAME, NAME:u, NAME:k or NAME/period=N/)")
    name = _ALIASES.get(m["name"], m["name"])
    spec = _KNOWN.get(name)
    if spec is None:
        raise UsageError(f"unknown event '{m['name']}'; known events: {', '.join(KNOWN_EVENTS)}")
    if m["terms"]:
        for term in m["terms"].split(","):
            key, _, val = term.partition("=")
            if key.strip() != "period":
                raise UsageError(f"event '{text}': unknown term '{key}' (only period=N)")
            try:
                p = int(val, 0)
            except ValueError:
                raise UsageError(f"event '{text}': period must be an integer") from None
            if p <= 0:
                raise UsageError(f"event '{text}': period must be positive")
            spec = replace(spec, period=p)
    mods = m["mods"] or ""
    if mods:
        spec = replace(spec, exclude_kernel="k" not in mods, exclude_user="u" not in mods)
    return spec


def parse_events(texts: list[str]) -> list[EventSpec]:
    out: list[EventSpec] = []
    for t in texts:
        for part in _split_events(t):
            spec = parse_event(part)
            if any(s.label == spec.label for s in out):
                raise UsageError(f"event '{spec.label}' given twice")
            out.append(spec)
    return out


def _split_events(text: str) -> list[str]:
    """Split on commas that are not inside /terms/."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "/":
            depth ^= 1
        if ch == "," and not depth:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in (x.strip() for x in parts) if p]


def nominal_period(spec: EventSpec, rate_hz: float | None, cpu_hz: float, band: float = 0.0) -> int:
    """The top of the period band, for a wanted mean rate per CPU.

    Periods are drawn uniformly from [P(1-band), P], whose mean is P(1-band/2):
    P is chosen so that the mean rate is the one asked for, as ``perf -F``'s is.
    """
    if spec.period is not None:
        return spec.period
    if rate_hz is None:
        return spec.default_period
    mean_to_top = 1.0 / (1.0 - band / 2)
    if spec.time_based:
        return max(1, round(1e9 / rate_hz * mean_to_top))
    if spec.config in (HwId.CPU_CYCLES, HwId.REF_CPU_CYCLES, HwId.INSTRUCTIONS) and spec.type == EventType.HARDWARE:
        return max(1, round(cpu_hz / rate_hz * mean_to_top))
    return spec.default_period  # rare events: a rate is not meaningful


def max_rate_hz(spec: EventSpec, period: int, band: float, cpu_hz: float) -> float | None:
    """Highest sample rate per CPU this period can produce (None when not bounded by time)."""
    shortest = period * (1 - band)
    if spec.time_based:
        return 1e9 / max(shortest, 1)
    if spec.config in (HwId.CPU_CYCLES, HwId.REF_CPU_CYCLES) and spec.type == EventType.HARDWARE:
        return cpu_hz / max(shortest, 1)
    if spec.config == HwId.INSTRUCTIONS and spec.type == EventType.HARDWARE:
        return 4 * cpu_hz / max(shortest, 1)  # up to ~4 instructions per cycle
    return None


class PeriodRandomizer:
    """DCPI's randomized period: uniform in [nominal*(1-band), nominal], re-drawn as sampling goes."""

    def __init__(self, nominal: int, band: float = DEFAULT_BAND, seed: int | None = None) -> None:
        if not 0 <= band < 1:
            raise UsageError("the randomization band must be in [0, 1)")
        self.nominal = nominal
        self.low = max(1, int(nominal * (1 - band)))
        self._rng = random.Random(seed)

    def draw(self) -> int:
        if self.low >= self.nominal:
            return self.nominal
        return self._rng.randint(self.low, self.nominal)

    @property
    def mean(self) -> float:
        return (self.low + self.nominal) / 2


def cpu_hz(cpuinfo: str | None = None) -> float:
    """Nominal CPU clock from /proc/cpuinfo (for converting rates to cycle periods)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("cpu MHz"):
            try:
                return float(line.split(":")[1]) * 1e6
            except (IndexError, ValueError):
                break
    return 2.0e9
