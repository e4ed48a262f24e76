"""The markdown table of bench_streaming.py: figures, ratios, goals, versions, load and failures.

Runs in: the benchmark's driver, after the run; never imported by dask_ddp.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from importlib import metadata

NAMES = {
    "ours": "ours: dask_ddp StreamingDataset", "litdata": "LitData StreamingDataset", "wds": "WebDataset",
    "mosaic": "Mosaic Streaming", "folder": "dask_ddp S3ImageFolder (a GET per image)",
    "raw": "ours, no decoding (the I/O path)", "floor": "build floor: the source images' GETs alone, 2 processes",
    "ceiling": "byte ceiling: s3fs cat of the shards, 2 processes, no decoding",
    "decode": "decode ceiling: the same tensors from memory, a batch in one decode_jpeg call, 2 processes",
}
PEERS = ("litdata", "wds", "mosaic")


def _versions() -> str:
    names = ["torch", "torchvision", "litdata", "webdataset", "mosaicml-streaming", "s3fs", "moto", "dask",
             "distributed", "pillow", "numpy"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), check=False).stdout.strip()
    except OSError:
        rev = "?"
    return f"python {platform.python_version()}, dask-ddp at {rev}, " + ", ".join(found)


def _median(report: dict, system: str, key: str) -> float | None:
    values = report["rates"].get(system, {}).get(key)
    return statistics.median(values) if values else None


def _cell(report: dict, system: str, key: str) -> str:
    values = report["rates"].get(system, {}).get(key)
    if not values:
        return "-"
    rounds = " / ".join(f"{v:,.0f}" for v in values)
    return f"**{statistics.median(values):,.0f}** ({rounds})" if len(values) > 1 else f"**{values[0]:,.0f}**"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def _goal(name: str, value: float | None, goal: float) -> str:
    if value is None:
        return f"- {name}: not measured (goal >= {goal}x)"
    return f"- {name}: {value:.2f}x (goal >= {goal}x: {'met' if value >= goal else 'NOT met'})"


def render(report: dict) -> str:
    """The whole results section for one run, as markdown."""
    args, rates = report["args"], report["rates"]
    cold = {s: _median(report, s, "cold") for s in rates}
    peers_cold = {s: cold[s] for s in PEERS if cold.get(s)}
    best = max(peers_cold, key=peers_cold.get) if peers_cold else None
    ceiling = cold.get("ceiling")
    lines = [
        f"## Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        f"Command: `{' '.join(['python'] + report['argv'])}`", "",
        f"Machine: {os.cpu_count()} cpus, shared with other agents; load average (1 min) at start and per round: "
        + ", ".join(f"{x:.1f}" for x in report["load"]) + ".", "",
        f"Versions: {_versions()}.", "",
        f"Data: {args.images:,} JPEGs of {args.size}x{args.size} in 10 classes, "
        f"{report.get('total_bytes', 0) / 1e6:.1f} MB "
        f"({report.get('total_bytes', 0) / max(args.images, 1) / 1e3:.1f} KB each), shard size "
        f"{report.get('shard_bytes', 0) / 1e6:.2f} MB for every system; moto S3 server on 127.0.0.1 in its own "
        "process. "
        f"Readers: 2 ranks (gloo) x 2 DataLoader workers, batch {args.batch}, the tensors of PIL decode + ToTensor "
        f"in the workers (the peers: {'PIL + ToTensor' if getattr(args, 'decoder', 'pil') == 'pil' else 'decode_jpeg'}"
        " per sample; ours: its loader with transform=to_tensor, a step's JPEGs in one decode_jpeg call); "
        f"{args.repeat} round(s), median first, then each round. The 2nd epoch reads each system's cache.", "",
        "### Shard build", "",
        "| system | seconds | images/s | shards |", "|---|---:|---:|---:|",
    ]
    for system, b in report["build"].items():
        secs = b["seconds"]
        lines.append(f"| {NAMES[system]} | {f'{secs:.1f}' if secs else 'untimed'} | "
                     f"{f'{args.images / secs:,.0f}' if secs else '-'} | {b['shards'] or '-'} |")
    lines += ["", "### Read: images/s", "",
              f"| system | cold epoch | 2nd epoch | cold vs best peer ({best or '-'}) | cold vs byte ceiling |",
              "|---|---:|---:|---:|---:|"]
    for system in ("ours", "raw", "litdata", "wds", "mosaic", "folder", "ceiling", "decode"):
        if system in rates:
            lines.append(f"| {NAMES[system]} | {_cell(report, system, 'cold')} | {_cell(report, system, 'warm')} | "
                         f"{_ratio(cold[system], cold.get(best)) if best else '-'} | {_ratio(cold[system], ceiling)} |")
    if "ceiling_of" in report:
        lines += ["", f"The byte ceiling reads {report['ceiling_of']}'s shard objects: "
                  f"{report['ceiling_mbs']:.0f} MB/s "
                  "in the last round, given as images/s (all images' shards / seconds)."]
    lines += ["", "### Goals (issue 28)", ""]
    builds = report["build"]
    speed = (builds["litdata"]["seconds"] / builds["ours"]["seconds"]
             if builds.get("ours", {}).get("seconds") and builds.get("litdata", {}).get("seconds") else None)
    lines += [
        _goal("ours cold vs best peer cold",
              cold["ours"] / peers_cold[best] if cold.get("ours") and best else None, 1.5),
        _goal("ours cold vs byte ceiling", cold["ours"] / ceiling if cold.get("ours") and ceiling else None, 0.9),
        _goal("shard build speed, ours vs LitData optimize (2 workers each)", speed, 2.0),
    ]
    raw, decode, floor = cold.get("raw"), cold.get("decode"), builds.get("floor", {}).get("seconds")
    bounds = []
    if raw and ceiling:
        bounds.append(f"- ours without decoding vs byte ceiling: {raw / ceiling:.2f}x (the I/O path alone)")
    if decode:
        bounds.append(f"- decode ceiling vs best peer cold: {_ratio(decode, peers_cold.get(best))}; ours cold vs "
                      f"decode ceiling: {_ratio(cold.get('ours'), decode)}")
    if floor and builds.get("litdata", {}).get("seconds"):
        bounds.append(f"- build floor vs LitData optimize: {builds['litdata']['seconds'] / floor:.2f}x (the most any "
                      f"builder of these S3 objects could gain); ours vs the floor: "
                      f"{_ratio(floor, builds.get('ours', {}).get('seconds'))}")
    if bounds:
        lines += ["", "Bounds on this machine:", ""] + bounds
    if report.get("notes"):
        lines += ["", "### Notes", ""] + [f"- {n}" for n in report["notes"]]
    if report["errors"]:
        lines += ["", "### Failed", ""] + [f"- {NAMES[s].split(':')[0]}: {e}" for s, e in report["errors"].items()]
    missing = [s for s in report["systems"] if s not in rates and s not in report["errors"] and s not in builds]
    if missing:
        lines += ["", "Not run: " + ", ".join(missing)]
    return "\n".join(lines) + "\n\n"
