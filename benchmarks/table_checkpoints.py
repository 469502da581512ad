"""The checkpoint tables of benchmarks/README.md (benchmarks/checkpoint.py's rows) and README.md's summary of them.

Full checkpoints and checkpoints without the model weights: saves and resumes against the disk speed of their own
run, the disk probes, the loads' timelines, the checksums, building the optimizer's state.
"""

from __future__ import annotations

from typing import Any

from benchmarks.table_rows import NOT_COMPARABLE, Row, cell, number


def checkpoint_rows(all_rows: list[Row], lean: bool) -> tuple[list[Row], dict[str, list[dict[str, Any]]]]:
    """The rows of full checkpoints (or, ``lean``, of checkpoints without the model weights: ``model_weights:
    false``) shown for sync saves, async saves and resumes: each mode's rows of the newest day that measured it (each
    of that day's files: they may be different machines), and every such file's disk probes. Rows discarded by their
    ``code`` note are left out."""
    found = [r for r in all_rows if "-checkpoint-" in r.file]
    found = [r for r in found if not any(word in str(r.data.get("code", "")) for word in NOT_COMPARABLE)]
    mine = [r for r in found if (r.data.get("model_weights") is False) == lean]
    chosen: list[Row] = []
    for mode in ("sync", "async", "resume"):
        rows_of_mode = sorted((r for r in mine if r.data.get("mode") == mode), key=lambda r: (r.file, r.line))
        if rows_of_mode:
            newest = max(r.date for r in rows_of_mode)
            chosen += [r for r in rows_of_mode if r.date == newest]
    disks: dict[str, list[dict[str, Any]]] = {}
    for r in mine:
        if r.data.get("mode") == "disk":
            disks.setdefault(r.file, []).append(r.data)
    return chosen, disks


def checkpoint_table(all_rows: list[Row]) -> list[str]:
    """Checkpoint benchmark tables, of full checkpoints and of checkpoints without the model weights: each save and
    resume of :func:`checkpoint_rows` against the disk speed measured in its own file (the mean of its probes:
    before and after the saves, where both ran), the disk probes, the loads' timelines and the checksums."""
    out: list[str] = []
    for lean in (False, True):
        chosen, disks = checkpoint_rows(all_rows, lean)
        if chosen:
            files = {r.file for r in chosen}
            checks = [r for r in all_rows if r.file in files and r.data.get("mode") == "checksums"]
            out += checkpoint_file(chosen, disks, lean, checks)
    return out


def checkpoint_file(
    chosen: list[Row], disks: dict[str, list[dict[str, Any]]], lean: bool, checks: list[Row] | None = None
) -> list[str]:
    size = next((r.data["checkpoint_bytes"] for r in chosen if "checkpoint_bytes" in r.data), 0)
    title = "without the model weights (`save_model_weights=False`)" if lean else "full"
    out = [
        f"#### Checkpoints, {title} (benchmarks/checkpoint.py)",
        "",
        f"Checkpoint {number(size / 1e9)} GB. Each save's step blocked for `blocked`, against `step`, a training step "
        "of the same run without a save; `stage` builds the state and copies it to host buffers, `plan` plans (and "
        "for async saves hands the shards to the writer), `write` writes, checksums and publishes (sync). `x disk`: "
        "the save until published (a load from the disk) against the checkpoint's bytes at that run's disk speed "
        "(the mean of its probes, where it measured the disk before and after the saves). Save 0 is the first save "
        "of a fit. Loads from the disk (cold) and the page cache (warm).",
        "",
        *disk_table(chosen, disks),
        *optimizer_build(chosen),
        "| shape | mode | save | blocked s | step s | stage s | plan s | write s | published after s | load s | x disk "
        "| date | run | commit | device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in chosen:
        data, timeline = row.data, row.data.get("timeline", {})
        which = data.get("save", data.get("cache", "-"))
        if data["mode"] == "resume" and "read_threads" in data:
            threads = data["read_threads"] or "default"
            which = f"{which}, {threads} thread{'s' if threads != 1 else ''}"
        out.append(
            f"| {data.get('shape')} | {data['mode']} | {which} | {number(data.get('save_blocked_s'))} | "
            f"{number(data.get('normal_step_s'))} | {number(timeline.get('stage_s'))} | "
            f"{number(timeline.get('plan_s'))} | {number(timeline.get('write_s'))} "
            f"| {number(data.get('published_after_s'))} | {number(data.get('resume_load_s'))} | "
            f"{number(against_disk(data, disks.get(row.file, [])), 2)} | {row.date} | {run_label(row.file)} | "
            f"{row.commit or '-'} | {row.device} |"
        )
    out += ["", *load_timeline([r for r in chosen if r.data.get("mode") == "resume"])]
    return out + checksum_table(checks or [])


def disk_table(chosen: list[Row], disks: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The disk's speed (fsynced writes, then reads) in each run, each probe named where the run says when it ran."""
    files = sorted({r.file for r in chosen if r.file in disks})
    if not files:
        return []

    def probes(file: str, key: str) -> str:  # "1.75 (before), 1.61 (after)" where the probes say when they ran
        if not any(probe.get("probe") for probe in disks[file]):
            return ", ".join(number(probe.get(key), 2) for probe in disks[file])
        return ", ".join(f"{number(probe.get(key), 2)} ({probe.get('probe', '?')})" for probe in disks[file])

    first = {r.file: r for r in chosen}
    out = ["| run | disk write GB/s | disk read GB/s | date | commit | device |", "|---|---|---|---|---|---|"]
    for file in files:
        row = first[file]
        out.append(
            f"| {run_label(file)} | {probes(file, 'disk_write_gb_s')} | {probes(file, 'disk_read_gb_s')} | {cell(row)}"
        )
    return [*out, ""]


def checksum_table(checks: list[Row]) -> list[str]:
    """Checksumming the whole checkpoint (files in the page cache): recording, and verifying what a load reads."""
    if not checks:
        return []
    out = [
        "Checksums (`mode: checksums`): recording the CRC-32 of every 64 KiB block of the whole checkpoint and "
        "verifying them, on files in the page cache.",
        "",
        "| run | record s | verify s | record GB/s | verify GB/s | date | commit | device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in checks:
        data = row.data
        out.append(
            f"| {run_label(row.file)} | {number(data.get('checksum_record_s'))} | "
            f"{number(data.get('checksum_verify_s'))} | {number(data.get('checksum_record_gb_s'))} | "
            f"{number(data.get('checksum_verify_gb_s'))} | {cell(row)}"
        )
    return [*out, ""]


def run_label(file: str) -> str:
    """A checkpoint result file's run, as the end of its name says (``...-checkpoint-1b-c2.jsonl``: ``1b-c2``)."""
    return file.removesuffix(".jsonl").partition("-checkpoint-")[2] or file


def against_disk(data: dict[str, Any], probes: list[dict[str, Any]]) -> float | None:
    """A save until published, or a load, against the checkpoint's bytes at the disk's speed of the same run (the
    mean of its probes)."""
    if data.get("cache") == "warm":  # read from the page cache, not the disk
        return None
    seconds = data.get("resume_load_s") if data.get("mode") == "resume" else data.get("published_after_s")
    key = "disk_read_gb_s" if data.get("mode") == "resume" else "disk_write_gb_s"
    speeds = [probe[key] for probe in probes if probe.get(key)]
    speed = sum(speeds) / len(speeds) if speeds else None
    if not (isinstance(seconds, int | float) and speed and data.get("checkpoint_bytes")):
        return None
    return seconds / (data["checkpoint_bytes"] / 1e9 / speed)


def load_timeline(found: list[Row]) -> list[str]:
    """Where each load's time went (``CheckpointWriter.last_load``), for rows that recorded it."""
    loads = [r for r in found if r.data.get("timeline")]
    if not loads:
        return []
    parts = ("open_s", "state_s", "check_s", "verify_s", "read_s", "verify_after_read_s", "apply_s")
    out = [
        "Loads (`CheckpointWriter.last_load`, seconds): `state` builds the state to read into with its host buffers, "
        "`verify` checks what is read into the model, `read` is Megatron's load (the optimizer state's checksums "
        "verified meanwhile, where `verify after` is recorded), `apply` puts it into the model and optimizer.",
        "",
        "| cache | read threads | load | "
        + " | ".join(p.removesuffix("_s").replace("_", " ") for p in parts)
        + " | date | run | commit | device |",
        "|---|---|---|" + "---|" * len(parts) + "---|---|---|---|",
    ]
    for row in loads:
        data = row.data
        cells = [number(data["timeline"].get(p), 2) for p in parts]
        threads = data.get("read_threads", 1)  # rows without the field: Megatron's own reader
        if threads is None:  # the default: the read split into parts by the CPUs at hand
            threads = f"default ({data['timeline'].get('read_parts', '?')})"
        line = f"| {data.get('cache', '-')} | {threads} | {number(data.get('resume_load_s'))} | "
        end = f" | {row.date} | {run_label(row.file)} | {row.commit or '-'} | {row.device} |"
        out.append(line + " | ".join(cells) + end)
    return [*out, ""]


def optimizer_build(found: list[Row]) -> list[str]:
    """A sentence on building the distributed optimizer's state for a save: Megatron's own method against ours."""
    row = next((r for r in found if "megatron_optimizer_state_s" in r.data), None)
    if row is None:
        return []
    data = row.data
    return [
        f"Building the distributed optimizer's state for a save (run {run_label(row.file)}): Megatron's "
        f"`sharded_state_dict` (fully_reshardable) {number(data['megatron_optimizer_state_s'])} s, this package's "
        f"{number(data['optimizer_state_s'], 2)} s ({number(data['optimizer_state_first_s'])} s into new host "
        "buffers, which it allocates and pins).",
        "",
    ]


def span(values: list[float], digits: int) -> str:
    """``low-high`` of the values (one number when they agree at these digits), ``-`` for none."""
    if not values:
        return "-"
    low, high = number(min(values), digits), number(max(values), digits)
    return low if low == high else f"{low}-{high}"


def checkpoint_summary(all_rows: list[Row]) -> list[str]:
    """The README's checkpoint table: full checkpoints, the rows of :func:`checkpoint_rows` summed up per kind of
    save (first of a fit, later) and for resumes from the disk by 8 threads: how many, the ranges over them."""
    chosen, disks = checkpoint_rows(all_rows, lean=False)
    size = next((r.data["checkpoint_bytes"] for r in chosen if "checkpoint_bytes" in r.data), 0)
    kinds = {
        "sync save, first of a fit": ("sync", True),
        "sync save, later": ("sync", False),
        "async save, first of a fit": ("async", True),
        "async save, later": ("async", False),
        "resume from the disk, 8 threads": ("resume", None),
    }
    out = [
        f"| {number(size / 1e9)} GB checkpoint | saves | blocked s | step s | published after s | load s | x disk | "
        "date | commits | device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (mode, first) in kinds.items():
        found = [r for r in chosen if r.data["mode"] == mode]
        if first is None:  # resumes: read from the disk by 8 threads
            found = [r for r in found if r.data.get("cache") == "cold" and r.data.get("read_threads") == 8]
        else:
            found = [r for r in found if (r.data.get("save") == 0) == first]
        if not found:
            continue

        def values(key: str, found: list[Row] = found) -> list[float]:
            return [r.data[key] for r in found if isinstance(r.data.get(key), int | float)]

        ratios = [x for r in found if (x := against_disk(r.data, disks.get(r.file, []))) is not None]
        commits = ", ".join(dict.fromkeys(r.commit or "-" for r in found))
        dates = ", ".join(dict.fromkeys(r.date for r in found))
        devices = ", ".join(dict.fromkeys(r.device for r in found))
        out.append(
            f"| {name} | {len(found)} | {span(values('save_blocked_s'), 1)} | {span(values('normal_step_s'), 1)} | "
            f"{span(values('published_after_s'), 1)} | {span(values('resume_load_s'), 1)} | {span(ratios, 2)} | "
            f"{dates} | {commits} | {devices} |"
        )
    return out
