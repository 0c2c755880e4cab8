"""Tier settings, engines, daemons, and the configurations run over them.

Two tier settings, sized from the workload (workload.Shape) and the model's block bytes:
- host: the host tier holds every active user's history (1.3 x the working set; several times the
  GPU tier, as deployed); no disk tier.
- disk: a host tier of --disk-host-prompts prompts' worth (2) and a disk tier: the working set is larger than GPU + host,
  so a returning user's history is partly or wholly on disk, and prefetch for queued requests matters.
Every engine has the same GPU tier (3 prompts' worth), so the recompute-only engine keeps its own
GPU-tier prefix hits (the shared system prompt, a user's history while it is still resident).
"""

from __future__ import annotations

from dataclasses import dataclass

from e2e.workload import TPB, Shape


@dataclass(frozen=True, slots=True)
class TierSetting:
    name: str
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int  # 0: no disk tier


@dataclass(frozen=True, slots=True)
class EngineSpec:
    key: str
    daemon: str  # "" (none), "H" or "D"
    prefetch: int


@dataclass(frozen=True, slots=True)
class Config:
    label: str
    kind: str  # "mr" multi-round QA | "nr" no reuse | "lmb" LMBenchmark's client
    engines: tuple[str, ...]
    daemon: str
    setting: str  # "host" | "disk"
    rate_factor: float = 1.0  # x the common arrival rate


ENGINES = {
    "R": EngineSpec("R", "", 4),
    "H": EngineSpec("H", "H", 4),
    "P4": EngineSpec("P4", "D", 4),
    "P0": EngineSpec("P0", "D", 0),
}
DAEMON_SETTING = {"H": "host", "D": "disk"}

CONFIGS: dict[str, Config] = {
    "recompute": Config("recompute only (no service)", "mr", ("R",), "", "host"),
    "host": Config("service: host tier, prefetch 4", "mr", ("H",), "H", "host"),
    "disk_p4": Config("service: host + disk, prefetch 4", "mr", ("P4",), "D", "disk", 1.5),
    "disk_p0": Config("service: host + disk, prefetch 0", "mr", ("P0",), "D", "disk", 1.5),
    "no_reuse": Config("no reuse: engine alone vs with the service (host + disk)", "nr", ("R", "P4"), "D", "disk"),
    "lmb_completions": Config("LMBenchmark multi-round-qa.py, completions mode", "lmb", ("H",), "H", "host"),
    "lmb_chat": Config("LMBenchmark multi-round-qa.py, chat mode", "lmb", ("H",), "H", "host"),
}
RUN_ORDER = ["recompute", "host", "disk_p4", "disk_p0", "no_reuse", "lmb_completions", "lmb_chat"]


def tier_settings(shape: Shape, disk_host_prompts: float = 2.0) -> dict[str, TierSetting]:
    prompt_blocks = -(-(shape.prompt_len(shape.rounds - 1) + shape.answer) // TPB)
    ws_blocks = -(-shape.working_set_tokens() // TPB)
    gpu = 3 * prompt_blocks
    return {"host": TierSetting("host", gpu, ws_blocks * 13 // 10, 0),
            "disk": TierSetting("disk", gpu, int(disk_host_prompts * prompt_blocks), 2 * ws_blocks)}
