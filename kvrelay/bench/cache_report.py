"""Tables, progress bar and plot of `kvrelay bench cache` (kept apart from the replay)."""

from __future__ import annotations

from pathlib import Path

from kvrelay.bench.stats import format_table

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


def policy_rows(payload: dict, group: str) -> tuple[list[str], list[list]]:
    """Block hit rate per policy and capacity, Belady first, the default marked
    with the share of the LRU-to-Belady gap it closes; on the host tier the
    partial-foresight oracles too, with their shares."""
    oracles = payload.get("oracles", []) if group == "policies" else []
    names = ["belady", *oracles, *payload["online_policies"]]
    default = payload["default_policy"]
    headers = ["pages", "infinite", *names]
    if group == "policies":
        headers += [f"{name} gap closed" for name in (*oracles, default)]
    rows = []
    for entry in payload["capacities"]:
        rates = entry[group]
        line = [entry["capacity_pages"], f"{payload['infinite']['block_hit_rate']:.3f}"]
        line += [f"{rates[n]['block_hit_rate']:.3f}" for n in names]
        if group == "policies":
            for name in (*oracles, default):
                closed = entry["gap_closed"][name]
                line.append("-" if closed is None else f"{closed:.2f}")
        rows.append(line)
    return headers, rows


def cost_rows(cost: dict) -> tuple[list[str], list[list]]:
    headers = ["policy", "collector", "ns/page looked up", "(min-max)", "ns/insert",
               "(min-max)", "lookup x", "(rounds)", "insert x", "(rounds)"]  # fmt: skip
    rows = []
    for name, on in cost.items():
        if not isinstance(on, dict):
            continue
        for label, c in (("on", on), ("paused", on["gc_off"])):
            rows.append([
                name, label, f"{c['ns_per_lookup']:.0f}",
                f"{c['ns_per_lookup_min']:.0f}-{c['ns_per_lookup_max']:.0f}",
                f"{c['ns_per_insert']:.0f}",
                f"{c['ns_per_insert_min']:.0f}-{c['ns_per_insert_max']:.0f}",
                f"{c['lookup_ratio']:.2f}",
                f"{c['lookup_ratio_min']:.2f}-{c['lookup_ratio_max']:.2f}",
                f"{c['insert_ratio']:.2f}",
                f"{c['insert_ratio_min']:.2f}-{c['insert_ratio_max']:.2f}",
            ])  # fmt: skip
    return headers, rows


def print_tables(payload: dict) -> None:
    entries = payload["capacities"]
    print(format_table(HEADERS, [row(e, payload["infinite"]) for e in entries]))
    print(f"\nhost tier (L2 only, {payload['servers']} servers), block hit rate per policy:")
    print(format_table(*policy_rows(payload, "policies")))
    if "policies_l3" in entries[0]:
        print(f"\nwith L3 ({payload['l3_pages']} pages), block hit rate per policy:")
        print(format_table(*policy_rows(payload, "policies_l3")))
        print()
        print(format_table(L3_HEADERS, [l3_row(e, payload["page_bytes"]) for e in entries]))
    cost = payload["index_cost"]
    print(f"\nindex cost per op at {cost['capacity_pages']} pages (median of {cost['rounds']}):")
    print(format_table(*cost_rows(cost)))


def plot(payload: dict, path: str | Path) -> None:
    """Block hit rate against L2 capacity: one line per policy, host tier solid,
    with L3 dashed, the per-worker caches dotted and the infinite cache flat."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter

    entries = payload["capacities"]
    caps = [e["capacity_pages"] for e in entries]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.axhline(payload["infinite"]["block_hit_rate"], color="k", ls="--", label="infinite")
    oracles = payload.get("oracles", [])
    names = ["belady", *oracles, *payload["online_policies"]]
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    for name in names:
        rates = [e["policies"][name]["block_hit_rate"] for e in entries]
        style = "^:" if name in oracles else "o-"
        ax.plot(caps, rates, style, color=colors[name], label=name)
        if "policies_l3" in entries[0] and name not in oracles:
            rates = [e["policies_l3"][name]["block_hit_rate"] for e in entries]
            ax.plot(caps, rates, "x--", color=colors[name], alpha=0.6,
                    label=f"{name} + L3 ({payload['l3_pages']} pages)")  # fmt: skip
    local = [e["local"]["block_hit_rate"] for e in entries]
    ax.plot(caps, local, ":", color="grey", label=f"local ({payload['workers']}, default)")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a short axis
    ax.set_xlabel(f"L2 capacity (pages, total over {payload['servers']} servers)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    ax.set_title(f"{Path(payload['trace']).name}: {payload['requests']} requests, "
                 f"default {payload['default_policy']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
