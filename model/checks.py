"""The type checks behind the labs' errors on what a user passes: Python counts a bool as an int, they do not."""


def is_integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
