"""Figures for `kairos sim --plot DIR` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: Path, *, title: str, ttft_slo: float | None = None) -> None:
    """One empirical TTFT CDF per policy (log x axis), with the TTFT SLO as a vertical line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in ttfts.items():
        v = np.sort(np.asarray(values, dtype=np.float64))
        if v.size == 0:
            continue
        ax.step(np.maximum(v, 1e-4), np.arange(1, v.size + 1) / v.size, where="post", label=name,
                linestyle="--" if name == "lower bound" else "-")
    if ttft_slo is not None:
        ax.axvline(ttft_slo, color="grey", linewidth=0.8, linestyle=":", label=f"TTFT SLO {ttft_slo:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attainment_vs_load(sweep: Sequence[Mapping[str, Any]], path: Path, *, title: str) -> None:
    """SLO attainment and P95 TTFT per policy against the offered prefill load of each point."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names: list[str] = []
    for point in sweep:
        for name in point["policies"]:
            if name not in names:
                names.append(name)
    xs = [p["prefill_load"] if p.get("prefill_load") is not None else p["rate_scale"] for p in sweep]
    xlabel = "offered prefill load (1 = pool busy all the time)" if all(
        p.get("prefill_load") is not None for p in sweep) else "rate scale"
    for name in names:
        att = [p["policies"].get(name, {}).get("slo_attainment") for p in sweep]
        p95 = [p["policies"].get(name, {}).get("ttft_p95") for p in sweep]
        a1.plot(xs, [np.nan if v is None else v for v in att], marker="o", label=name)
        # an infinite P95 (more than 5 % rejected) is left off the log axis
        a2.plot(xs, [np.nan if v is None or not np.isfinite(v) else v for v in p95], marker="o", label=name)
    lb = [p["lower_bound"]["ttft_p95"] for p in sweep]
    a2.plot(xs, lb, linestyle="--", color="grey", label="lower bound")
    a1.set_ylabel("SLO attainment (TTFT and TBT)")
    a1.set_ylim(0, 1.02)
    a2.set_ylabel("P95 TTFT (s)")
    a2.set_yscale("log")
    for ax in (a1, a2):
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
