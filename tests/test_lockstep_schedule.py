"""The lockstep schedule's path conditions (pallet/distributed/lockstep_schedule.py):
sets of devices written as a disjunction of conjunctions of branch literals. Their
simplification must keep the set of devices exactly (checked against every assignment
of branch indices) and keep a thread that split at a wait and met again one thread."""
import itertools

from hypothesis import given, settings, strategies as st

from pallet.distributed.lockstep_schedule import TRUE, _and, _and_not, _Lit, _simplified

SOURCES = ("a", "b", "c")
BRANCHES = 3

literals = st.builds(_Lit, st.sampled_from(SOURCES), st.integers(0, BRANCHES - 1),
                     st.booleans())
conditions = st.frozensets(st.frozensets(literals, max_size=3), max_size=6)


def _holds(cond: frozenset, assignment: dict) -> bool:
  return any(all((assignment[lit.source] == lit.branch) == lit.holds for lit in conj)
             for conj in cond)


def _assignments():
  for values in itertools.product(range(BRANCHES), repeat=len(SOURCES)):
    yield dict(zip(SOURCES, values))


@settings(max_examples=300, deadline=None)
@given(conditions)
def test_simplifying_keeps_the_same_devices(cond):
  simplified = _simplified(cond)
  for assignment in _assignments():
    assert _holds(simplified, assignment) == _holds(cond, assignment), assignment


def test_threads_that_split_at_waits_meet_as_one():
  """Eight waits in branches that devices take differently: the devices on each wait's
  path stop and the others go on; once both halves meet again the condition is the one
  before the wait, not a disjunction that doubles at every wait (2**8 conjunctions)."""
  cond = TRUE
  for k in range(8):
    guard = frozenset({_Lit(f"check{k}", 1, True)})
    stopped, went_on = _and(cond, guard), _and_not(cond, guard)
    cond = _simplified(stopped | went_on)
    assert cond == TRUE, (k, len(cond))
