"""The header every report carries: what was selected, totals, losses, unknowns.

DCPI's rule: a profile says how much it could not attribute. Every report
states lost samples and the unknown share, even when they are zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cyclescope.db.query import ProfileSet
from cyclescope.report.render import fmt_count

UNKNOWN_REASONS = {
    "no_process": "process with no known maps",
    "no_mapping": "address in no known mapping",
    "anon": "anonymous code without /tmp/perf-PID.map",
    "kernel": "kernel address outside kernel text",
    "other_mode": "hypervisor or guest mode",
}


@dataclass
class Summary:
    epochs: list[int]
    hosts: list[str]
    start_time: float
    end_time: float
    targets: list[str]
    totals: dict[str, int]  # samples per event in the selection (after filters)
    recorded: dict[str, int]  # samples per event before process/image filters
    mean_period: dict[str, float]
    time_based: dict[str, bool]
    running_fraction: dict[str, float | None]
    lost_records: int
    lost_samples: int
    throttles: int
    unknown: int
    unknown_reasons: dict[str, int]
    warnings: list[str] = field(default_factory=list)

    @property
    def recorded_total(self) -> int:
        return sum(self.recorded.values())

    @property
    def unknown_share(self) -> float:
        t = self.recorded_total
        return self.unknown / t if t else 0.0

    def lines(self, command: str) -> list[str]:
        out = [f"cyclescope {command}: {self._where()}"]
        parts = []
        for ev, n in self.totals.items():
            per = self.mean_period.get(ev, 0.0)
            unit = " ns" if self.time_based.get(ev) else " events"
            extra = f", mean period {per:,.0f}{unit}" if per else ""
            rf = self.running_fraction.get(ev)
            if rf is not None and rf < 0.999:
                extra += f", counted {rf * 100:.0f}% of the time (multiplexed with other events)"
            parts.append(f"{ev} {fmt_count(n)}{extra}")
        out.append("Samples: " + ("; ".join(parts) if parts else "none"))
        lost = self.lost_records + self.lost_samples
        unk = f"{fmt_count(self.unknown)} ({self.unknown_share * 100:.2f}%)"
        if self.unknown_reasons:
            unk += " - " + ", ".join(
                f"{UNKNOWN_REASONS.get(k, k)}: {fmt_count(v)}" for k, v in sorted(self.unknown_reasons.items())
            )
        line = f"Lost: {fmt_count(lost)} samples"
        if self.throttles:
            line += f" ({self.throttles} throttle periods)"
        out.append(f"{line} · Unknown: {unk}")
        return out

    def _where(self) -> str:
        ep = self.epochs
        eps = f"epoch {ep[0]}" if len(ep) == 1 else f"epochs {', '.join(map(str, ep))}"
        hosts = f"host {', '.join(self.hosts)}" if self.hosts else "no hosts"
        when = ""
        if self.start_time:
            a = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start_time))
            b = time.strftime("%H:%M:%S", time.localtime(self.end_time)) if self.end_time else "?"
            when = f" · {a} to {b} ({max(0.0, self.end_time - self.start_time):.1f} s)"
        return f"{eps} · {hosts}{when}"

    def to_json(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs, "hosts": self.hosts, "start_time": self.start_time, "end_time": self.end_time,
            "targets": self.targets, "samples": self.totals, "recorded_samples": self.recorded,
            "mean_period": self.mean_period, "running_fraction": self.running_fraction,
            "lost_records": self.lost_records, "lost_samples": self.lost_samples, "throttles": self.throttles,
            "unknown_samples": self.unknown, "unknown_share": self.unknown_share,
            "unknown_reasons": self.unknown_reasons, "warnings": self.warnings,
        }


def summarize(profile_set: ProfileSet, totals: dict[str, int]) -> Summary:
    evs = profile_set.event_names
    return Summary(
        epochs=profile_set.epochs, hosts=profile_set.hosts, start_time=profile_set.start_time,
        end_time=profile_set.end_time, targets=profile_set.targets,
        totals=totals,
        recorded={e: profile_set.events[e].samples for e in evs},
        mean_period={e: profile_set.events[e].mean_period for e in evs},
        time_based={e: profile_set.events[e].time_based for e in evs},
        running_fraction={e: profile_set.events[e].running_fraction for e in evs},
        lost_records=profile_set.lost_records, lost_samples=profile_set.lost_samples,
        throttles=sum(profile_set.events[e].throttles for e in evs),
        unknown=sum(profile_set.unknown.values()), unknown_reasons=dict(profile_set.unknown),
        warnings=list(profile_set.warnings),
    )
