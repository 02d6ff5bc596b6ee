"""The first hour, timed: a second `./quickstart` until "ready", and `anonproxy report` with and without the curve.

    python3 benchmarks/first_hour/run.py [--runs 3]

1. Copies the files git tracks into a temporary directory (a clone as it is now), runs its `./quickstart` once
   (the install), then ``--runs`` more times, each until `anonproxy is ready`, and prints each of those times.
2. Starts `anonproxy up` from this checkout, builds the README's release public.adult_k10 and a second release of
   adult (mdav, the same columns), then times `anonproxy report public.adult_k10` without a curve (the default) and
   with `--curve` (the k the curve was drawn at by default before), ``--runs`` times each.

The load average is printed beside each figure: the machine is shared. See README.md next to this file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QI = "age,workclass,education,marital_status,race,sex,native_country"


def until_ready(command: list[str], cwd: Path) -> tuple[float, subprocess.Popen[str], dict[str, str]]:
    """Start ``command``; the seconds until it printed "Press Ctrl-C", the process, the URLs it printed."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    urls = {}
    assert process.stdout is not None
    for line in process.stdout:
        parts = line.split()
        if len(parts) >= 2 and parts[1].startswith("postgresql://"):
            urls[parts[0]] = parts[1]
        if line.startswith("Press Ctrl-C"):
            return time.perf_counter() - started, process, urls
    raise RuntimeError(f"{command} stopped before it was ready")


def stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def quickstart(runs: int) -> None:
    clone = Path(tempfile.mkdtemp(prefix="anonproxy-first-hour-"))
    try:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
        pack = subprocess.run(["tar", "-C", str(ROOT), "--null", "-T", "-", "-cf", "-"], input=tracked,
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-C", str(clone), "-xf", "-"], input=pack, check=True)
        first, process, _ = until_ready(["./quickstart", "--port", "0"], clone)
        stop(process)
        print(f"./quickstart, first run (installs): {first:.1f} s ({load()})")
        for run in range(runs):
            seconds, process, _ = until_ready(["./quickstart", "--port", "0"], clone)
            stop(process)
            print(f"./quickstart, run {run + 2} (nothing changed): {seconds:.1f} s to ready ({load()})")
    finally:
        shutil.rmtree(clone, ignore_errors=True)


def cli(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "anonproxy", *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - started


def report(runs: int) -> None:
    _, up, urls = until_ready([sys.executable, "-m", "anonproxy", "up", "--port", "0"], ROOT)
    try:
        dba = urls["dba"]
        cli("anonymize", "--dsn", dba, "--source", "public.adult", "--target", "public.adult_k10", "--k", "10",
            "--l", "3", "--sensitive", "occupation", "--qi", QI)
        cli("anonymize", "--dsn", dba, "--source", "public.adult", "--target", "public.adult_k10_mdav", "--k", "10",
            "--l", "3", "--sensitive", "occupation", "--method", "mdav", "--qi", QI)
        with tempfile.TemporaryDirectory() as scratch:
            page = str(Path(scratch) / "report.html")
            for _ in range(runs):
                seconds = cli("report", "public.adult_k10", "--html", page, "--dsn", dba)
                print(f"anonproxy report public.adult_k10 (default, no curve): {seconds:.1f} s ({load()})")
                seconds = cli("report", "public.adult_k10", "--html", page, "--dsn", dba, "--curve")
                print(f"anonproxy report public.adult_k10 --curve (6 k): {seconds:.1f} s ({load()})")
    finally:
        stop(up)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    quickstart(args.runs)
    report(args.runs)


if __name__ == "__main__":
    main()
