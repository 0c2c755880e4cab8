"""README.md's commands, run as written (issue 12).

Every ```sh and ```python block of the README is run, in order, in one bash process started in the
repository root, as a reader pasting them into one terminal would (python blocks through
`python - <<EOF`). A block right after `<!-- readme-test: skip (why) -->` is left out; only the make
targets are (they install into .venv, and `make test` is what runs this test). To keep out of the
way of other daemons on the machine, the walk-through's directory (/tmp/kvservice) and its ports
(50051, 9400, 8001, 8002) are replaced by a fresh directory and free ports; nothing else is touched.
The ```toml example is checked by the configuration loader.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvservice.ops.config import _coerce
from tests.daemon_kit import free_tcp_port, short_tmpdir

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- readme-test: skip \((?P<why>[^)]*)\) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```", re.M | re.S)
PORTS = ("50051", "9400", "8001", "8002")


def blocks() -> list[tuple[str, str, str | None]]:
    """(language, body, why skipped or None) of every fenced block, in order."""
    return [(m["lang"], m["body"], m["why"]) for m in BLOCK.finditer(README.read_text())]


def test_only_make_targets_are_skipped() -> None:
    """The skip marker is for blocks that cannot run inside the test suite, nothing else."""
    skipped = [body for lang, body, why in blocks() if why is not None]
    assert skipped, "expected the make blocks to be marked"
    for body in skipped:
        commands = [line for line in body.splitlines() if line.strip() and not line.startswith("#")]
        assert all(c.startswith(("make ", ".venv/bin/python scripts/compile_proto.py")) for c in commands), body


def test_toml_example_is_a_valid_config() -> None:
    (toml,) = [body for lang, body, _ in blocks() if lang == "toml"]
    for key, value in tomllib.loads(toml).items():
        _coerce(key, value)  # raises on an unknown key or a bad value


def script(workdir: Path, ports: dict[str, str]) -> str:
    parts = ["set -eo pipefail", f"cd {ROOT}"]  # no -u: a reader's shell leaves unset variables empty
    for lang, body, why in blocks():
        if why is not None or lang not in ("sh", "python"):
            continue
        body = body.replace("/tmp/kvservice", str(workdir))
        for old, new in ports.items():
            body = re.sub(rf"(?<![0-9]){old}(?![0-9])", new, body)
        parts.append(f"echo '@@ block {len(parts)}' >&2")
        parts.append(body if lang == "sh" else f"python - <<'README_PY'\n{body}README_PY")
    return "\n".join(parts) + "\n"


@pytest.mark.timeout(600)
def test_readme_shell_blocks_run_as_written() -> None:
    """Scenario: a new user pastes every shell and Python block of the README into one terminal:
    the daemon and two model runners start, the second runner reuses the first one's KV (cached
    tokens from the host tier), check-config, the engine_client example, grpcurl recipes, the block
    view and the metrics scrape all succeed, and the final `kill ...; wait` stops everything."""
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip(f"no .venv in {ROOT}: the README's walk-through activates it (make setup creates it)")
    workdir = short_tmpdir("kvreadme")
    ports = {p: str(free_tcp_port()) for p in PORTS}
    text = script(workdir, ports)
    (workdir / "readme.sh").write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the checkout under test, whatever .venv was installed from
    # files, not pipes: a background process left by a failed block must not keep the test waiting
    with open(workdir / "stdout", "w") as stdout, open(workdir / "stderr", "w") as stderr:
        proc = subprocess.Popen(["bash", str(workdir / "readme.sh")], cwd=ROOT, env=env, stdout=stdout,
                                stderr=stderr, start_new_session=True)
        try:
            proc.wait(timeout=540)
        finally:  # whatever happened, nothing the script started may outlive it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    out, err = (workdir / "stdout").read_text(), (workdir / "stderr").read_text()
    if proc.returncode == 0:
        shutil.rmtree(workdir, ignore_errors=True)  # kept on failure, for a look
    assert proc.returncode == 0, f"README script failed (exit {proc.returncode}):\n{text}\n--- stdout\n{out}\n--- stderr\n{err[-6000:]}"
    cached = [int(n) for n in re.findall(r'"cached_tokens":\s*(\d+)', out)]
    assert len(cached) >= 2 and cached[0] == 0 and cached[1] >= 16, out
    assert '"host":' in out and "kvservice_stores_total" in out and "process_resident_memory_bytes" in out
    assert '"stored": true' in out or '"stored":true' in out, out  # DescribeBlocks found the example's block
