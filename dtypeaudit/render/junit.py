"""JUnit XML for GitLab and Jenkins: one test case per checkpoint, failing on findings at or above --fail-on."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from ..inventory import Report, failing


def render(report: Report) -> str:
    suites = ET.Element("testsuites", name="dtypeaudit")
    suite = ET.SubElement(suites, "testsuite", name="dtypeaudit")
    failures = errors = 0
    for c in report.checkpoints:
        case = ET.SubElement(suite, "testcase", classname="dtypeaudit", name=c.path)
        if c.error:
            errors += 1
            ET.SubElement(case, "error", message=c.error, type="unreadable").text = c.error
            continue
        failed = failing(c.findings, report.fail_on)
        if failed:
            failures += 1
            body = "\n".join(f"[{f.severity}] {f.rule} {f.tensor or ''}: {f.message}" for f in failed)
            ET.SubElement(case, "failure", message=f"{len(failed)} finding(s) at or above {report.fail_on}", type="dtypeaudit").text = body
        failed_ids = {id(f) for f in failed}
        others = [f for f in c.findings if id(f) not in failed_ids]
        if others:
            ET.SubElement(case, "system-out").text = "\n".join(f"[{f.severity}] {f.rule} {f.tensor or ''}: {f.message}" for f in others)
    suite.set("tests", str(len(report.checkpoints)))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suites.set("tests", str(len(report.checkpoints)))
    suites.set("failures", str(failures))
    suites.set("errors", str(errors))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
