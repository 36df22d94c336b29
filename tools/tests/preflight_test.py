"""tools.preflight: every check passes on this machine for the configurations the suites run,
and fails, with its fix line, where the machine or setting is arranged to fail it."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from tools import preflight
from transport.memory import HUGE_PAGE, HostBuffer


@pytest.mark.parametrize("transport", ["tcp", "shm", "nixl", "mooncake"])
def test_the_suites_configurations_pass_here(transport):
    """This machine has no RDMA device: the RDMA checks do not apply to it."""
    assert preflight.server_findings("random:tiny", "cpu", transport, "127.0.0.1", {}) == []


def _only(findings) -> preflight.Finding:
    assert len(findings) == 1, findings
    return findings[0]


def test_a_folder_without_config_json_is_named(tmp_path):
    found = _only(preflight.server_findings(str(tmp_path), "cpu", "tcp", "127.0.0.1", {}))
    assert found.check == "model" and "is not a Hugging Face folder" in found.line()
    assert "fix: pass --model a Hugging Face model folder" in found.line()


def test_an_unsupported_model_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    found = preflight.model(str(tmp_path))
    assert "GPT2LMHeadModel" in found.problem and found.fix == "serve a supported model"


def test_an_unknown_preset_is_named():
    assert "unknown preset 'nope'" in preflight.model("random:nope").problem


def test_a_cuda_device_that_is_not_visible_is_named():
    found = preflight.cuda_device("cuda:64")
    assert "--device cuda:64 but" in found.problem and "--device cpu" in found.fix
    assert preflight.cuda_device("cpu") is None


def test_an_address_of_another_machine_is_named():
    found = preflight.bind_address("198.51.100.7")  # TEST-NET-2: no machine's own
    assert found.check == "host" and "ip -brief addr" in found.fix
    assert preflight.bind_address("127.0.0.1") is None


def test_a_low_memlock_limit_is_named_in_a_process_that_has_one():
    """A child process whose locked-memory limit is 64 KiB (as containers give by default)."""
    code = "from tools.preflight import memlock; print(memlock().line())"
    limit = 64 * 1024

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))

    out = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=lower, capture_output=True, text=True, check=True
    ).stdout
    assert "the locked-memory limit is 64 KiB" in out and "fix: `ulimit -l unlimited`" in out
    assert preflight.memlock(resource.RLIM_INFINITY) is None


def test_rdmav_fork_safe_unset_is_named():
    assert preflight.fork_safe({}).fix == "export RDMAV_FORK_SAFE=1"
    assert preflight.fork_safe({"RDMAV_FORK_SAFE": "1"}) is None


def test_transparent_huge_pages_off_is_named(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert preflight.transparent_huge_pages(setting).fix == f"echo madvise > {setting}"
    setting.write_text("always [madvise] never\n")
    assert preflight.transparent_huge_pages(setting) is None


def test_ucx_net_devices_naming_a_device_this_host_lacks_is_named(tmp_path):
    infiniband, net = tmp_path / "infiniband", tmp_path / "net"
    (infiniband / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (net / "eth0").mkdir(parents=True)
    assert preflight.ucx_net_devices("mlx5_0:1,eth0", infiniband, net) is None
    assert preflight.ucx_net_devices("all", infiniband, net) is None
    found = preflight.ucx_net_devices("mlx5_1:1,eth0", infiniband, net)
    assert "names mlx5_1:1, which this host lacks (it has: mlx5_0:1, eth0)" in found.problem


def test_a_registered_buffer_without_huge_pages_is_named():
    """A plain anonymous mapping (4 KiB pages) fails; tandem's huge-page buffer passes."""
    plain = HostBuffer(4 * HUGE_PAGE)
    huge = HostBuffer(4 * HUGE_PAGE, huge_pages=True)
    try:
        found = preflight.huge_page_backed(plain.addr, plain.nbytes)
        assert found.check == "huge pages" and "is 0 bytes huge-page backed" in found.problem
        assert preflight.huge_page_backed(huge.addr, huge.nbytes) is None
    finally:
        plain.close()
        huge.close()


def test_a_server_stops_at_start_up_naming_the_fix(tmp_path):
    """`python -m decode.server` with a folder that is no model: one line with its fix, before
    anything is built; `--preflight warn` goes on to the server's own error."""
    args = [sys.executable, "-m", "decode.server", "--model", str(tmp_path), "--grpc-port", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"decode.server: cannot start: preflight model: {tmp_path} is not")
    assert "; fix: pass --model" in last and "Traceback" not in done.stderr
    warned = subprocess.run([*args, "--preflight", "warn"], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert warned.returncode != 0 and "preflight model" in warned.stderr
    assert "decode.server: cannot start" in warned.stderr
