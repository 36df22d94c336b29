"""kv_connector_extra_config: parsed once; a bad value is refused with its key's name."""

import pytest

from prefill.vllm_config import TandemConnectorConfig


def test_defaults_and_json_numbers():
    assert TandemConnectorConfig.from_extra_config(None) == TandemConnectorConfig()
    config = TandemConnectorConfig.from_extra_config({"transport": "shm", "staging_mb": 8})
    assert config.transport == "shm" and config.staging_mb == 8.0
    assert config.slot_bytes == 8 * (1 << 20) // config.staging_slots


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"transport": "udp"}, "transport: 'udp' is not one of tcp, shm, nixl, mooncake"),
        ({"staging_mb": 0}, "staging_mb: 0.0 must be > 0"),
        ({"staging_slots": 0}, "staging_slots: 0 must be >= 1"),
        ({"staging_slots": 2.5}, "staging_slots must be of type int, got 2.5"),
        ({"transfer_timeout_s": "30"}, "transfer_timeout_s must be of type float, got '30'"),
        ({"host": ""}, "host: must not be empty"),
        ({"stagin_mb": 1}, "unknown key(s) stagin_mb"),
    ],
)
def test_a_bad_value_is_refused_by_name(extra, named):
    with pytest.raises(ValueError) as error:
        TandemConnectorConfig.from_extra_config(extra)
    assert named in str(error.value)
