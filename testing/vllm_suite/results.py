"""Per-test outcomes from pytest's JUnit XML report, and their counts."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass
class Outcomes:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    # Test id -> the first line of its failure or error message.
    problems: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {**self.counts, "failing": self.problems}


def _test_id(case: ET.Element) -> str:
    # classname is the dotted module path (plus a class, if any); name carries parameters.
    parts = case.get("classname", "").split(".")
    file_parts = parts
    for i in range(len(parts), 0, -1):
        if not parts[i - 1][:1].isupper():
            file_parts = parts[:i]
            break
    path = "/".join(file_parts) + ".py"
    return "::".join([path, *parts[len(file_parts) :], case.get("name", "?")])


def _first_line(element: ET.Element) -> str:
    text = element.get("message") or element.text or ""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def read_junit(path: Path) -> Outcomes:
    outcomes = Outcomes()
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = "failed" if child.tag == "failure" else child.tag
                if kind != "skipped":
                    outcomes.problems[_test_id(case)] = _first_line(child)
                break
        outcomes.counts[kind] += 1
    return outcomes
