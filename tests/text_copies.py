"""A text delta that counts the characters copied onto it, for tests that a streamed text is
handled in time linear in its length (not rescanned or recopied per delta)."""

from __future__ import annotations


class Piece(str):
    """A text delta that counts the characters copied by ``str + piece`` (a ``str +=`` of it onto
    the text so far): ``str`` defers to a subclass's reflected ``__radd__``. ``"".join`` of the
    pieces copies each once and calls none. Reset ``Piece.copied`` before counting."""

    copied = 0

    def __radd__(self, other: str) -> str:
        Piece.copied += len(other) + len(self)
        return str.__add__(other, self)
