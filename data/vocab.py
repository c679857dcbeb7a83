"""The character vocabulary: every distinct character of the training text, its id being its position."""

from collections.abc import Iterable

from .errors import DataError, UnknownCharacterError


class CharVocab:
    """Maps characters to ids and back. `chars` is the whole vocabulary as one string in id order, which is how
    prepared data and checkpoints store it."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            repeated = sorted({c for c in chars if chars.count(c) > 1})
            raise DataError(f"vocabulary repeats {', '.join(map(repr, repeated))}; "
                            f"build it with CharVocab.from_text(text)")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other) -> bool:
        return isinstance(other, CharVocab) and self.chars == other.chars

    def __repr__(self) -> str:
        return f"CharVocab({self.chars!r})"

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError:
            raise UnknownCharacterError(sorted(set(text) - self._ids.keys()), len(self)) from None

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]  # accepts tensors and numpy arrays too
        outside = sorted({i for i in ids if not 0 <= i < len(self)})
        if outside:
            raise DataError(f"ids {outside[:5]} outside the vocabulary (0..{len(self) - 1}); "
                            f"decode with the vocabulary the ids were encoded with")
        return "".join(self.chars[i] for i in ids)
