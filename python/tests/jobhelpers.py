"""Imported by the job scripts the tests start (their PYTHONPATH has this directory)."""


def raises(exc, f, *args, **kwargs):
    """Calls f and fails unless it raises exc; prints what it raised."""
    try:
        f(*args, **kwargs)
    except exc as e:
        print("ok:", type(e).__name__, e)
        return
    raise AssertionError(f"{f.__name__}{args} did not raise {exc.__name__}")
