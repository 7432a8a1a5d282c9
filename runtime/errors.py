"""Errors the command line reports as one line, without a traceback."""


class UserError(Exception):
    """Bad input from the user: a clear message naming the problem and what to do."""


class BundleError(UserError):
    """The bundle is missing, malformed, tampered with, or made for something else."""
