"""A :class:`~extproc.status.snapshot.Status` for people: the gateway's HTML page and the CLI's tables.

Pure functions of a snapshot. The page is one self-contained HTML document (inline style, no script, no
external asset; a ``<meta http-equiv="refresh">`` reloads it every ``refresh_s`` seconds); every value
is escaped. The text form is what ``kvgate status`` prints: fleet, index and feeds, queues, policy.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence

from extproc.status.combine import Combined
from extproc.status.snapshot import DriftStatus, EndpointStatus, Status

FLEET_COLUMNS = (
    "endpoint", "address", "models", "role", "state", "load", "run", "wait", "kv", "share", "blocks"
)  # fmt: skip


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _store(name: str, tiers: dict[str, int]) -> str:
    return f"store {name} " + " ".join(f"{tier} {n}" for tier, n in tiers.items())


def _state(e: EndpointStatus) -> str:
    return f"ejected {e.ejected_for_s:.0f}s" if e.state == "ejected" else e.state


def fleet_rows(status: Status) -> list[list[str]]:
    """One row of :data:`FLEET_COLUMNS` per endpoint."""
    return [
        [
            e.id,
            e.address,
            ",".join(e.models),
            e.role,
            _state(e),
            _num(e.load),
            _num(e.running),
            _num(e.waiting),
            _pct(e.kv_usage),
            _pct(e.routed_share),
            str(e.index_blocks) + ("" if e.precise else "~"),
        ]
        for e in status.endpoints
    ]


def feed_rows(status: Status) -> list[list[str]]:
    return [
        [
            f.address,
            "connected" if f.connected else "lost",
            ",".join(f.endpoints) or "-",
            _secs(f.age_s),
            _secs(f.staleness_s),
            f.last_error or "-",
        ]
        for f in status.index.feeds
    ]


FEED_COLUMNS = ("feed", "stream", "endpoints", "last batch", "staleness", "last error")


def policy_rows(status: Status) -> list[list[str]]:
    overridden = set(status.policy.overridden)
    return [
        [path, json.dumps(value, separators=(",", ":"), sort_keys=True), "set" if path in overridden else ""]
        for path, value in status.policy.values.items()
    ]


DRIFT_COLUMNS = ("model", "endpoint", "source", "samples", "ratio", "error", "alarm")


def drift_warning(d: DriftStatus) -> str:
    """The warning line of a tripped drift alarm, naming its model and endpoint."""
    return (
        f"WARNING: drift: model {d.model} at endpoint {d.endpoint}: the engine reused {_pct(d.ratio)} of "
        f"the prompt tokens the router predicted it held (error {_pct(d.error)} over {d.samples} "
        f"requests, from its {d.source}); check its chat template, tokenizer, block size and digest seed"
    )


def drift_rows(status: Status) -> list[list[str]]:
    return [
        [
            d.model,
            d.endpoint,
            d.source,
            str(d.samples),
            _num(d.ratio, 2),
            _pct(d.error),
            "TRIPPED" if d.tripped else "ok",
        ]
        for d in status.drift
    ]


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def render_text(status: Status, source: str) -> str:
    """``kvgate status``'s output for the gateway at ``source``."""
    ready = sum(e.state == "ready" for e in status.endpoints)
    out = [
        f"gateway {source} at {_when(status.at)}: {ready}/{len(status.endpoints)} endpoints ready, "
        f"models {', '.join(status.models) or '-'}",
        *(drift_warning(d) for d in status.drift if d.tripped),
        "",
        "FLEET",
        *_table(FLEET_COLUMNS, fleet_rows(status)),
        "",
        f"INDEX  {status.index.mode}, {status.index.blocks} blocks"
        + "".join(f", {_store(k, v)}" for k, v in status.index.stores.items()),
    ]
    if status.index.feeds:
        out += _table(FEED_COLUMNS, feed_rows(status))
    else:
        out.append("no feeds (endpoints learned from routing decisions: blocks marked ~)")
    out += ["", f"QUEUES  {status.queued} held"]
    if status.queues:
        out += _table(
            ("model", "priority", "queued"),
            [[q.model, str(q.priority), str(q.queued)] for q in status.queues],
        )
    if status.drift:
        out += [
            "",
            "DRIFT  engine-reused / predicted cached prompt tokens",
            *_table(DRIFT_COLUMNS, drift_rows(status)),
        ]
    out += ["", "POLICY", *_table(("path", "value", "override"), policy_rows(status))]
    out += [f"refused: {path}: {reason}" for path, reason in status.policy.rejected.items()]
    return "\n".join(out) + "\n"


VIEW_COLUMNS = ("ext_proc", "at", "ready", "in flight", "queued", "blocks", "feeds", "error")


def view_rows(combined: Combined) -> list[list[str]]:
    """One row of :data:`VIEW_COLUMNS` per view combined (or that gave none)."""
    return [
        [v.source, "-", "-", "-", "-", "-", "-", v.error]
        if v.error
        else [
            v.source,
            time.strftime("%H:%M:%S", time.gmtime(v.at)),
            f"{v.ready}/{v.endpoints}",
            str(v.in_flight),
            str(v.queued),
            str(v.blocks),
            f"{v.feeds_connected}/{v.feeds}",
            "-",
        ]
        for v in combined.views
    ]


def combined_title(combined: Combined) -> str:
    answered = sum(not v.error for v in combined.views)
    return f"{answered}/{len(combined.views)} ext_procs combined"


def render_combined_text(combined: Combined) -> str:
    """``kvgate status`` with several ext_procs: each one's summary, what they disagree on, then the
    combined tables (:mod:`extproc.status.combine`)."""
    out = [combined_title(combined), *_table(VIEW_COLUMNS, view_rows(combined))]
    out += [f"DISAGREE: {d}" for d in combined.disagreements]
    if combined.status is not None:
        out += ["", render_text(combined.status, combined_title(combined)).rstrip("\n")]
    return "\n".join(out) + "\n"


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#111;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#eee}td.n{text-align:right;font-variant-numeric:tabular-nums}
.ready{background:#d9f2d9}.unhealthy{background:#f6d5d5}.draining{background:#fbefc9}
.ejected{background:#f9dcc4}.lost{background:#f6d5d5}.muted{color:#666}
.bar{display:inline-block;height:10px;background:#4a7bd0;vertical-align:middle;margin-right:4px}
"""


def _cells(row: Sequence[str], numeric: frozenset[int] = frozenset()) -> str:
    return "".join(
        f'<td class="n">{html.escape(c)}</td>' if i in numeric else f"<td>{html.escape(c)}</td>"
        for i, c in enumerate(row)
    )


def _html_table(header: Sequence[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{html.escape(empty)}</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _views_html(combined: Combined) -> str:
    rows = [
        f'<tr class="{"lost" if v.error else "ready"}">{_cells(row, frozenset({2, 3, 4, 5, 6}))}</tr>'
        for v, row in zip(combined.views, view_rows(combined), strict=True)
    ]
    notes = "".join(f'<p class="draining">disagree: {html.escape(d)}</p>' for d in combined.disagreements)
    return (
        f"<h2>Ext_procs: {html.escape(combined_title(combined))}</h2>\n"
        f"{_html_table(VIEW_COLUMNS, rows, 'no ext_proc')}\n{notes}"
    )


def render_html(status: Status, refresh_s: int = 2, combined: Combined | None = None) -> str:
    """The status page: a self-contained HTML document that reloads itself every ``refresh_s`` seconds.
    With ``combined`` (this worker's view and its siblings', :mod:`extproc.status.combine`): each
    one's summary and what they disagree on, then the combined tables."""
    views = ""
    if combined is not None and combined.status is not None:
        status, views = combined.status, _views_html(combined)
    ready = sum(e.state == "ready" for e in status.endpoints)
    numeric = frozenset({5, 6, 7, 8, 10})
    fleet = []
    for e, row in zip(status.endpoints, fleet_rows(status), strict=True):
        width = round(60 * e.routed_share)
        share = f'<td><span class="bar" style="width:{width}px"></span>{html.escape(row[9])}</td>'
        fleet.append(
            f'<tr class="{html.escape(e.state)}" id="endpoint-{html.escape(e.id)}">'
            f"{_cells(row[:9], numeric)}{share}{_cells(row[10:], frozenset({0}))}</tr>"
        )
    feeds = [
        f'<tr class="{"ready" if f.connected else "lost"}">{_cells(row, frozenset({3, 4}))}</tr>'
        for f, row in zip(status.index.feeds, feed_rows(status), strict=True)
    ]
    queues = [
        f"<tr>{_cells([q.model, str(q.priority), str(q.queued)], frozenset({1, 2}))}</tr>"
        for q in status.queues
    ]
    policy = [f"<tr>{_cells(row)}</tr>" for row in policy_rows(status)]
    rejected = "".join(
        f'<p class="unhealthy">refused: {html.escape(p)}: {html.escape(r)}</p>'
        for p, r in status.policy.rejected.items()
    )
    stores = "".join(f", {html.escape(_store(k, v))}" for k, v in status.index.stores.items())
    warnings = "".join(
        f'<p class="unhealthy">{html.escape(drift_warning(d))}</p>' for d in status.drift if d.tripped
    )
    drift = [
        f'<tr class="{"unhealthy" if d.tripped else "ready"}">{_cells(row, frozenset({3, 4, 5}))}</tr>'
        for d, row in zip(status.drift, drift_rows(status), strict=True)
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(refresh_s)}">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>kvgate status</title><style>{_STYLE}</style></head>
<body>
<h1>kvgate status</h1>
<p class="muted">{html.escape(_when(status.at))}; refreshes every {int(refresh_s)} s;
<a href="status.json">JSON</a></p>
{warnings}
{views}
<h2>Fleet: {ready}/{len(status.endpoints)} endpoints ready</h2>
<p>models: {html.escape(", ".join(status.models) or "-")}</p>
{_html_table(FLEET_COLUMNS, fleet, "no endpoints")}
<h2>Index: {html.escape(status.index.mode)}, {status.index.blocks} blocks{stores}</h2>
{_html_table(FEED_COLUMNS, feeds, "no feeds: blocks learned from routing decisions (marked ~)")}
<h2>Flow control: {status.queued} held</h2>
{_html_table(("model", "priority", "queued"), queues, "no request held")}
<h2>Drift: engine-reused / predicted cached prompt tokens</h2>
{_html_table(DRIFT_COLUMNS, drift, "no answered request compared yet")}
<h2>Policy in force</h2>
{rejected}
{_html_table(("path", "value", "override"), policy, "no policy")}
</body></html>
"""
