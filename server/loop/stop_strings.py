"""Stop strings over streamed text: find a match, and hold back text that could still become one."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops

    def find(self, text: str, since: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` that ends after `since`: (its start, the string)."""
        best = None
        for stop in self.stops:
            pos = text.find(stop, max(0, since - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def safe_length(self, text: str) -> int:
        """How much of `text` can be released: all of it but a tail that is a prefix of a stop string."""
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        return len(text) - hold
