"""Datasets: what the workflow cannot see change."""

from __future__ import annotations

from eagle3build.doctor.context import Check, Context


def check_dataset_revisions(ctx: Context) -> Check:
    """An hf: dataset without `revision` is whatever the hub (or the local cache) holds when it is read, and
    no file of it is an input: a change upstream never reruns anything. A pinned commit is a param."""
    unpinned = [
        f"datasets[{i}] ({ds.get('name')})"
        for i, ds in enumerate(ctx.config.get("datasets") or [])
        if str(ds.get("path", "")).startswith("hf:") and not ds.get("revision")
    ]
    if not unpinned:
        return Check("datasets", "ok", "no hf: dataset without a pinned revision")
    return Check(
        "datasets",
        "warn",
        f"{', '.join(unpinned)}: an hf: dataset without `revision`; changes upstream are never seen "
        "(its shards stay as first built)",
        "set datasets[].revision to the dataset's hub commit (its 40-character sha)",
    )
