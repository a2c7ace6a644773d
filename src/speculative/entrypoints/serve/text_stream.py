"""One request's tokens turned into text as it becomes final, with stop strings.

Tokens are decoded incrementally (a window from the last settled point, so a multi-byte
character split over tokens, or a tokenizer that drops a leading space at the start of a
decode, comes out right), and stop strings are looked for in the decoded text, so one may
span token boundaries. Text that could still be the start of a stop string is held back
until the next token shows that it is not.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()):
        self.decode = decode
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1  # a stop string's longest proper prefix
        self.ids: list[int] = []
        self.text = ""      # decoded so far (cut before a stop string once one is found)
        self.sent = 0       # characters of `text` given out
        self._prefix = 0    # ids[_prefix:_read] decode to the end of `text`: the window's context
        self._read = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Append one token; True when it completes a stop string (the text is then cut before it)."""
        self.ids.append(token)
        before = len(self.text)
        self._advance(final=False)
        if self.stops and len(self.text) > before:
            start = max(0, before - self.hold)
            found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.text = self.text[:min(found)]
                self.stopped = True
        return self.stopped

    def _advance(self, final: bool) -> None:
        context = self.decode(self.ids[self._prefix:self._read])
        full = self.decode(self.ids[self._prefix:])
        if len(full) > len(context) and (final or not full.endswith("\ufffd")):  # wait for a whole character
            self.text += full[len(context):]
            self._prefix, self._read = self._read, len(self.ids)

    def take(self, final: bool = False) -> str:
        """The text not given out yet, less what may begin a stop string (all of it when final)."""
        if final and not self.stopped and self._read < len(self.ids):
            self._advance(final=True)
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
