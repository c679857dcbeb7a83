"""The exceptions of `data/`. Every message is one line that says what is wrong and what to do about it."""


class DataError(Exception):
    """Data that cannot be obtained, verified or used: a hash mismatch, a failed download, a bad argument."""


class UnknownCharacterError(DataError):
    """Text holds characters outside the vocabulary; `chars` lists them, sorted."""

    def __init__(self, chars: list[str], vocab_size: int):
        self.chars = chars
        names = ", ".join(map(repr, chars))
        super().__init__(f"character{'s' if len(chars) > 1 else ''} {names} not in the vocabulary of "
                         f"{vocab_size} characters; use only characters that occur in the training text")
