"""The type checks behind the labs' errors on what a user passes: Python counts a bool as an int, they do not."""


def is_integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# float32's normal numbers: a value of smaller magnitude loses precision or flushes to 0, one of larger is inf
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2**-23) * 2.0**127
FLOAT32_RANGE = f"{FLOAT32_TINY:.3g} to {FLOAT32_MAX:.2g}"  # rounded inwards: every number in it is held


def float32_holds(x) -> bool:
    """x is 0 or a normal float32 number in magnitude: float32 neither flushes it to 0 nor rounds it to inf."""
    return x == 0 or FLOAT32_TINY <= abs(x) <= FLOAT32_MAX
