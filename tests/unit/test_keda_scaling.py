"""Replays a load curve through the scaling rule of the stage workers' KEDA ScaledObjects.

The parameters come from deploy/k8s/base/keda.yaml (the `dit` ScaledObject): polling interval,
cooldown, min/max replicas, the Prometheus trigger's threshold and activation threshold, and the
HPA behaviour (stabilisation windows, rate policies). The rule is KEDA's and the HPA's:
- KEDA polls the metric every pollingInterval. At zero replicas it activates (0 -> 1) as soon as
  the metric exceeds activationThreshold; once the metric stays at or below it for
  cooldownPeriod, it scales to minReplicaCount (0).
- Between 1 and maxReplicaCount the HPA decides every 15 s on the AverageValue target:
  desired = ceil(metric / threshold), left alone within the 10% tolerance, then bounded by the
  behaviour: scale-up takes the lowest recommendation of its window, scale-down the highest of
  its window (stabilisation), and each direction moves at most as fast as its policies allow.

The work is simulated second by second: stages arrive on the curve, wait on the queue, and a
ready worker runs up to `threshold` of them at once (its -c); a new worker is ready only after a
start-up delay (engines load); a worker being removed takes no new stage but finishes those it
runs (Celery's warm shutdown within terminationGracePeriodSeconds). Prometheus scrapes every 15 s.

The same curve is replayed with the metric a Redis list length would give (waiting stages only)
to show why the ScaledObjects read waiting + running: busy workers are scaled away, and at a
steady load the workers flap between zero and one. Run with -s to see the replicas over time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from omni_jobs.jobs.steps import STAGE_QUEUES

ROOT = Path(__file__).resolve().parents[2]
KEDA_YAML = ROOT / "deploy" / "k8s" / "base" / "keda.yaml"
HPA_SYNC_S = 15          # kube-controller-manager --horizontal-pod-autoscaler-sync-period
HPA_TOLERANCE = 0.1      # --horizontal-pod-autoscaler-tolerance
SCRAPE_S = 15            # Prometheus scrape interval of the API
STAGE_S = 20             # one DiT stage on a GPU, seconds
READY_S = 60             # a new worker loads its engines before it takes work
# Every stage queue has a ScaledObject of its own (Qwen2.5-Omni's talker and code2wav included).
SCALED_QUEUES = tuple(dict.fromkeys((*STAGE_QUEUES, "ar", "dit", "talker", "code2wav")))


@dataclass
class Rule:
    polling: int
    cooldown: int
    min_replicas: int
    max_replicas: int
    threshold: float
    activation: float
    up_window: int
    up_policies: list[dict]
    up_select: str
    down_window: int
    down_policies: list[dict]
    down_select: str

    @classmethod
    def from_manifest(cls, queue: str = "dit") -> Rule:
        docs = [d for d in yaml.safe_load_all(KEDA_YAML.read_text(encoding="utf-8")) if d]
        (so,) = [d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"].endswith(f"-{queue}")]
        spec = so["spec"]
        meta = spec["triggers"][0]["metadata"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        return cls(
            polling=spec.get("pollingInterval", 30), cooldown=spec.get("cooldownPeriod", 300),
            min_replicas=spec.get("minReplicaCount", 0), max_replicas=spec.get("maxReplicaCount", 100),
            threshold=float(meta["threshold"]), activation=float(meta.get("activationThreshold", 0)),
            up_window=behavior["scaleUp"].get("stabilizationWindowSeconds", 0),
            up_policies=behavior["scaleUp"]["policies"], up_select=behavior["scaleUp"].get("selectPolicy", "Max"),
            down_window=behavior["scaleDown"].get("stabilizationWindowSeconds", 300),
            down_policies=behavior["scaleDown"]["policies"], down_select=behavior["scaleDown"].get("selectPolicy", "Max"),
        )


@dataclass
class Worker:
    started: int
    running: list[int] = field(default_factory=list)   # finish times of the stages it runs
    leaving: bool = False


@dataclass
class Sim:
    rule: Rule
    metric_of: Callable[[int, int], float]              # (waiting, running) -> metric
    replicas: int = 0
    workers: list[Worker] = field(default_factory=list)
    waiting: deque = field(default_factory=deque)       # arrival times
    sample: float = 0.0
    last_active: int = 0
    recommendations: list[tuple[int, int]] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)   # (time, replica change)
    activations: int = 0
    waits: list[int] = field(default_factory=list)
    done: int = 0
    arrived: int = 0
    busy_removed: int = 0                               # running stages on workers told to leave
    short_scale_downs: list = field(default_factory=list)   # scale-downs below the work there is

    def running(self) -> int:
        return sum(len(w.running) for w in self.workers)

    def _set_replicas(self, t: int, n: int) -> None:
        if n == self.replicas:
            return
        self.events.append((t, n - self.replicas))
        if n > self.replicas:
            self.workers += [Worker(started=t) for _ in range(n - self.replicas)]
        else:
            work = len(self.waiting) + self.running()
            if n < min(math.ceil(work / self.rule.threshold), self.rule.max_replicas):
                self.short_scale_downs.append((t, self.replicas, n, len(self.waiting), self.running()))
            # The ReplicaSet deletes the newest pods first (not yet ready, fewer stages).
            staying = [w for w in self.workers if not w.leaving]
            for w in sorted(staying, key=lambda w: -w.started)[: self.replicas - n]:
                w.leaving = True
                self.busy_removed += len(w.running)
        self.replicas = n

    def _period_start(self, t: int, period: int) -> int:
        return self.replicas - sum(d for at, d in self.events if at > t - period)

    def _hpa(self, t: int) -> None:
        r = self.rule
        current = self.replicas
        ratio = (self.sample / current) / r.threshold
        raw = current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(self.sample / r.threshold)
        raw = min(max(raw, max(r.min_replicas, 1)), r.max_replicas)
        self.recommendations.append((t, raw))
        if raw > current:
            window = [n for at, n in self.recommendations if at > t - r.up_window] or [raw]
            desired = min(window)
            limits = []
            for p in r.up_policies:
                base = self._period_start(t, p["periodSeconds"])
                limits.append(base + p["value"] if p["type"] == "Pods" else math.ceil(base * (1 + p["value"] / 100)))
            limit = max(limits) if r.up_select == "Max" else min(limits)
            desired = min(desired, limit)
        elif raw < current:
            window = [n for at, n in self.recommendations if at > t - r.down_window] or [raw]
            desired = max(window)
            limits = []
            for p in r.down_policies:
                base = self._period_start(t, p["periodSeconds"])
                limits.append(base - p["value"] if p["type"] == "Pods" else math.ceil(base * (1 - p["value"] / 100)))
            limit = min(limits) if r.down_select == "Max" else max(limits)
            desired = max(desired, limit)
        else:
            desired = current
        self._set_replicas(t, max(desired, 1))

    def step(self, t: int, arrivals: int) -> None:
        r = self.rule
        for _ in range(arrivals):
            self.waiting.append(t)
        self.arrived += arrivals
        # Workers: finish stages, leave when drained, take stages when ready.
        for w in self.workers:
            finished = [f for f in w.running if f <= t]
            self.done += len(finished)
            w.running = [f for f in w.running if f > t]
        self.workers = [w for w in self.workers if not (w.leaving and not w.running)]
        for w in self.workers:
            if not w.leaving and t - w.started >= READY_S:
                while self.waiting and len(w.running) < r.threshold:
                    self.waits.append(t - self.waiting.popleft())
                    w.running.append(t + STAGE_S)
        if t % SCRAPE_S == 0:
            self.sample = self.metric_of(len(self.waiting), self.running())
        # KEDA: activation and scale to zero; the HPA in between.
        if t % r.polling == 0:
            active = self.sample > r.activation
            if active:
                self.last_active = t
            if self.replicas == 0 and active:
                self.activations += 1
                self._set_replicas(t, max(r.min_replicas, 1))
            elif self.replicas > 0 and not active and t - self.last_active >= r.cooldown:
                self._set_replicas(t, r.min_replicas)
        if self.replicas > 0 and t % HPA_SYNC_S == 0:
            self._hpa(t)


# Stages per second over time: idle, a burst, a short lull (shorter than the scale-down window),
# a steady load that two workers absorb, then idle until everything has drained.
CURVE = [
    (0, 120, 0.0),
    (120, 600, 3.0),
    (600, 780, 0.3),
    (780, 1380, 1.2),
    (1380, 2100, 0.0),
]
END = CURVE[-1][1]


def rate(t: int) -> float:
    return next(r for start, end, r in CURVE if start <= t < end)


def replay(metric_of: Callable[[int, int], float]) -> tuple[Sim, list[tuple]]:
    sim = Sim(Rule.from_manifest(), metric_of)
    rows, owed = [], 0.0
    for t in range(END):
        owed += rate(t)
        arrivals = int(owed)
        owed -= arrivals
        sim.step(t, arrivals)
        rows.append((t, rate(t), len(sim.waiting), sim.running(), sim.sample, sim.replicas))
    return sim, rows


@pytest.fixture(scope="module")
def replays():
    ours, ours_rows = replay(lambda waiting, running: waiting + running)
    llen, llen_rows = replay(lambda waiting, running: waiting)
    rule = ours.rule
    print(f"\nKEDA rule of deploy/k8s (dit): threshold {rule.threshold:g} stages/replica, activation > "
          f"{rule.activation:g}, replicas {rule.min_replicas}..{rule.max_replicas}, polling {rule.polling}s, "
          f"cooldown {rule.cooldown}s, scale-down window {rule.down_window}s; stage {STAGE_S}s, "
          f"worker ready after {READY_S}s")
    print(f"{'t(s)':>5} {'in/s':>5} | {'waiting':>7} {'running':>7} {'metric':>6} {'replicas':>8} | "
          f"{'waiting':>7} {'running':>7} {'LLEN':>6} {'replicas':>8}")
    print(f"{'':>11} | {'waiting + running (deploy/k8s)':^32} | {'waiting only (a Redis list length)':^33}")
    for a, b in zip(ours_rows, llen_rows):
        if a[0] % 60 == 0:
            print(f"{a[0]:>5} {a[1]:>5.1f} | {a[2]:>7} {a[3]:>7} {a[4]:>6.0f} {a[5]:>8} | "
                  f"{b[2]:>7} {b[3]:>7} {b[4]:>6.0f} {b[5]:>8}")
    return {"ours": (ours, ours_rows), "llen": (llen, llen_rows)}


def test_idle_queue_keeps_zero_workers_and_the_first_stage_wakes_one(replays):
    sim, rows = replays["ours"]
    assert all(r[5] == 0 for r in rows if r[0] < CURVE[1][0])
    woke = next(r[0] for r in rows if r[5] > 0)
    assert CURVE[1][0] <= woke <= CURVE[1][0] + SCRAPE_S + sim.rule.polling


def test_burst_scales_to_the_work_per_replica_within_bounds(replays):
    sim, rows = replays["ours"]
    assert max(r[5] for r in rows) <= sim.rule.max_replicas
    burst = [r for r in rows if CURVE[1][0] <= r[0] < CURVE[1][1]]
    peak_work = max(r[2] + r[3] for r in burst)
    needed = min(math.ceil(peak_work / sim.rule.threshold), sim.rule.max_replicas)
    assert needed >= 3, "the curve should need several workers"
    reached = next((r[0] for r in burst if r[5] >= needed), None)
    assert reached is not None and reached - CURVE[1][0] <= 240, f"reached {needed} replicas at {reached}"


def test_a_lull_shorter_than_the_scale_down_window_keeps_the_workers(replays):
    sim, rows = replays["ours"]
    start, end, _ = CURVE[2]
    assert end - start < sim.rule.down_window
    before = rows[start - 1][5]
    assert min(r[5] for r in rows if start <= r[0] < end) >= before


def test_workers_are_never_scaled_below_the_work_there_is(replays):
    """A scale-down leaves at least ceil((waiting + running) / threshold) workers. (A leaving worker
    finishes its stages: warm shutdown within terminationGracePeriodSeconds.)"""
    sim, _ = replays["ours"]
    assert not sim.short_scale_downs, f"(t, from, to, waiting, running): {sim.short_scale_downs}"
    assert any(d < 0 for _, d in sim.events[1:-1]), "the curve should make it scale down on the way"


def test_after_the_load_the_workers_scale_to_zero_after_the_cooldown(replays):
    sim, rows = replays["ours"]
    assert sim.done == sim.arrived and not sim.waiting and sim.running() == 0, "every stage ran"
    drained = next(r[0] for r in rows if r[0] >= CURVE[-1][0] and r[2] + r[3] == 0)
    zero = next(r[0] for r in rows if r[0] >= drained and r[5] == 0)
    assert zero - drained >= sim.rule.cooldown - sim.rule.polling - SCRAPE_S, "scaled to zero before the cooldown"
    assert zero - drained <= sim.rule.cooldown + 2 * sim.rule.polling + SCRAPE_S
    assert all(r[5] == 0 for r in rows if r[0] >= zero)
    assert sim.activations == 1, "one wake-up for one period of work"


def test_a_waiting_only_metric_scales_busy_workers_away_and_flaps(replays):
    ours, _ = replays["ours"]
    llen, _ = replays["llen"]
    assert llen.short_scale_downs, "the list length would scale workers away from work still running"
    assert llen.activations > ours.activations, "and wake from zero again and again under a steady load"
    p95 = lambda waits: sorted(waits)[int(0.95 * (len(waits) - 1))]
    assert p95(ours.waits) < p95(llen.waits), "and stages would wait longer"
    print(f"\nwaiting + running: {ours.activations} activation(s), {len(ours.short_scale_downs)} scale-downs below "
          f"the work, p95 queue wait {p95(ours.waits)} s; waiting only: {llen.activations} activations, "
          f"{len(llen.short_scale_downs)} scale-downs below the work, p95 queue wait {p95(llen.waits)} s")


@pytest.mark.parametrize("queue", SCALED_QUEUES)
def test_every_stage_queue_scales_by_the_rule_replayed_here(queue):
    """The replay reads the dit ScaledObject; every stage queue's own ScaledObject (its worker
    Deployment scaled apart from the others) sets the same rule, so what is shown holds for each."""
    assert Rule.from_manifest(queue) == Rule.from_manifest("dit"), f"{queue}: a scaling rule of its own"
