"""Tables, progress bar and plot of `kvrelay bench cache` (kept apart from the replay)."""

from __future__ import annotations

from pathlib import Path

HEADERS = ["pages", "GiB", "infinite", "local", "shared", "shared/inf", "shared tok",
           "+L3", "+L3/inf", "+L3 tok", "pulled GiB"]  # fmt: skip
L3_HEADERS = ["pages", "L2 hit pages", "L3 hit pages", "promotions", "demotions",
              "clean evictions", "L2 pulled GiB", "L3 in GiB", "L3 out GiB", "checksum fail",
              "wrong"]  # fmt: skip


def gib(n: int) -> str:
    return f"{n / (1 << 30):.0f}"


def row(entry: dict, infinite: dict) -> list:
    inf = infinite["block_hit_rate"]
    shared = entry["shared"]
    l3 = entry.get("shared_l3")
    best = l3 or shared
    return [
        entry["capacity_pages"],
        gib(entry["capacity_bytes"]),
        f"{inf:.3f}",
        f"{entry['local']['block_hit_rate']:.3f}",
        f"{shared['block_hit_rate']:.3f}",
        f"{shared['block_hit_rate'] / inf:.3f}" if inf else "-",
        f"{shared['token_hit_rate']:.3f}",
        f"{l3['block_hit_rate']:.3f}" if l3 else "-",
        f"{l3['block_hit_rate'] / inf:.3f}" if l3 and inf else "-",
        f"{l3['token_hit_rate']:.3f}" if l3 else "-",
        gib(best["bytes_pulled"]),
    ]


def l3_row(entry: dict, page_bytes: int) -> list:
    l3 = entry["shared_l3"]
    return [
        entry["capacity_pages"],
        l3["l2_hit_pages"],
        l3["l3_hit_pages"],
        l3["l3_promotions"],
        l3["l3_demotions"],
        l3["l3_clean_evictions"],
        gib(l3["l2_hit_pages"] * page_bytes),
        gib(l3["l3_bytes_demoted"]),
        gib(l3["l3_bytes_promoted"]),
        l3["l3_checksum_failures"],
        l3["wrong_pages"],
    ]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, disabled: bool):
    if disabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="replay", unit="req", mininterval=0.5)


def plot(payload: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter

    caps = [e["capacity_pages"] for e in payload["capacities"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(payload["infinite"]["block_hit_rate"], color="k", ls="--", label="infinite")
    l3_label = f"shared + L3 of {payload['l3_pages']} pages"
    for policy, label in (("shared_l3", l3_label), ("shared", "shared"), ("local", "local")):
        if policy not in payload["capacities"][0]:
            continue
        count = payload["workers" if policy == "local" else "servers"]
        rates = [e[policy]["block_hit_rate"] for e in payload["capacities"]]
        ax.plot(caps, rates, "o-", label=f"{label} ({count})")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a short axis
    ax.set_xlabel("L2 capacity (pages, total)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(f"{Path(payload['trace']).name}: {payload['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
