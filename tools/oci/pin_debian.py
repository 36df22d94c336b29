"""Re-pins a Debian package list for tools.oci.build rootfs: builds the root filesystem from the
mirror as it is today and writes every package's exact version back into the file.

    python -m tools.oci.pin_debian images/cpu/packages.lock   (as root; then commit the file)

The header lines that say what to build (`# suite:`, `# include:`) are kept; the build date
becomes the new SOURCE_DATE_EPOCH, so every file in the root filesystem gets that mtime.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tools.oci.build import read_package_lock, run_mmdebstrap

DAY = 86400


def main() -> None:
    path = Path(sys.argv[1])
    _, include, suite, _ = read_package_lock(path)
    epoch = int(time.time()) // DAY * DAY
    with tempfile.TemporaryDirectory() as tmp:
        listed = Path(tmp) / "packages.txt"
        run_mmdebstrap(include, suite, epoch, Path(tmp) / "rootfs.tar", listed)
        pins = sorted(listed.read_text().split())
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    header = [line for line in header if not line.startswith("# source-date-epoch:")]
    lines = [*header, f"# source-date-epoch: {epoch}", *pins]
    path.write_text("\n".join(lines) + "\n")
    print(f"pin_debian: {len(pins)} packages of {suite} pinned in {path}")


if __name__ == "__main__":
    main()
