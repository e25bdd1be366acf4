"""``omni-jobs doctor``: every check of omni_jobs.dispatch.checks in one report, printed or as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.checks import (
    Check,
    check_artifact_store,
    check_devices,
    check_redis,
    check_versions,
    check_workers,
    describe_backend,
    probe_backend,
    required_queues,
)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks if c.required)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.required and not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [c.as_dict() for c in self.checks]}


def run_doctor(settings: Settings, *, services: bool = True, devices: bool = True) -> DoctorReport:
    """Versions, devices, Redis, broker, artifact store and workers, as `omni-jobs doctor` prints them."""
    from omni_jobs.core.redis_clients import redis_client

    report = DoctorReport()
    report.checks += check_versions(overrides=settings.supported_versions)
    if devices:
        report.checks += check_devices(settings.device)
    if not services:
        return report
    state = redis_client(settings.redis_url, socket_connect_timeout=2, socket_timeout=5)
    try:
        redis_check = check_redis(state, url=settings.redis_url, wait_aof=settings.redis_wait_aof)
        report.checks.append(redis_check)
        if settings.effective_broker_url != settings.redis_url:
            broker = redis_client(settings.effective_broker_url, setting="OMNI_BROKER_URL", socket_connect_timeout=2,
                                  socket_timeout=5)
            try:
                report.checks.append(check_redis(broker, name="broker", url=settings.effective_broker_url))
            finally:
                broker.close()
        report.checks.append(check_artifact_store(probe_backend(settings), where=describe_backend(settings)))
        try:
            from omni_jobs.pipelines.catalogue import load_catalogue

            catalogue = load_catalogue(settings.pipelines_path)
        except Exception as exc:  # noqa: BLE001 - a bad pipeline file is one more finding
            report.checks.append(Check("pipelines", "catalogue", False, str(exc), "fix the pipeline file named above"))
            return report
        report.checks.append(Check("pipelines", "catalogue", True, ", ".join(catalogue.names()), required=False))
        if redis_check.ok:
            report.checks += check_workers(state, required_queues(catalogue, settings))
    finally:
        state.close()
    return report


def format_report(report: DoctorReport) -> str:
    lines: list[str] = []
    section = ""
    for check in report.checks:
        if check.section != section:
            section = check.section
            lines.append(f"{section}:")
        mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
        lines.append(f"  {mark} {check.name:<16} {check.detail}")
        if not check.ok and check.fix:
            lines.append(f"       -> {check.fix}")
    failed = report.failed()
    lines.append("")
    lines.append("all checks passed" if not failed else f"{len(failed)} check(s) failed: "
                 + ", ".join(f"{c.section}/{c.name}" for c in failed))
    return "\n".join(lines)
