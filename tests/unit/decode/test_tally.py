"""``Tally`` (statemachine/decode/tally.py): bumps take no lock and lose none; reads are not
counted as bumps."""

from __future__ import annotations

import threading

from statemachine.decode.tally import Tally


def test_value_counts_the_adds_and_reading_changes_nothing() -> None:
    tally = Tally()
    assert tally.value() == 0
    for _ in range(5):
        tally.add()
    assert tally.value() == 5
    assert tally.value() == 5  # a read takes a value from the counter and subtracts it
    tally.add()
    assert tally.value() == 6


def test_concurrent_adds_and_reads_lose_no_count() -> None:
    tally = Tally()
    per_thread, threads = 20_000, 4

    def bump() -> None:
        for _ in range(per_thread):
            tally.add()

    def read() -> None:
        for _ in range(2_000):
            tally.value()

    workers = [threading.Thread(target=bump) for _ in range(threads)]
    workers.append(threading.Thread(target=read))
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert tally.value() == per_thread * threads
