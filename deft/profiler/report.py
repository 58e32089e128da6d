"""Human report of a profile: a per-bucket table (markdown) and a timeline picture.

The coverage rate of a bucket is ``CR = comm / (forward + backward)`` (paper, Table I): above 1 its
communication cannot be hidden behind its own computation.
"""

from __future__ import annotations

from pathlib import Path

from deft.profile import Profile


def bucket_table(profile: Profile) -> str:
    """Markdown table: one row per bucket, then the totals row."""
    links = profile.link_names
    head = ["bucket", "params", "numel", "MB", "forward ms", "backward ms", *[f"comm {k} ms" for k in links], "CR"]
    rows = [head, ["---"] * len(head)]
    for b, t in zip(profile.buckets, profile.times, strict=True):
        comm = [profile.comm_time(b.id, k) for k in links]
        compute = t.forward_s + t.backward_s
        cr = comm[0] / compute if compute > 0 else float("inf")
        names = ", ".join(b.params[:2]) + (f" (+{len(b.params) - 2})" if len(b.params) > 2 else "")
        rows.append([str(b.id), names or "-", str(b.numel), f"{b.nbytes / 2**20:.2f}", f"{t.forward_s * 1e3:.3f}",
                     f"{t.backward_s * 1e3:.3f}", *[f"{c * 1e3:.3f}" for c in comm], f"{cr:.2f}"])
    totals = [profile.total_comm_s(k) for k in links]
    rows.append(["total", "", str(sum(b.numel for b in profile.buckets)),
                 f"{sum(b.nbytes for b in profile.buckets) / 2**20:.2f}", f"{profile.forward_s * 1e3:.3f}",
                 f"{profile.backward_s * 1e3:.3f}", *[f"{c * 1e3:.3f}" for c in totals],
                 f"{profile.coverage_rate:.2f}"])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def link_table(profile: Profile) -> str:
    rows = ["| link | backend | NIC | alpha (us) | beta (ns/byte) | GB/s |", "| --- | --- | --- | --- | --- | --- |"]
    for k in profile.links:
        bw = f"{1 / k.beta_s_per_byte / 1e9:.3f}" if k.beta_s_per_byte > 0 else "- (no size trend measured)"
        rows.append(f"| {k.name} | {k.backend} | {k.ifname or '-'} | {k.alpha_s * 1e6:.1f} | "
                    f"{k.beta_s_per_byte * 1e9:.3f} | {bw} |")
    return "\n".join(rows)


def write_report(profile: Profile, out_md: str | Path, png: str | Path | None = None) -> Path:
    """Write the markdown report, and with ``png`` the simulated DDP / deft timeline picture."""
    out = Path(out_md)
    parts = [
        f"# deft profile: {profile.model or 'model'}",
        "",
        f"source: {profile.source}; world size {profile.world_size}; {profile.n} buckets; "
        f"forward {profile.forward_s * 1e3:.2f} ms, backward {profile.backward_s * 1e3:.2f} ms, "
        f"communication {profile.total_comm_s() * 1e3:.2f} ms on {profile.links[0].name}; "
        f"coverage rate CR = {profile.coverage_rate:.2f}.",
        "",
        "Bucket 0 is the first to become ready in backward (nearest the output).",
        "",
        bucket_table(profile),
        "",
        "## Links",
        "",
        link_table(profile),
        "",
    ]
    if profile.versions:
        parts += ["versions: " + ", ".join(f"{k} {v}" for k, v in sorted(profile.versions.items())), ""]
    if png is not None:
        parts += _timeline(profile, Path(png))
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def _timeline(profile: Profile, png: Path) -> list[str]:
    """Simulate torch DDP and deft on the profile, draw both timelines, and tabulate the prediction.

    A profile the planner cannot schedule still gets its DDP timeline; the report says why deft's
    is missing instead of failing (the measured table above is the report's main content).
    """
    from deft.errors import DeftError
    from deft.solver.compare import simulate
    from deft.solver.timeline import draw_timeline

    results = {"ddp": simulate(profile, "ddp")}
    lines: list[str] = []
    try:
        results["deft"] = simulate(profile, "deft")
    except DeftError as e:
        lines += [f"deft could not be planned on this profile ({e}); only torch DDP is simulated.", ""]
    draw_timeline(results, png, title=f"{profile.model or 'model'}: simulated from the measured profile")
    lines += [f"Timeline (simulated from this profile): `{png.name}`", ""]
    lines += ["| scheme | predicted iteration ms | bubble % |", "| --- | --- | --- |"]
    for s, r in results.items():
        lines.append(f"| {s} | {r.iteration_s * 1e3:.2f} | {100 * r.bubble_ratio:.1f} |")
    lines.append("")
    return lines
