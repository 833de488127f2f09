"""`tools/stack.py`'s free_port: a port handed out once is not handed out again in the same process,
even before its server has bound it (servers bind only after loading their model)."""

from __future__ import annotations

from tandem.tools import stack


class Draws:
    """A stand-in for random.Random whose draws are given."""

    def __init__(self, ports):
        self.ports = iter(ports)

    def randrange(self, *_):
        return next(self.ports)


def test_a_port_is_handed_out_once_even_while_nothing_binds_it(monkeypatch):
    low = stack.PORT_RANGE[0]
    monkeypatch.setattr(stack, "_handed_out", set())
    monkeypatch.setattr(stack.random, "Random", lambda: Draws([low + 7]))
    first = stack.free_port()
    monkeypatch.setattr(stack.random, "Random", lambda: Draws([low + 7, low + 11]))  # the first port drawn again
    assert (first, stack.free_port()) == (low + 7, low + 11)
