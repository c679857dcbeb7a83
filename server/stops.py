"""Stop strings: a choice's text as the engine draws it, cut where a stop string begins."""


class StopScan:
    """A choice's text as it grows: what is safe to send, held back while it could still begin a stop string."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent = stops, "", 0

    def feed(self, new: str) -> tuple[str, bool]:
        """The text now safe to send, and whether a stop string ended the choice (the stop is never sent)."""
        self.text += new
        found = [at for at in (self.text.find(stop, self.sent) for stop in self.stops) if at >= 0]
        if found:
            self.text = self.text[:min(found)]
            return self.flush(), True
        safe = len(self.text) - max((self.held(stop) for stop in self.stops), default=0)
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out, False

    def held(self, stop: str) -> int:
        """The length of the longest end of the unsent text that begins stop: text never sent holds all of it."""
        for k in range(min(len(stop) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
