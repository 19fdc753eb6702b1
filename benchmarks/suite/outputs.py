"""A run's three files, ``<out>.json``, ``<out>.md`` and ``<out>.png``, all drawn from one dict (the
run's facts and its rows): the ratio of every row to the torch.compile uncapped row of the same
model (the ceiling), the markdown tables (throughput, the largest model per system, per-row details
and notes) and the bar chart. They are rewritten after every row, so a run cut short leaves what it
measured, and ``--merge`` redraws them from JSONs alone.
"""

from __future__ import annotations

import json
import os
import re

from .failures import short_error
from .scenarios import FLOPS_FORMULA, SEQ
from .size_search import cut_search


def ratios(rows: list[dict]) -> None:
    """tokens/s over the torch.compile uncapped row of the same model, batch and seq."""
    ceil = {
        (r["model"], r["batch"], r["seq"]): r["tokens_per_s"]
        for r in rows
        if r["system"] == "compile" and not r["cap_gib"] and r["tokens_per_s"]
    }
    for r in rows:
        c = ceil.get((r["model"], r["batch"], r["seq"]))
        r["ratio_to_ceiling"] = r["tokens_per_s"] / c if c and r["tokens_per_s"] else None


# ------------------------------------------------------------------------------------- formatting
def fmt_params(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def fmt_num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def fmt_error(e, n: int = 160) -> str:
    if not e:
        return ""
    e = " ".join(str(e).split()).replace("|", "/")
    return e if len(e) <= n else e[: n - 3] + "..."


def _notes(r: dict) -> str:
    resumed = "measured by an earlier device call of this command (--resume)"
    bits = [resumed] if r.get("resumed") else []
    if r.get("n_chunks"):
        bits.append(
            f"plan: {r['n_persist']}/{r['n_chunks']} chunks resident, chunk "
            f"{r['chunk_size'] / 2**20:.0f} MiB, n_buffer {r['n_buffer']}, "
            f"{r.get('offloaded_gib') or 0:.2f} GiB of fp32 parameters on the host"
        )
    planned_host = (r.get("plan_predicted") or {}).get("host_bytes")
    if planned_host is not None and r.get("host_peak_gib") is not None:
        bit = (
            f"host memory: plan {planned_host / 2**30:.1f} GiB pinned, process peak "
            f"{r['host_peak_gib']:.1f} GiB"
        )
        base = r.get("host_base_gib")
        if base is not None and planned_host:
            above = r["host_peak_gib"] - base
            err = (above * 2**30 - planned_host) / planned_host
            bit += f" ({above:.1f} above the {base:.1f} GiB before the build: {err:+.1%})"
        bits.append(bit)
    for a in r.get("replaced_attempts") or []:
        before = fmt_error(a["error"], 100) if a["error"] else f"{a['tokens_per_s']:,.0f} tokens/s"
        bits.append(f"L{a['layers']} measured again (--rerun-attempt); before: " + before)
    if r.get("first_try_error"):
        bits.append("ran again alone: " + fmt_error(r["first_try_error"], 120))
    if r.get("deepspeed"):
        bits.append(f"deepspeed {r['deepspeed']}")
    if r.get("torchao"):
        bits.append(f"torchao {r['torchao']}")
    return "; ".join(bits)


def row_host_gib(r: dict, out: dict) -> float | None:
    """The host memory (GiB, MemAvailable at start or --host-gib) of the machine the row ran on."""
    return r.get("host_gib") if r.get("host_gib") is not None else out.get("host_gib_for_checks")


def hosts_line(out: dict) -> str:
    """'Host: ...', or, for runs merged from machines that differ, each host with the runs made on
    it."""
    hosts: dict[str, list[str]] = {}
    for m in out.get("merged_from") or []:
        # one machine whatever was available at the start of each run (host_description)
        if m.get("host"):
            machine = re.sub(r" \([^)]*available at start\)", "", m["host"])
            hosts.setdefault(machine, []).append(os.path.basename(m["path"]))
    if len(hosts) <= 1:
        return f"Host: {next(iter(hosts), out['host'])}."
    return (
        "Hosts (rows carry theirs: `host` in the JSON, host GiB in the largest-model table): "
        + "; ".join(f"{h} ({', '.join(runs)})" for h, runs in hosts.items())
        + "."
    )


# ------------------------------------------------------------------------------------- the table
def markdown(out: dict) -> str:
    rows = out["rows"]
    lines = [
        f"# protrain-fx benchmark suite: {out['device']}, torch {out['torch']}, {out['date']}",
        "",
        f"Command: `python benchmarks/run.py {' '.join(out['argv'])}`",
        "",
        hosts_line(out),
        "",
    ]
    thr = [r for r in rows if r["scenario"] != "maxmodel"]
    if thr:
        lines += [
            "| scenario | system | model | params | cap GiB | batch x seq | tokens/s | "
            "TFLOP/s | peak GiB | ratio to ceiling | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in thr:
            lines.append(
                f"| {r['scenario']} | {r['system']} | {r['model']} | "
                f"{fmt_params(r['params'])} | {r['cap_gib'] or '-'} | "
                f"{r['batch']} x {r['seq']} | {fmt_num(r['tokens_per_s'], ',.0f')} | "
                f"{fmt_num(r['tflops'], '.1f')} | {fmt_num(r['peak_gib'], '.1f')} | "
                f"{fmt_num(r['ratio_to_ceiling'], '.2f')} | {fmt_error(r['error'])} |"
            )
    mx = [r for r in rows if r["scenario"] == "maxmodel"]
    if mx:
        lines += [""] if thr else []
        lines += [
            "Largest model each system trains on the whole device (GPT, depth doubling until "
            "the first failure; * = predicted from lower bounds, not run):",
            "",
            "| system | largest trained | params | batch x seq | tokens/s there | peak GiB | "
            "host GiB | first failure | attempts |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mx:
            ok = r["error"] is None
            ff = r.get("first_failure")
            fail = (
                f"L{ff['layers']} ({fmt_params(ff['params'])}): {fmt_error(ff['error'], 90)}"
                if ff
                else f"none (stopped: {r.get('search_stopped', '?')})"
            )
            tried = ", ".join(
                f"L{a['layers']} {'ok' if a['error'] is None else short_error(a['error'])}"
                for a in r.get("search", [])
            )
            lines.append(
                f"| {r['system']} | {r['model'] if ok else 'none'} | "
                f"{fmt_params(r['params']) if ok else '-'} | "
                f"{r['batch']} x {r['seq']} | {fmt_num(r['tokens_per_s'], ',.0f')} | "
                f"{fmt_num(r['peak_gib'], '.1f')} | "
                f"{fmt_num(row_host_gib(r, out), '.0f')} | "
                f"{fail if ok else fmt_error(r['error'], 90)} | {tried} |"
            )
    measured = [r for r in rows if r.get("step_ms")]
    if measured:
        lines += [
            "",
            "Details (step times over the timed steps; build and warm-up in seconds):",
            "",
            "| scenario | system | step ms median (min-max) | peak reserved GiB | "
            "build s | warm-up s | wall s | notes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in measured:
            lines.append(
                f"| {r['scenario']} | {r['system']} | {r['step_ms']:.0f} "
                f"({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) | "
                f"{fmt_num(r.get('peak_reserved_gib'), '.1f')} | "
                f"{fmt_num(r.get('build_s'), '.0f')} | "
                f"{fmt_num(r.get('warmup_s'), '.0f')} | "
                f"{fmt_num(r.get('wall_s'), '.0f')} | {_notes(r)} |"
            )
    lines += ["", "Notes:", "", *_run_notes(out, rows, mx)]
    if out.get("jobs", 1) > 1:
        lines.append(
            f"- Up to {out['jobs']} systems built and compiled side by side (--jobs); "
            + _SIDE_BY_SIDE
        )
    lines += [f"- {n}" for n in out.get("run_notes") or []]
    if out.get("plot_error"):
        lines.append(f"- The chart was not drawn: {out['plot_error']}")
    if out.get("merged_from"):
        srcs = [
            f"`{m['path']}` ({m['date']}, {m.get('device', '?')}, torch "
            f"{m.get('torch', '?')}: `python benchmarks/run.py {' '.join(m['argv'])}`)"
            for m in out["merged_from"]
        ]
        lines.append(
            "- Merged from: " + "; ".join(srcs) + ". Ratios recomputed over the merged rows."
        )
    return "\n".join(lines) + "\n"


_SIDE_BY_SIDE = (
    "timed steps never overlapped anything (benchmarks/timeshare.py): each system measured with no "
    "other one building, compiling or measuring, and no two systems holding model states in host "
    "memory alive at once (an offloading system is never measured next to another one's pinned "
    "memory). One untimed step after the wait re-fills the allocator's cache. An uncapped system "
    "sharing the device was capped at its memory claim; one that failed for memory next to others "
    "or under that claim, or whose allocator had to retry under it, ran again alone (`ran again "
    "alone` in the details). A system kept on the device may have been timed while one offloading "
    "system idled next to it (`alive_next_to_it` in the JSON); `--jobs 1` times every system with "
    "nothing else alive."
)


def _run_notes(out: dict, rows: list[dict], mx: list[dict]) -> list[str]:
    """The notes every table has: how systems were timed, what the columns mean, protrain's
    options."""
    llama = any(r["scenario"].startswith("llama") for r in rows)
    search = out.get("search")
    return [
        f"- Every system runs in its own process: {out['warmup']} warm-up steps (compilation "
        f"included), then {out['steps']} timed steps, each followed by a device synchronize; "
        "tokens/s = batch x seq / the median step time (maxmodel attempts: --search-warmup and "
        "--search-steps). bf16 compute, fp32 master weights, AdamW (lr 1e-4, weight decay 0.1).",
        "- cap = `torch.cuda.set_per_process_memory_fraction(cap / device memory)`; '-' = "
        "uncapped. peak = `torch.cuda.max_memory_allocated()` over the timed steps.",
        "- ratio to ceiling = tokens/s over the torch.compile (Inductor) uncapped row of the same "
        "model, batch and seq (empty when that row is absent or failed).",
        f"- TFLOP/s = tokens/s x {FLOPS_FORMULA}.",
        "- protrain: `options=" + json.dumps(out.get("protrain_options_shown", {})) + "` plus the "
        "optimizer: the automatic plan (profiled once, searched under the memory the process may "
        "use, the cap, less protrain's reserve); model built under `protrain_fx.host_init`.",
        "- compile_ac: torch.compile with `torch._functorch.config.activation_memory_budget = "
        f"{out['ac_budget']:g}`.",
        *(["- LLaMA scenarios: " + out["llama"] + "."] if llama else []),
        *(
            [
                f"- maxmodel: GPT of width {search['width']}, depth doubling from "
                f"{search['start']}, "
                f"batch {search['batch']} x {SEQ}, {search['warmup']} warm-up + "
                f"{search['steps']} timed steps per attempt; 'trains' = those steps ran without an "
                "error."
            ]
            if mx and search
            else []
        ),
        "- Rows marked `(predicted, not run)` were not started: the system's model states alone "
        "exceed the limit by lower bounds (device: 16 B/param for on-device AdamW, 8 for torchao, "
        "2 for ZeRO-2; host: 16-18 B/param offloaded, against MemAvailable at start; see "
        "benchmarks/peers.py). `--no-predict` runs them anyway.",
    ]


# ------------------------------------------------------------------------------------- the chart
def plot(out: dict, path: str) -> None:
    """Bars of tokens/s per system per scenario (errors named at the foot of their slot); the
    largest-model search, if present, as a second panel of parameters per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    thr = [r for r in rows if r["scenario"] != "maxmodel"]
    mx = [r for r in rows if r["scenario"] == "maxmodel"]
    panels = [p for p in (thr, mx) if p] or [[]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.8 * len(panels)), squeeze=False)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(systems)}
    for ax, panel in zip(axes[:, 0], panels):
        if panel is thr:
            _throughput_panel(ax, thr, systems, colors, out)
        elif panel is mx:
            _largest_model_panel(ax, mx, colors, out)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput_panel(ax, thr: list[dict], systems: list[str], colors: dict, out: dict) -> None:
    scen = list(dict.fromkeys(r["scenario"] for r in thr))
    width = 0.8 / max(1, len(systems))
    top = max([r["tokens_per_s"] or 0 for r in thr] + [1])
    for j, s in enumerate(systems):
        for i, sc in enumerate(scen):
            r = next((r for r in thr if r["system"] == s and r["scenario"] == sc), None)
            if r is None:
                continue
            xpos = i + (j - (len(systems) - 1) / 2) * width
            ax.bar(
                xpos,
                r["tokens_per_s"] or 0,
                width,
                color=colors[s],
                label=s if s not in ax.get_legend_handles_labels()[1] else None,
            )
            if r["error"]:
                ax.text(
                    xpos,
                    top * 0.01,
                    short_error(r["error"]),
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
            else:
                t = r["tokens_per_s"]
                label = f"{t / 1e3:.1f}k" if t >= 1e3 else f"{t:.0f}"
                if r["ratio_to_ceiling"]:
                    label += f" ({r['ratio_to_ceiling']:.2f})"
                ax.text(
                    xpos,
                    r["tokens_per_s"],
                    label,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    ax.set_xticks(
        range(len(scen)),
        [f"{sc}\n{next(r['model'] for r in thr if r['scenario'] == sc)}" for sc in scen],
        fontsize=8,
    )
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("tokens/s (ratio to the ceiling)")
    ax.set_title(f"Training throughput, {out['device']}, torch {out['torch']}, {out['date']}")
    ax.legend(fontsize=7, ncol=4, loc="upper right")


def _largest_model_panel(ax, mx: list[dict], colors: dict, out: dict) -> None:
    top = max([(r["params"] or 0) / 1e9 for r in mx if r["error"] is None] + [1])
    for i, r in enumerate(mx):
        ok = r["error"] is None
        ax.bar(i, r["params"] / 1e9 if ok else 0, color=colors[r["system"]])
        cut = (
            "\n(search cut short: a larger\nsize was not tried to the end)" if cut_search(r) else ""
        )
        ax.text(
            i,
            r["params"] / 1e9 if ok else top * 0.01,
            f"{fmt_params(r['params'])}\n{r['model']}{cut}" if ok else short_error(r["error"]),
            rotation=0 if ok else 90,
            ha="center",
            va="bottom",
            fontsize=7,
        )
    host = [row_host_gib(r, out) for r in mx]
    several = len(set(host)) > 1  # rows from machines with different host memory: say which
    ax.set_xticks(
        range(len(mx)),
        [r["system"] + (f"\nhost {h:.0f} GiB" if several and h else "") for r, h in zip(mx, host)],
        fontsize=8,
    )
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("largest model trained (B params)")
    ax.set_title(
        f"Largest GPT each system trains on the device (batch {mx[0]['batch']} x {mx[0]['seq']})"
    )


def write_outputs(out: dict, path: str, chart: bool = True) -> None:
    """<path>.json, .md and (``chart``) .png; a chart that cannot be drawn leaves ``plot_error`` in
    the JSON and the table."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ratios(out["rows"])
    if chart:
        out.pop("plot_error", None)
        try:
            plot(out, path + ".png")
        except Exception as e:  # noqa: BLE001 - the table and JSON still stand
            out["plot_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"plot failed: {out['plot_error']}", flush=True)
    for ext, text in ((".json", json.dumps(out, indent=2, default=str)), (".md", markdown(out))):
        with open(path + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ext + ".tmp", path + ext)
