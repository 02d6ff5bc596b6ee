"""Run the shell examples of README.md and docs/ against a fresh `anonproxy up`: check them, or rewrite their outputs.

An example is a fenced block right after an HTML comment line:

- ``<!-- live -->``: lines starting with ``$ `` are shell commands (a command
  goes on while a line ends with ``\\`` or a quote is open); the lines after a
  command, up to the next one, are what it prints (stdout and stderr).
- ``<!-- live: noisy -->``: the same, for answers with random noise: numbers
  and column widths are not compared, only the shape and the words.
- ``<!-- live: up -->``: what `anonproxy up` prints on stdout when it is ready.

A line ``...`` in an output stands for any number of lines (one per output).
Commands run with bash in a temporary directory, in the order of their file,
against one `anonproxy up` per file started from this checkout on a free port
(what a command exports is kept for the next ones, as in one terminal):
``127.0.0.1:6432`` in a command is replaced by its address and ``<password>``
by its owner's password (and back in what it prints); ``anonproxy`` is this
checkout's command. Progress lines are not compared; elapsed seconds neither.

    python3 scripts/live_docs.py check [FILE ...]     exit 1 and show the differences if an output is stale
    python3 scripts/live_docs.py refresh [FILE ...]   rewrite the outputs from a real run
    python3 scripts/live_docs.py check --attach UP_OUTPUT FILE
                                                      against an `up` started elsewhere (UP_OUTPUT: what it printed)
    python3 scripts/live_docs.py setup-command N      the README's N-th set-up command (.ci/readme runs the first)
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("README.md", "docs/views.md")
DOCUMENTED_ADDRESS = "127.0.0.1:6432"
PASSWORD_PLACEHOLDER = "<password>"
_MARKER = re.compile(r"<!-- live(?:: (noisy|up))? -->")
_APPLIED = re.compile(r"^policy version (\d+) applied")  # what `anonproxy policy apply` prints
_PROGRESS = re.compile(r"^(NOTICE:  anonproxy progress \d+ of \d+: .*|anonproxy [\w-]+: \d+/\d+ .*)$")
_ELAPSED = re.compile(r"\b\d+(?:\.\d+)? s\b")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass
class Step:
    command: str  # as written, lines joined with newlines, without the "$ "
    output: list[str]


@dataclass
class Example:
    path: Path
    kind: str  # "exact", "noisy" or "up"
    first: int  # index of the first line inside the fence
    last: int  # index of the closing fence
    steps: list[Step] = field(default_factory=list)
    up_output: list[str] = field(default_factory=list)


def parse(path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").splitlines()
    examples = []
    for index, line in enumerate(lines):
        marker = _MARKER.fullmatch(line.strip())
        if marker is None:
            continue
        if index + 1 >= len(lines) or not lines[index + 1].startswith("```"):
            raise ValueError(f"{path}:{index + 1}: a live marker must be followed by a fenced block")
        first = index + 2
        last = next(i for i in range(first, len(lines)) if lines[i].startswith("```"))
        example = Example(path, marker[1] or "exact", first, last)
        body = lines[first:last]
        if example.kind == "up":
            example.up_output = body
        else:
            example.steps = _steps(body, f"{path}:{first + 1}")
        examples.append(example)
    return examples


def _steps(body: list[str], where: str) -> list[Step]:
    steps: list[Step] = []
    position = 0
    while position < len(body):
        line = body[position]
        if not line.startswith("$ "):
            if steps:
                steps[-1].output.append(line)
            elif line.strip():
                raise ValueError(f"{where}: a live block starts with a `$ ` command")
            position += 1
            continue
        command = [line[2:]]
        position += 1
        while not _complete("\n".join(command)) and position < len(body):
            command.append(body[position])
            position += 1
        steps.append(Step("\n".join(command), []))
    for step in steps:
        while step.output and not step.output[-1].strip():
            step.output.pop()
    return steps


def _complete(command: str) -> bool:
    if command.endswith("\\"):
        return False
    try:
        shlex.split(command)
    except ValueError:  # an open quote
        return False
    return True


class Demo:
    """`anonproxy up` from this checkout on a free port, throwaway, stopped by close().

    With ``attach`` (what an `up` started elsewhere printed), its server instead; close() leaves it running.
    """

    def __init__(self, attach: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.process: subprocess.Popen[str] | None = None
        self.ready_output: list[str] = []
        if attach is not None:
            self.ready_output = attach
        else:
            self.process = subprocess.Popen([sys.executable, "-m", "anonproxy", "up", "--port", "0"], cwd=ROOT,
                                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.ready_output.append(line.rstrip("\n"))
                if line.startswith("Press Ctrl-C"):
                    break
            else:
                self.close()
                raise RuntimeError("anonproxy up stopped before it was ready:\n" + "\n".join(self.ready_output))
        urls = dict(line.split()[:2] for line in self.ready_output if "postgresql://" in line)
        owner = urls["owner"]
        self.reporter = urls["reporter"]
        self.password = owner.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
        self.address = owner.split("@", 1)[1].split("/", 1)[0]
        self.workdir = tempfile.TemporaryDirectory(prefix="anonproxy-live-docs-")
        shim = Path(self.workdir.name) / "bin"
        shim.mkdir()
        (shim / "anonproxy").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m anonproxy "$@"\n')
        (shim / "anonproxy").chmod(0o755)
        self.env = dict(env, PATH=f"{shim}{os.pathsep}{os.environ.get('PATH', '')}", PSQLRC="/dev/null",
                        PAGER="cat", COLUMNS="200")
        self.env.pop("ANONPROXY_DSN", None)
        self.env.pop("PGPASSWORD", None)

    def documented(self, text: str) -> str:
        """Output as the docs show it: the documented address, the password placeholder."""
        return text.replace(self.address, DOCUMENTED_ADDRESS).replace(self.password, PASSWORD_PLACEHOLDER)

    def up_output(self) -> list[str]:
        start = next(i for i, line in enumerate(self.ready_output) if line.startswith("anonproxy is ready"))
        return [self.documented(line) for line in self.ready_output[start:]]

    def run(self, command: str) -> list[str]:
        real = command.replace(DOCUMENTED_ADDRESS, self.address).replace(PASSWORD_PLACEHOLDER, self.password)
        # One shell per command, but what a command exports is there for the next ones, as in a terminal.
        script = f". ./.exported 2>/dev/null\n{real}\nexport -p > ./.exported"
        result = subprocess.run(["bash", "-c", script], cwd=self.workdir.name, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=300)
        lines = [self.documented(line).rstrip() for line in result.stdout.splitlines()]
        lines = [line for line in lines if not _PROGRESS.match(line)]
        while lines and not lines[-1]:
            lines.pop()
        applied = next((int(found.group(1)) for line in lines if (found := _APPLIED.search(line))), None)
        if applied is not None:
            self._wait_for_policy(applied)
        return lines

    def _wait_for_policy(self, version: int) -> None:
        """Until the proxy's workers know policy ``version``: a person typing the next command gives them that
        long (they reload on a notification), a script must wait or its next login may meet the policy before."""
        import psycopg  # noqa: PLC0415  (here: `setup-command` runs with a bare python3, before any install)

        deadline = time.monotonic() + 20
        seen = 0
        while seen < 10 and time.monotonic() < deadline:  # fresh connections land on any worker: ten in a row
            with psycopg.connect(self.reporter, autocommit=True) as conn:
                current = int(conn.execute("show anonproxy.policy_version").fetchone()[0])  # type: ignore[index]
            seen = seen + 1 if current >= version else 0
            if current < version:
                time.sleep(0.05)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if hasattr(self, "workdir"):
            self.workdir.cleanup()


def _normal(line: str, kind: str) -> str:
    line = _ELAPSED.sub("# s", line.rstrip())
    if kind == "noisy":
        line = _NUMBER.sub("#", line)
        line = re.sub(r"-{2,}", "-", re.sub(r" +", " ", line)).strip()
    return line


def matches(expected: list[str], actual: list[str], kind: str) -> bool:
    """Whether ``actual`` is what ``expected`` shows (a ``...`` line stands for any lines)."""
    head, tail = _split(expected)
    if tail is None:
        return [_normal(x, kind) for x in expected] == [_normal(x, kind) for x in actual]
    if len(actual) < len(head) + len(tail):
        return False
    return ([_normal(x, kind) for x in head] == [_normal(x, kind) for x in actual[: len(head)]]
            and [_normal(x, kind) for x in tail] == [_normal(x, kind) for x in actual[len(actual) - len(tail):]])


def shown(expected: list[str], actual: list[str]) -> list[str]:
    """``actual`` cut where ``expected`` elides lines, for rewriting the docs."""
    head, tail = _split(expected)
    if tail is None or len(actual) < len(head) + len(tail):
        return actual
    return actual[: len(head)] + ["..."] + actual[len(actual) - len(tail):]


def _split(expected: list[str]) -> tuple[list[str], list[str] | None]:
    cuts = [i for i, line in enumerate(expected) if line.strip() == "..."]
    if not cuts:
        return expected, None
    if len(cuts) > 1:
        raise ValueError("at most one `...` line per output")
    return expected[: cuts[0]], expected[cuts[0] + 1:]


@dataclass
class Difference:
    where: str
    command: str
    expected: list[str]
    actual: list[str]

    def __str__(self) -> str:
        return (f"{self.where}: $ {self.command}\n--- shown\n" + "\n".join(self.expected)
                + "\n--- real run\n" + "\n".join(self.actual))


def run_file(path: Path, refresh: bool = False, attach: list[str] | None = None) -> list[Difference]:
    """Run the examples of one file against a fresh demo (or ``attach``); rewrite their outputs if ``refresh``."""
    examples = parse(path)
    if not examples:
        return []
    differences: list[Difference] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    replacements: list[tuple[int, int, list[str]]] = []
    demo = Demo(attach)
    try:
        for example in examples:
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{example.first + 1}"
            if example.kind == "up":
                actual = demo.up_output()
                if not matches(example.up_output, actual, "exact"):
                    differences.append(Difference(where, "anonproxy up", example.up_output, actual))
                replacements.append((example.first, example.last, shown(example.up_output, actual)))
                continue
            body: list[str] = []
            for step in example.steps:
                actual = demo.run(step.command)
                if not matches(step.output, actual, example.kind):
                    differences.append(Difference(where, step.command, step.output, actual))
                output = shown(step.output, actual)
                body += ["$ " + step.command, *output, *([""] if output else [])]
            replacements.append((example.first, example.last, body[:-1] if body and not body[-1] else body))
    finally:
        demo.close()
    if refresh:
        for first, last, body in reversed(replacements):
            lines[first:last] = body
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return differences


def setup_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """The commands of the fenced ``sh`` blocks of the README's "Set up" section, in order."""
    section = readme.read_text(encoding="utf-8").split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["setup-command"] and len(argv) == 2:
        print(setup_commands()[int(argv[1]) - 1])
        return 0
    if not argv or argv[0] not in ("check", "refresh"):
        print(__doc__, file=sys.stderr)
        return 2
    attach = None
    if argv[1:2] == ["--attach"]:
        attach = Path(argv[2]).read_text(encoding="utf-8").splitlines()
        argv = [argv[0], *argv[3:]]
    paths = [Path(name).resolve() for name in argv[1:]] or [ROOT / name for name in DEFAULT_FILES]
    if attach is not None and len(paths) != 1:
        print("live_docs: --attach runs one file, against a fresh `up`", file=sys.stderr)
        return 2
    stale = 0
    for path in paths:
        started = time.monotonic()
        differences = run_file(path, refresh=argv[0] == "refresh", attach=attach)
        for difference in differences:
            print(difference, end="\n\n")
        stale += len(differences)
        verb = "rewrote" if argv[0] == "refresh" else "checked"
        elapsed = time.monotonic() - started
        print(f"{verb} {path.relative_to(ROOT)}: {len(differences)} stale output(s), {elapsed:.1f} s", file=sys.stderr)
    return 1 if stale and argv[0] == "check" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
