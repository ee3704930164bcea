"""How big a placement a client asks the master for: what the writer puts in a TTL, within bounds."""

from kvstore_client.placements import GROWTH, Placements

MiB = 1 << 20


def _placements(ttl: float = 1.0, min_bytes: int = 64 * MiB) -> Placements:
    def never(*_):
        raise AssertionError("no master is asked here")

    return Placements(never, never, never, ttl, min_bytes)


def test_a_slow_writer_keeps_the_minimum():
    assert _placements().next_size(used=2 * MiB, elapsed=0.5) == 64 * MiB  # 4 MiB/s


def test_a_writer_in_between_gets_what_it_puts_in_one_ttl():
    assert _placements(ttl=2.0).next_size(used=100 * MiB, elapsed=0.5) == 400 * MiB


def test_a_fast_writer_is_capped():
    assert _placements().next_size(used=32 * MiB, elapsed=0.004) == GROWTH * 64 * MiB  # 8 GB/s


def test_no_time_elapsed_is_no_division_by_zero():
    assert _placements().next_size(used=32 * MiB, elapsed=0.0) == GROWTH * 64 * MiB
