"""SARIF 2.1.0 for code-scanning dashboards: one result per finding, the file as location, the tensor as logical location."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._version import __version__
from ..inventory import Report
from ..rules import rule
from .humanize import locator

_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _uri(path: str) -> str:
    p = Path(path)
    return p.as_posix() if not p.is_absolute() else p.as_uri()


def render(report: Report) -> str:
    results: list[dict[str, Any]] = []
    used: list[str] = []

    def index_of(rule_id: str) -> int:
        if rule_id not in used:
            used.append(rule_id)
        return used.index(rule_id)

    for c in report.checkpoints:
        if c.error:
            results.append(
                {
                    "ruleId": "unreadable",
                    "ruleIndex": index_of("unreadable"),
                    "level": "error",
                    "message": {"text": c.error},
                    "locations": [{"physicalLocation": {"artifactLocation": {"uri": _uri(c.path)}}}],
                }
            )
        located = locator(c)
        for f in c.findings:
            artifact = _uri(located([f.tensor], f.file))  # inside a folder, the file that holds the tensor
            location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": artifact}}}
            if f.tensor:
                location["logicalLocations"] = [{"fullyQualifiedName": f.tensor, "name": f.tensor.rsplit(".", 1)[-1], "kind": "member"}]
            result: dict[str, Any] = {
                "ruleId": f.rule,
                "ruleIndex": index_of(f.rule),
                "level": _LEVEL[f.severity],
                "message": {"text": f"{f.tensor}: {f.message}" if f.tensor else f.message},
                "locations": [location],
            }
            if f.expected is not None or f.actual is not None:
                result["properties"] = {"expected": list(f.expected or ()), "actual": f.actual}
            results.append(result)
    rules = [
        {
            "id": rid,
            "name": "".join(part.capitalize() for part in rid.split("-")),
            "shortDescription": {"text": rule(rid).summary},
            "fullDescription": {"text": rule(rid).summary},
            "help": {"text": rule(rid).help or rule(rid).summary},
            "defaultConfiguration": {"level": _LEVEL.get(rule(rid).severity, "error")},
        }
        for rid in used
    ]
    doc = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "dtypeaudit",
                        "version": __version__,
                        "informationUri": "https://pypi.org/project/dtypeaudit/",
                        "rules": rules,
                    }
                },
                "invocations": [{"executionSuccessful": not any(c.error for c in report.checkpoints)}],
                "results": results,
            }
        ],
    }
    return json.dumps(doc, indent=2) + "\n"
