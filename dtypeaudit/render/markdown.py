"""Markdown for a CI job summary ($GITHUB_STEP_SUMMARY) or a pull-request comment."""

from __future__ import annotations

from ..inventory import Report, dtype_summary
from .humanize import group_findings, group_tensors, human_bytes, human_count, shape_text


def table_cell(text: str) -> str:
    """``text`` made safe inside a Markdown table cell: pipes escaped, one line."""
    return text.replace("|", "\\|").replace("\n", " ")


def render(report: Report, *, verbose: bool = False, quiet: bool = False) -> str:
    """The report as Markdown; ``quiet`` leaves out checkpoints without findings and every dtype table."""
    out = ["# dtypeaudit report", ""]
    failing = report.failing()
    unreadable = [c for c in report.checkpoints if c.error]
    status = "❌ failed" if failing or unreadable else "✅ passed"
    out.append(f"**{status}**: {len(report.checkpoints)} checkpoint(s), {len(report.findings)} finding(s), failing at `{report.fail_on}`.")
    out.append("")
    for c in report.checkpoints:
        if quiet and not (c.error or c.findings):
            continue
        out.append(f"## `{c.path}`")
        out.append("")
        if c.error:
            out += [f"**Unreadable:** {table_cell(c.error)}", ""]
            continue
        out.append(f"Format `{c.format}`, {len(c.tensors)} tensors.")
        out.append("")
        if c.findings:
            out += ["| severity | rule | count | where | message |", "|---|---|---:|---|---|"]
            for fg in group_findings(c.findings):
                where = table_cell(fg.places(every=verbose))
                out.append(f"| {fg.severity} | `{fg.rule}` | {fg.count} | {where} | {table_cell(fg.message())} |")
            out.append("")
        if quiet:
            continue
        out += ["| dtype | tensors | elements | bytes | share |", "|---|---:|---:|---:|---:|"]
        for r in dtype_summary(c.tensors):
            out.append(f"| `{r.dtype}` | {r.tensors} | {human_count(r.numel)} | {human_bytes(r.nbytes)} | {r.share:.1%} |")
        out.append("")
        if verbose:
            out += ["<details><summary>Tensors</summary>", "", "| name | dtype | shape | kind |", "|---|---|---|---|"]
            for g in group_tensors(c.tensors):
                label = f"{g.label} ×{g.count}" if g.count > 1 else g.label
                out.append(f"| `{table_cell(label)}` | `{g.dtype}` | {shape_text(g.shape)} | {g.kind} |")
            out += ["", "</details>", ""]
    return "\n".join(out) + "\n"
