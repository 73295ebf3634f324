"""The suite's JUnit XML from a device run (`bench/device_run.sh`) as results/device_<device>.json:
counts, every failure and error with its traceback, the device and the versions.

    python -m bench.device_report OUT/junit.xml --device gpu --versions OUT/versions.json \\
        --out results/device_gpu.json
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path


def report(junit: Path, device: str, versions: dict) -> dict:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, seconds = [], 0.0
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        seconds += float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                for problem in case.findall(kind):
                    failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                   "kind": kind, "message": problem.get("message", ""),
                                   "traceback": (problem.text or "")[-6000:]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"device": device, "versions": versions, "seconds": round(seconds, 1), **counts,
            "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--device", required=True)
    ap.add_argument("--versions", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    versions = json.loads(args.versions.read_text()) if args.versions else {}
    data = report(args.junit, args.device, versions)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{args.device}: {data['passed']} passed, {data['failures']} failed, "
          f"{data['errors']} errors, {data['skipped']} skipped -> {args.out}")


if __name__ == "__main__":
    main()
