"""podman with a private image store under the test's temp dir, as the images' tests use it.

NOTE: runc, not crun (crun fails on this kind of machine's hybrid cgroups), and explicit
rlimits: podman's defaults would need CAP_SYS_RESOURCE.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

RUN = ["--runtime", "runc", "run", "--rm", "--network", "host"]
RUN += ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000"]


class Podman:
    def __init__(self) -> None:
        # NOTE: podman refuses a run root path longer than 50 characters: no test temp dir.
        self.root = Path(tempfile.mkdtemp(prefix="tandem-podman-", dir="/tmp"))
        self.base = ["podman", "--root", str(self.root / "storage")]
        self.base += ["--runroot", str(self.root / "run")]
        self.names: list[str] = []

    def __call__(self, *args: str) -> str:
        result = subprocess.run([*self.base, *args], capture_output=True, text=True)
        assert result.returncode == 0, f"podman {args[0]} failed: {result.stderr[-3000:]}"
        return result.stdout

    def load(self, archive: str) -> str:
        """Imports an oci-archive; returns the image id."""
        return self("pull", "-q", f"oci-archive:{archive}").strip()

    def start(self, image: str, args: list[str], ready: str, mounts: dict[str, str],
              timeout: float = 240) -> re.Match:  # fmt: skip
        """Runs a container in the background; waits for a stdout line matching `ready`."""
        name = f"tandem-test-{os.getpid()}-{len(self.names)}"
        self.names.append(name)
        cmd = [*self.base, *RUN, "--name", name, "-e", "OMP_NUM_THREADS=1"]
        for host, inside in mounts.items():
            cmd += ["-v", f"{host}:{inside}:ro"]
        proc = subprocess.Popen([*cmd, image, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline, lines = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} exited with {proc.wait()}: {''.join(lines)}")
            lines.append(line)
            if match := re.search(ready, line):
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                return match
        raise RuntimeError(f"{name} not ready in {timeout} s: {''.join(lines)}")

    def cleanup(self) -> None:
        for name in self.names:
            subprocess.run([*self.base, "rm", "-f", "-t", "5", name], capture_output=True)
        subprocess.run([*self.base, "rmi", "-a", "-f"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
