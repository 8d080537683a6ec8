"""The statistics of the reports: one median, and the two ways a table sums up a metric's
runs when some of them gave no number (a "timeout", an error's text). A leaf: it imports
nothing from the package.

A metric's runs are a list of what each run recorded: seconds, bytes or a count, or a
string that says why there is no number."""

import math
import statistics


def numbers(runs):
    """The runs that gave a number."""
    return [v for v in runs or [] if isinstance(v, (int, float))]


def median(nums):
    """The median of NUMS (the mean of the middle two when their count is even); None for
    none."""
    return statistics.median(nums) if nums else None


def median_of_numbers(runs):
    """The median of the runs that gave a number; None when none did (a plot's bar)."""
    return median(numbers(runs))


def median_or_failure(runs):
    """The median when every run gave a number, else the first that did not, so a table
    shows that a run failed instead of the median of those that passed; None for no runs.
    The main bench's tables, --remote's and --shards'."""
    if not runs:
        return None
    nums = numbers(runs)
    if len(nums) == len(runs):
        return median(nums)
    return next(v for v in runs if not isinstance(v, (int, float)))


def median_or_last(runs):
    """The median of the runs that gave a number, else the last run's outcome (a timeout);
    None for no runs. --scale's and --inproc's tables: a run that failed beside others that
    passed does not show."""
    nums = numbers(runs)
    if nums:
        return median(nums)
    return runs[-1] if runs else None


def percentile(xs, q):
    """The Q-quantile of XS (0 <= Q <= 1), interpolated between the two nearest; NaN for
    none."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
