import pytest

from transport.memory import HUGE_PAGE, HostBuffer, huge_bytes_in, view


def test_huge_page_buffer_is_aligned_and_verified_huge():
    buffer = HostBuffer(3 * HUGE_PAGE + 1, huge_pages=True)
    try:
        assert buffer.nbytes == 4 * HUGE_PAGE  # rounded up to whole huge pages
        assert buffer.addr % HUGE_PAGE == 0
        assert huge_bytes_in(buffer.addr, buffer.nbytes) == buffer.nbytes
        assert bytes(buffer.view()[:8]) == bytes(8)
    finally:
        buffer.close()


def test_plain_buffer_is_not_huge_and_views_alias_it():
    buffer = HostBuffer(10_000)
    try:
        assert buffer.nbytes == 10_000
        raw = view(buffer.addr + 100, 4)
        raw[:] = b"kv!!"
        assert bytes(buffer.view()[100:104]) == b"kv!!"
        del raw
    finally:
        buffer.close()


def test_bad_size_is_rejected():
    with pytest.raises(ValueError, match="nbytes"):
        HostBuffer(0)
