"""``report.html``: a self-contained page rendered from the report document. Every piece
of text is escaped; every figure is an embedded ``data:image/png;base64`` URI."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from hebrus_flywheel.train.qualify.fmt import fmt_bytes, fmt_num

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2rem auto;
max-width:72rem;padding:0 1rem;color:#1d2330;line-height:1.45}
h1{margin-bottom:.2rem;overflow-wrap:anywhere}
h2{border-bottom:1px solid #d6dae3;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.85rem}
th,td{border:1px solid #d6dae3;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#f2f4f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
.status{font-weight:600;padding:.05rem .45rem;border-radius:.25rem;white-space:nowrap}
.pass,.not_falsified{background:#dcf5e3;color:#135c2b}
.fail,.falsified{background:#fbe0e0;color:#8a1414}
.not_measurable{background:#fff1cc;color:#6b4e00}
.decision{font-size:1.15rem;font-weight:700;padding:.5rem .8rem;border-radius:.3rem}
.decision.promote{background:#dcf5e3}.decision.hold{background:#fbe0e0}
figure{margin:1rem 0}figure img{max-width:100%;border:1px solid #e3e6ee}
figcaption{font-size:.8rem;color:#555}code{font-size:.8rem;word-break:break-all}
.meta td:first-child{font-weight:600}
table.nested{margin:0;font-size:.8rem}table.nested th{font-weight:500}
"""

GATE_PLOTS: dict[int, tuple[str, ...]] = {
    3: ("recall_curves", "layer_heatmap", "reliability"),
    5: ("byte_amplification", "bandwidth"),
}


def _label(key: Any) -> str:
    return str(key).replace("_", " ")


def _scalar(value: Any) -> str:
    return escape(fmt_num(value))


def _nested(value: Any, depth: int = 0) -> str:
    """A nested value as labelled HTML: a mapping as field/value rows, a list of mappings
    as a table with one column per field, a list of plain values comma-separated."""
    if isinstance(value, Mapping):
        if not value:
            return "<em>none</em>"
        rows = "".join(f"<tr><th>{escape(_label(k))}</th><td>{_nested(v, depth + 1)}</td></tr>"
                       for k, v in value.items())
        return f'<table class="nested">{rows}</table>'
    if isinstance(value, list):
        if not value:
            return "<em>none</em>"
        if all(isinstance(v, Mapping) for v in value):
            keys = list(dict.fromkeys(k for v in value for k in v))
            head = "".join(f"<th>{escape(_label(k))}</th>" for k in keys)
            body = "".join("<tr>" + "".join(f"<td>{_nested(v.get(k), depth + 1)}</td>"
                                            for k in keys) + "</tr>" for v in value)
            return f'<table class="nested"><tr>{head}</tr>{body}</table>'
        return ", ".join(_nested(v, depth + 1) for v in value)
    return _scalar(value)


def _cell(value: Any) -> str:
    if isinstance(value, Mapping | list):
        return f"<td>{_nested(value)}</td>"
    klass = ' class="num"' if isinstance(value, int | float) and not isinstance(value, bool) \
        else ""
    return f"<td{klass}>{_scalar(value)}</td>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], klass: str = "") -> str:
    """An escaped HTML table."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    attr = f' class="{escape(klass)}"' if klass else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def kv_table(mapping: Mapping[str, Any] | None, klass: str = "meta", *,
             ordered: bool = False) -> str:
    """Two columns: figure, value (sorted by name unless ``ordered``)."""
    if not mapping:
        return "<p><em>not available</em></p>"
    items = list(mapping.items()) if ordered else sorted(mapping.items())
    return table(("figure", "value"), [(_label(k), v) for k, v in items], klass)


def badge(status: str) -> str:
    return f'<span class="status {escape(status)}">{escape(status.replace("_", " "))}</span>'


def _figure(name: str, plots: Mapping[str, bytes], report: Mapping[str, Any]) -> str:
    if name not in plots:
        return ""
    data = base64.b64encode(plots[name]).decode("ascii")
    title = escape(report["plots"][name]["title"])
    return (f'<figure id="plot-{escape(name)}"><img src="data:image/png;base64,{data}" '
            f'alt="{title}"><figcaption>{title} ({escape(name)}.png)</figcaption></figure>')


_VERDICT_WORDS = {"pass": "passed", "fail": "failed", "not_measurable": "not measured"}


def sentence(check: Mapping[str, Any]) -> str:
    """What was measured, against which threshold, and the verdict: the check's own
    detail, with the verdict appended when the detail does not already end with it."""
    detail, word = str(check["detail"]).rstrip(". "), _VERDICT_WORDS[check["status"]]
    if f"— {word}" in detail:
        return detail
    return f"{detail} — {word}" if detail else word


def _gate_line(gate: Mapping[str, Any]) -> str:
    """One sentence for the summary row: the decisive check, and how many passed."""
    checks = gate["checks"]
    passed = sum(c["status"] == "pass" for c in checks)
    def rank(c: Mapping[str, Any]) -> int:
        return {"fail": 0, "pass": 2}.get(c["status"], 1 if c["required"] else 3)
    decisive = sorted(checks, key=rank)
    head = sentence(decisive[0]) if decisive else "no checks were evaluated"
    return f"{head} ({passed} of {len(checks)} checks passed)"


def _summary(report: Mapping[str, Any]) -> str:
    d = report["decision"]
    klass = "promote" if d["promote"] else "hold"
    rows = [(g["gate"], g["name"], g["status"], _gate_line(g)) for g in report["gates"]]
    body = "".join(f"<tr><td>{g}</td><td>{escape(n)}</td><td>{badge(s)}</td>"
                   f"<td>{escape(r)}</td></tr>" for g, n, s, r in rows)
    counts: dict[str, int] = {}
    for f in report["falsifiers"]:
        counts[f["status"]] = counts.get(f["status"], 0) + 1
    tally = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in sorted(counts.items()))
    reasons = "".join(f"<li>{escape(r)}</li>" for r in d["reasons"])
    return (f'<section id="summary"><h2>Verdict summary</h2>'
            f'<p class="decision {klass}">{escape(d["summary"])}</p>'
            f"<table><thead><tr><th>gate</th><th>name</th><th>status</th><th>reason</th>"
            f"</tr></thead><tbody>{body}</tbody></table>"
            f"<p>Falsifiers: {escape(tally)}.</p>"
            f"{'<ul>' + reasons + '</ul>' if reasons else ''}</section>")


def _gate_details(gate: Mapping[str, Any]) -> str:
    f, n = gate["figures"], gate["gate"]
    if n == 1:
        parity = dict(f.get("parity") or {})
        per_layer = parity.pop("per_layer_mismatch_rate", None)
        fail_closed = dict(f.get("fail_closed") or {})
        by_reason = fail_closed.pop("quarantined_by_reason", {})
        return ("<h3>Parity</h3>" + kv_table(parity)
                + ("<h3>Mismatch rate by layer</h3>" + table(("layer", "mismatch rate"),
                                                             sorted(per_layer.items(),
                                                                    key=lambda kv: int(kv[0])))
                   if per_layer else "")
                + "<h3>Opaque-id reuse across owners and generations</h3>"
                + (table(("ids", "checked", "reused", "read from", "examples"),
                         [(o["kind"], o["checked"], o["reused"], o["source"],
                           "; ".join(o["examples"]) or "none")
                          for o in f["opaque_ids"]]) if f.get("opaque_ids")
                   else "<p><em>not measured</em></p>")
                + "<h3>Determinism</h3>" + kv_table(f.get("determinism"))
                + "<h3>Fail-closed</h3>" + kv_table(fail_closed)
                + table(("reason code", "quarantined"), sorted(by_reason.items())))
    if n == 2:
        return _integrity(f)
    if n == 3:
        return _offline(f)
    if n == 5:
        flat = {k: v for k, v in f.items() if k not in ("sim_config", "break_even")}
        rows = [(r.get("block_size"), r.get("tau"), r.get("u_b"), r.get("threshold"),
                 r.get("holds"), r.get("windows")) for r in f.get("break_even", [])]
        return ("<h3>Shadow I/O figures</h3>" + kv_table(flat)
                + "<h3>Break-even U<sub>B</sub> &lt; K·τ(B)</h3>"
                + table(("B", "τ(B)", "U_B", "K·τ(B)", "holds", "windows"), rows)
                + "<h3>Simulator configuration (declared, illustrative)</h3>"
                + kv_table(f.get("sim_config")))
    return kv_table(f)


def _integrity(f: Mapping[str, Any]) -> str:
    splits = f.get("splits", {})
    rows = [(s, v["owners"], v["threads"], v["windows"], ", ".join(v["identity_digests"]),
             ", ".join(v["teacher_digests"]), ", ".join(v["tokenizer_digests"]))
            for s, v in splits.items()]
    cov = [(s, dim, ", ".join(f"{k}: {n}" for k, n in counts.items()))
           for s, dims in f.get("coverage", {}).items() for dim, counts in dims.items()]
    overlaps = [(o["kind"], " / ".join(o["splits"]), o["count"], ", ".join(o["ids"][:10]))
                for o in f.get("overlaps", [])]
    return ("<h3>Splits</h3>" + table(("split", "owners", "threads", "windows", "identity",
                                        "teacher", "tokenizer"), rows)
            + "<h3>Overlaps between splits</h3>"
            + (table(("kind", "splits", "count", "ids"), overlaps) if overlaps
               else "<p>none</p>")
            + "<h3>Near duplicates across splits</h3>" + kv_table(f.get("near_duplicates"))
            + "<h3>Coverage</h3>" + table(("split", "dimension", "counts"), cov)
            + "<h3>Authorization</h3>" + kv_table(f.get("authorization")))


def _offline(f: Mapping[str, Any]) -> str:
    if not f.get("methods"):
        return kv_table(f)
    budgets = [b["candidates"] for b in f.get("budgets", [])]
    out = ["<h3>Budgets (equal for every method)</h3>",
           table(("candidates per token-layer", "bytes per token-layer"),
                 [(b["candidates"], fmt_bytes(b["bytes"])) for b in f["budgets"]]),
           f"<p>Decision budget: {escape(str(f['budget']))} candidates = "
           f"{escape(fmt_bytes(f['byte_budget']))} per token-layer.</p>"]
    headers = ("method", "rows", "exact top-k", *(f"recall@{b}" for b in budgets),
               f"precision@{f['budget']}", "RR first", "RR top-1", "ECE", "union window",
               "union target", f"union predicted@{f['budget']}")
    for split, methods in f["methods"].items():
        rows = [(m, r["rows"], r["exact_match"], *(r["recall"].get(str(b)) for b in budgets),
                 r["precision"].get(str(f["budget"])), r["rr_first"], r["rr_top1"], r["ece"],
                 r["union_window"], r["union_target"], r["union_predicted"])
                for m, r in methods.items() if r is not None]
        out += [f"<h3>{escape(split)}</h3>", table(headers, rows)]
        for dim in ("by_layer", "by_domain"):
            stab = f[dim][split]
            groups = [(g, v["candidate"], v["control"], v["delta"])
                      for g, v in stab["groups"].items()]
            out.append(f"<p>{escape(dim.replace('_', ' '))}: candidate vs "
                       f"{escape(str(stab['control']))}; lost in {stab['lost']} of "
                       f"{len(groups)}</p>")
            out.append(table((dim[3:], "candidate", "control", "delta"), groups))
    return "".join(out)


def _check_row(c: Mapping[str, Any]) -> str:
    """One check: its structured measured / threshold / verdict / reason columns, or the
    whole sentence across them for a check that only carries ``detail``."""
    name = f"<td>{escape(_label(c['name']))}</td>"
    tail = f"<td>{badge(c['status'])}</td><td>{'yes' if c['required'] else 'no'}</td>"
    if not c.get("measured") and not c.get("threshold"):
        return f'<tr>{name}<td colspan="3">{escape(sentence(c))}</td>{tail}</tr>'
    cells = "".join(f"<td>{escape(str(c.get(k) or '—'))}</td>"
                    for k in ("measured", "threshold", "reason"))
    return f"<tr>{name}{cells}{tail}</tr>"


def _gate_section(gate: Mapping[str, Any], report: Mapping[str, Any],
                  plots: Mapping[str, bytes]) -> str:
    n = gate["gate"]
    body = "".join(_check_row(c) for c in gate["checks"])
    figures = "".join(_figure(p, plots, report) for p in GATE_PLOTS.get(n, ()))
    return (f'<section id="gate-{n}"><h2>Gate {n} — {escape(gate["name"])} '
            f"{badge(gate['status'])}</h2>"
            "<table><thead><tr><th>check</th><th>measured</th><th>threshold</th>"
            "<th>why it passed, failed or was not measured</th><th>verdict</th>"
            f"<th>required</th></tr></thead><tbody>{body}</tbody></table>"
            f"{_gate_details(gate)}{figures}</section>")


def _falsifiers(report: Mapping[str, Any]) -> str:
    body = "".join(f"<tr><td>{f['number']}</td><td>{escape(f['statement'])}</td>"
                   f"<td>{escape(f.get('measured') or '—')}</td>"
                   f"<td>{escape(f.get('threshold') or '—')}</td>"
                   f"<td>{badge(f['status'])}</td><td>{escape(f['reason'])}</td></tr>"
                   for f in report["falsifiers"])
    return ('<section id="falsifiers"><h2>Falsifiers</h2><table><thead><tr><th>#</th>'
            "<th>the approach is falsified if</th><th>measured</th><th>threshold</th>"
            "<th>verdict</th><th>why</th></tr></thead>"
            f"<tbody>{body}</tbody></table></section>")


def teacher_name(identity: Mapping[str, Any]) -> str:
    """``tiny-qwen3-next (qwen3_next)``: the teacher's directory name and model family,
    whichever are known; the short artifact digest when neither is."""
    name, family = identity.get("teacher_name"), identity.get("model_family")
    if name and family and name != family:
        return f"{name} ({family})"
    if name or family:
        return str(name or family)
    digest = identity.get("teacher")
    return f"teacher {str(digest)[:12]}" if digest else "unnamed teacher"


def report_title(report: Mapping[str, Any]) -> str:
    """The page title in words: teacher, short snapshot id, date."""
    date = report.get("date")
    return (f"Qualification of {teacher_name(report['identity'])} on snapshot "
            f"{str(report['snapshot_id'])[:12]}" + (f", {date}" if date else ""))


def insecure_banner(report: Mapping[str, Any]) -> str:
    """A red banner when the run used the broker's ``--insecure-plaintext`` opt-out."""
    warning = report.get("insecure_plaintext")
    if not warning:
        return ""
    return ('<div id="insecure-plaintext" role="alert" style="background:#b00020;color:#fff;'
            'font-weight:bold;padding:0.8em;border:3px solid #600">'
            f"{escape(str(warning))}</div>")


def _collection(report: Mapping[str, Any]) -> str:
    """The simulator geometry and the collection-time projection."""
    geometry = report.get("simulator_geometry") or {}
    shown = {**geometry, "expert_bytes": fmt_bytes(geometry.get("expert_bytes")),
             "streamed_bytes_per_token": fmt_bytes(geometry.get("streamed_bytes_per_token"))}
    proj = report.get("collection_projection") or {"rows": []}
    clean = proj.get("clean") or {}

    def hours(value: Any) -> str:
        return "not measured" if value is None else f"{value:,.3g} h"

    rows = [(f"{r['tokens']:,}", hours(r["clean_replay_hours"]),
             hours(r["clean_labelled_hours"]), hours(r["candidate_replay_hours"]))
            for r in proj["rows"]]
    rate = (f"Clean path measured at {fmt_num(clean.get('tokens_per_s'))} replay tokens/s "
            f"({fmt_num(clean.get('labelled_tokens_per_s'))} labelled tokens/s) on "
            f"{', '.join(clean.get('machines') or [])}." if clean else
            "Clean path not measured: the snapshot's manifest has no replay_throughput.")
    note = proj.get("candidate_note") or ""
    return ('<section id="collection"><h2>Teacher geometry and collection time</h2>'
            "<h3>Simulator geometry (from the teacher)</h3>"
            f"{kv_table(shown, ordered=True)}"
            "<h3>Collection-time projection</h3>"
            f"<p>{escape(str(proj.get('formula', '')))}. {escape(rate)} "
            f"{escape('Candidate path: ' + note if note else '')} Excludes "
            f"{escape(str(proj.get('excludes', '')))}.</p>"
            + table(("tokens", "clean path (replay tokens)", "clean path (labelled tokens)",
                     "candidate path"), rows, "meta") + "</section>")


def render_html(report: Mapping[str, Any], plots: Mapping[str, bytes]) -> str:
    """The whole page."""
    title = report_title(report)
    ident = report["identity"]
    meta = {"teacher": teacher_name(ident), "snapshot": report["snapshot_id"],
            "checkpoint": report["checkpoint"],
            "lineage": " ← ".join(report["checkpoint_lineage"]),
            "date": report.get("date") or "not recorded",
            "runtime identity": ident["runtime"], "teacher digest": ident.get("teacher"),
            "tokenizer digest": ident.get("tokenizer"), "geometry": report["geometry"],
            "expert bytes": fmt_bytes(report["expert_bytes"]),
            "service objective": report["objective"] or "none declared"}
    gates = "".join(_gate_section(g, report, plots) for g in report["gates"])
    boundary = "".join(f"<li>{escape(line)}</li>" for line in report["claim_boundary"])
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
            f"{insecure_banner(report)}"
            f"<header><h1>{escape(title)}</h1>{kv_table(meta, ordered=True)}</header>"
            f"{_summary(report)}{_collection(report)}{gates}{_falsifiers(report)}"
            f'<section id="claim-boundary"><h2>Claim boundary</h2><ul>{boundary}</ul>'
            "</section>"
            f'<section id="configuration"><h2>Thresholds judged against</h2>'
            f"{kv_table(report['config'])}</section></body></html>\n")
